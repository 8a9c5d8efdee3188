"""`pdmesh bench profile` end to end on a tiny model (services/bench/profile.py): the file
it writes holds the points asked for (those the engine cannot run skipped and named), the
planner loads it and sizes pools with it; bad arguments and profile files are refused
naming what is wrong."""
from __future__ import annotations

import json

import pytest

from common.config import PlannerConfig
from services.cli import main
from services.meta_server.planner import LoadSample, Planner
from services.meta_server.profile_file import ProfileError, load_profile


def mesh_yaml(tmp_path, model, **engine) -> str:
    path = tmp_path / "mesh.yaml"
    engine = {"max_num_batched_tokens": 128, "max_num_seqs": 8, "num_blocks": 64, "max_model_len": 256, **engine}
    path.write_text(json.dumps({"model": str(model), "engine": engine,
                                "nodes": [{"role": "decode", "node_id": "decode-0", "engine": {"num_blocks": 96}}]}))
    return str(path)


def test_the_profile_it_writes_is_one_the_planner_loads(tiny_model, tmp_path, capsys):
    out = tmp_path / "profile.json"
    argv = ["bench", "profile", "--config", mesh_yaml(tmp_path, tiny_model("llama")), "--node-id", "decode-0",
            "--out", str(out), "--prompt-lens", "16,64,300", "--contexts", "32,200,250", "--batches", "1,8",
            "--decode-steps", "3"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    profile = load_profile(out)
    assert [p[0] for p in profile.prefill] == [16, 64]
    assert [(c, b) for c, b, _ in profile.decode] == [(32, 1), (32, 8), (200, 1)]
    assert all(ttft > 0 and rate > 0 for _, ttft, rate in profile.prefill)
    assert all(itl > 0 for _, _, itl in profile.decode)
    about = json.loads(out.read_text())["about"]
    # a decode point's requests make 3 + 1 + ceil(batch x context / 128) + 1 tokens (the
    # batch's prefill steps, then 3 with all of it decoding): 200 x 8 -> 8 x 218 tokens need
    # 8 x 14 blocks of 16 (the node has 96); context 250 -> 257 and 271 tokens
    assert about["skipped"] == ["prefill at 300 tokens: past max_model_len 256",
                                "decode at context 200, batch 8: needs 112 KV blocks, the engine has 96",
                                "decode at context 250, batch 1: 257 tokens is past max_model_len 256",
                                "decode at context 250, batch 8: 271 tokens is past max_model_len 256"]
    assert (about["node_id"], about["device"], about["max_num_seqs"], about["model_id"]) == (
        "decode-0", "cpu", 8, tiny_model("llama").name)
    assert f"wrote {out}: 2 prefill and 3 decode points" in printed
    assert "skipped: prefill at 300 tokens: past max_model_len 256" in printed

    planner = Planner(PlannerConfig(interval_s=10.0, ttft_slo_ms=1000.0, itl_slo_ms=1000.0, max_nodes=64), profile)
    wanted, reasons = planner.wanted(LoadSample(requests=100, mean_prompt_tokens=64, mean_output_tokens=16))
    assert wanted["prefill"] >= 1 and wanted["decode"] >= 1, reasons


@pytest.mark.parametrize("args,error", [
    (["--batches", "1,0"], "integers >= 1"),
    (["--decode-steps", "1"], "decode_steps must be an integer >= 2, got 1"),
    (["--node-id", "nope"], "node_id must be one of ['decode-0'], got 'nope'"),
    (["--prompt-lens", "300"], "no prefill point fits this engine: prefill at 300 tokens: past max_model_len 256"),
])
def test_bad_arguments_are_refused_naming_them(tiny_model, tmp_path, capsys, args, error):
    argv = ["bench", "profile", "--config", mesh_yaml(tmp_path, tiny_model("llama")), "--out",
            str(tmp_path / "p.json"), "--contexts", "32", "--batches", "1", *args]
    try:
        code = main(argv)
    except SystemExit as e:   # argparse refused the argument
        code = e.code
    assert code == 2
    assert error in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("content,error", [
    ("{", "not JSON"),
    (json.dumps({"format": "other"}), "\"format\" must be 'pdmesh-node-profile/1', got 'other'"),
    (json.dumps({"format": "pdmesh-node-profile/1", "prefill": []}), '"prefill" must be a non-empty list'),
    (json.dumps({"format": "pdmesh-node-profile/1", "prefill": [{"prompt_tokens": 8, "ttft_s": 0.1}]}),
     "prefill[0] must have exactly the keys ['prompt_tokens', 'ttft_s', 'tokens_per_s']"),
    (json.dumps({"format": "pdmesh-node-profile/1",
                 "prefill": [{"prompt_tokens": 8, "ttft_s": 0.1, "tokens_per_s": 10}],
                 "decode": [{"context_tokens": 8, "batch": 1.5, "itl_s": 0.1}]}),
     "decode[0].batch must be an integer > 0, got 1.5"),
    (json.dumps({"format": "pdmesh-node-profile/1",
                 "prefill": [{"prompt_tokens": 8, "ttft_s": 0.1, "tokens_per_s": 10}],
                 "decode": [{"context_tokens": 8, "batch": 1, "itl_s": 0.1},
                            {"context_tokens": 8, "batch": 1, "itl_s": 0.2}]}),
     "decode: a point is measured twice: (8, 1)"),
])
def test_a_bad_profile_file_is_refused_naming_the_entry(tmp_path, content, error):
    path = tmp_path / "profile.json"
    path.write_text(content)
    with pytest.raises(ProfileError) as err:
        load_profile(path)
    assert str(err.value).startswith(f"node profile {path}: ") and error in str(err.value)
