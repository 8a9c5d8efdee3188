"""common.model.tiny + `pdmesh make-tiny-model`: deterministic HF folders that HF loads."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from common.model.tiny import make_tiny_model, shard_safetensors

ARCHS = ("llama", "qwen2", "qwen3")
SMALL = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def small_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(arch, root / arch, seed=0, **SMALL) for arch in ARCHS}


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny matmuls gain nothing from threads and crawl when other processes hold the cores."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def _files(model_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(model_dir.iterdir())}


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def _load_hf(model_dir: Path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    return model.eval(), info


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a = _files(make_tiny_model("llama", tmp_path / "a", seed=7, **SMALL))
    b = _files(make_tiny_model("llama", tmp_path / "b", seed=7, **SMALL))
    c = _files(make_tiny_model("llama", tmp_path / "c", seed=8, **SMALL))
    assert set(a) == FILES
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"]
    assert {k: v for k, v in a.items() if k != "model.safetensors"} == {
        k: v for k, v in c.items() if k != "model.safetensors"
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_tensor_names_and_shapes(small_models, arch):
    tensors = _tensors(small_models[arch])
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    if arch != "qwen2":  # qwen2 ties lm_head to the embeddings by default
        expected.add("lm_head.weight")
    for i in range(2):
        p = f"model.layers.{i}."
        expected |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
        expected |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        expected |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        if arch == "qwen2":
            expected |= {p + f"self_attn.{x}_proj.bias" for x in "qkv"}
        if arch == "qwen3":
            expected |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
    assert set(tensors) == expected
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert tensors["model.embed_tokens.weight"].shape == (1024, 64)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 16, 64)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 16, 64)
    assert tensors["model.layers.0.mlp.gate_proj.weight"].shape == (192, 64)  # 2.75 * 64 -> 192
    norm = tensors["model.layers.0.input_layernorm.weight"]
    assert 0.9 < norm.mean().item() < 1.1 and norm.std().item() > 0.01


@pytest.mark.parametrize("arch", ARCHS)
def test_config_files(small_models, arch):
    d = small_models[arch]
    cfg = json.loads((d / "config.json").read_text())
    gen = json.loads((d / "generation_config.json").read_text())
    tok_cfg = json.loads((d / "tokenizer_config.json").read_text())
    assert cfg["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                     "qwen3": "Qwen3ForCausalLM"}[arch]]
    assert (cfg["model_type"], cfg["torch_dtype"], cfg["dtype"]) == (arch, "float32", "float32")
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (64, 2, 1024)
    assert cfg["tie_word_embeddings"] is (arch == "qwen2")
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    if arch == "llama":
        assert (cfg["bos_token_id"], cfg["eos_token_id"], gen["eos_token_id"]) == (1, 2, 2)
        assert (tok_cfg["bos_token"], tok_cfg["eos_token"], tok_cfg["add_bos_token"]) == ("<s>", "</s>", True)
    else:
        assert (cfg["bos_token_id"], cfg["eos_token_id"], gen["eos_token_id"]) == (1021, 1021, [1023, 1021])
        assert (tok_cfg["bos_token"], tok_cfg["eos_token"], tok_cfg["add_bos_token"]) == (None, "<|endoftext|>", False)
    assert ("head_dim" in cfg) is (arch != "qwen2")


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_loads_every_tensor(small_models, arch):
    model, info = _load_hf(small_models[arch])
    assert {k: len(v) for k, v in info.items()} == {
        "missing_keys": 0, "unexpected_keys": 0, "mismatched_keys": 0, "error_msgs": 0}
    ours = _tensors(small_models[arch])
    state = model.state_dict()
    for name, tensor in ours.items():
        assert torch.equal(state[name], tensor), name
    if arch == "qwen2":
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_rope_fields_reach_hf(tmp_path):
    from transformers import AutoConfig

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024}
    d = make_tiny_model("llama", tmp_path, rope_theta=500000.0, rope_scaling=scaling, **SMALL)
    rope = AutoConfig.from_pretrained(d).rope_parameters
    assert rope["rope_theta"] == 500000.0 and rope["rope_type"] == "llama3" and rope["factor"] == 8.0


@pytest.mark.parametrize("arch", ARCHS)
def test_default_size_is_small_and_greedy_is_varied(tmp_path, arch):
    start = time.perf_counter()
    d = make_tiny_model(arch, tmp_path)
    print(f"{arch}: built in {time.perf_counter() - start:.2f} s")
    assert (d / "model.safetensors").stat().st_size < 16 << 20   # quick to build, load and run in every test
    model, _ = _load_hf(d)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(d)
    for prompt in ("The river ran slowly", "中文：今天天气很好 🚀"):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=64, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True, pad_token_id=0)
        new_ids = out.sequences[0, ids.shape[1]:].tolist()
        assert len(new_ids) == 64  # specials' logits are shrunk: no early eos
        assert len(set(new_ids)) >= 12, new_ids
        top2 = torch.stack([s[0].topk(2).values for s in out.scores])
        rel_margin = (top2[:, 0] - top2[:, 1]) / top2[:, 0].abs()
        assert rel_margin.median().item() > 1e-2
        assert (rel_margin > 1e-3).float().mean().item() > 0.8


def test_shard_safetensors_round_trip(tmp_path):
    d = make_tiny_model("qwen3", tmp_path / "m", **SMALL)
    whole = _tensors(d)
    shards = shard_safetensors(d, 100_000)
    assert [p.name for p in shards] == [f"model-{k:05d}-of-{len(shards):05d}.safetensors"
                                        for k in range(1, len(shards) + 1)]
    assert len(shards) > 2 and not (d / "model.safetensors").exists()
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(whole)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in whole.values())
    assert index["weight_map"]["model.embed_tokens.weight"] == shards[0].name
    for path in shards:
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
            assert all(index["weight_map"][n] == path.name for n in names)
            size = sum(f.get_tensor(n).numel() * 4 for n in names)
            assert size <= 100_000 or len(names) == 1
    resharded = _tensors(d)
    assert resharded.keys() == whole.keys() and all(torch.equal(whole[k], resharded[k]) for k in whole)
    _, info = _load_hf(d)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    again = make_tiny_model("qwen3", tmp_path / "m2", max_shard_bytes=100_000, **SMALL)
    assert _files(again) == _files(d)


def test_bad_arguments_raise_value_error(tmp_path):
    with pytest.raises(ValueError, match="llama"):
        make_tiny_model("mistral", tmp_path)
    with pytest.raises(ValueError, match="head_dim"):
        make_tiny_model("qwen2", tmp_path, head_dim=32, **SMALL)
    with pytest.raises(ValueError, match="num_kv_heads"):
        make_tiny_model("llama", tmp_path, num_heads=4, num_kv_heads=3)


def test_cli_writes_same_folder_as_library(tmp_path):
    cmd = [sys.executable, "-m", "services.cli", "make-tiny-model", "--arch", "qwen3", "--out",
           str(tmp_path / "cli"), "--seed", "3", "--hidden-size", "64", "--num-layers", "2",
           "--num-heads", "4", "--num-kv-heads", "2"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "model.safetensors" in proc.stdout and str(tmp_path / "cli") in proc.stdout
    lib = make_tiny_model("qwen3", tmp_path / "lib", seed=3, **SMALL)
    assert _files(tmp_path / "cli") == _files(lib)  # another process, another hash seed


def test_cli_rejects_unknown_arch(tmp_path):
    from services.cli import main

    with pytest.raises(SystemExit) as e:
        main(["make-tiny-model", "--arch", "gpt2", "--out", str(tmp_path)])
    assert e.value.code == 2
    assert main(["make-tiny-model", "--arch", "qwen2", "--out", str(tmp_path), "--head-dim", "7"]) == 2


def test_deepseek_v3_is_read_whole_by_transformers_and_the_engine_agrees(tmp_path):
    """--arch deepseek_v3: MLA, a dense layer 0, MoE layers with a shared expert and the
    grouped sigmoid router; every tensor taken by transformers, greedy tokens equal."""
    from common.engine import LLM, SamplingParams

    d = make_tiny_model("deepseek_v3", tmp_path, hidden_size=128, num_layers=3, num_heads=4)
    cfg = json.loads((d / "config.json").read_text())
    assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["n_routed_experts"], cfg["first_k_dense_replace"]) == \
        (32, 8, 8, 1)
    tensors = _tensors(d)
    assert tensors["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"].shape == (32 + 8, 128)
    assert "model.layers.0.mlp.gate_proj.weight" in tensors and "model.layers.1.mlp.shared_experts.up_proj.weight" in tensors
    model, info = _load_hf(d)
    assert {k: len(v) for k, v in info.items()} == {
        "missing_keys": 0, "unexpected_keys": 0, "mismatched_keys": 0, "error_msgs": 0}
    ids = [1, 17, 400, 9, 23, 610, 5, 77]
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    with LLM(str(d), kernel_backend="cpu", num_blocks=32) as llm:
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        assert list(out[0].outputs[0].token_ids) == want
    with pytest.raises(ValueError, match="num_experts must be a multiple of 4"):
        make_tiny_model("deepseek_v3", tmp_path / "bad", num_experts=6, **SMALL)
