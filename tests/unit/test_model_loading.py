"""Checkpoint loading: sharded safetensors, and clear errors naming the file and tensor."""
from __future__ import annotations

import io
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from common.config import EngineConfig
from common.engine import SamplingParams
from common.engine.llm_engine import LLMEngine
from common.model.config import load_model_config
from common.model.tiny import make_tiny_model
from common.model.formats.checkpoint import iter_checkpoint
from common.model.formats.safetensors import checkpoint_files

SMALL = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=320)


@pytest.fixture()
def small_model(tmp_path):
    return make_tiny_model("llama", tmp_path / "m", seed=3, **SMALL)


def greedy(model_dir, prompt=(5, 6, 7, 8, 9)):
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_blocks=64))
    engine.add_request("r", list(prompt), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    tokens = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    assert engine.num_used_blocks == 0
    return tokens


def test_sharded_checkpoint_gives_the_same_tokens(tmp_path, small_model):
    sharded = make_tiny_model("llama", tmp_path / "sharded", seed=3, max_shard_bytes=200_000, **SMALL)
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    assert greedy(sharded) == greedy(small_model)


def test_unknown_architecture_names_the_file_and_allowed_values(small_model):
    cfg = json.loads((small_model / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (small_model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config\.json: architectures=\['GPT2LMHeadModel'\] is not supported; "
                                         r"allowed: \['DeepseekV2ForCausalLM', 'DeepseekV3ForCausalLM', "
                                         r"'LlamaForCausalLM', 'MistralForCausalLM'"):
        load_model_config(small_model)


def test_missing_tensor_is_named(small_model):
    path = small_model / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\): model\.layers\.1\.mlp\.up_proj\.weight"):
        LLMEngine(EngineConfig(model=str(small_model), num_blocks=8))


def test_shape_mismatch_names_the_file_and_tensor(small_model):
    path = small_model / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.k_proj\.weight' "
                                         r"has shape \(3, 64\), expected \(32, 64\)"):
        LLMEngine(EngineConfig(model=str(small_model), num_blocks=8))


def test_no_checkpoint_file_is_a_clear_error(tmp_path, small_model):
    (small_model / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        LLMEngine(EngineConfig(model=str(small_model), num_blocks=8))


def test_unknown_engine_argument_lists_the_allowed_ones():
    with pytest.raises(ValueError, match=r"unknown engine argument\(s\) \['max_seqs'\]; allowed: "):
        EngineConfig.from_kwargs("m", max_seqs=3)


def test_loading_shows_bytes_and_tensors_as_it_goes(tmp_path):
    sharded = make_tiny_model("llama", tmp_path / "sharded", seed=3, max_shard_bytes=200_000, **SMALL)
    tensors = {name: t for f in checkpoint_files(sharded) for name, t in load_file(str(f)).items()}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    bar = io.StringIO()
    names = [name for name, _, _ in iter_checkpoint(sharded, progress=bar)]
    assert sorted(names) == sorted(tensors)
    final = bar.getvalue().split("\r")[-1]
    size = tqdm.format_sizeof(total, divisor=1024)
    assert final.startswith("loading weights: 100%") and f"{size}/{size}" in final
    assert f"tensors {len(tensors)}/{len(tensors)}" in final
