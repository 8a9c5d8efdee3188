"""The model's composition: the registry, linear layers' weight slots under tensor
parallelism (scales shard with their weights), the fused-layer rule of the quantization
seam, and a quantized checkpoint refused at load with its scheme named."""
from __future__ import annotations

import json

import pytest
import torch

from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.model.config import load_model_config
from common.model.layers.float_linear import FloatLinearMethod
from common.model.layers.linear import Linear, LinearMethod, LinearPart, WeightSpec
from common.model.layers.quant_config import FloatConfig, QuantizationConfig
from common.model.models.deepseek import DeepseekForCausalLM
from common.model.models.llama import LlamaForCausalLM
from common.model.registry import ARCHITECTURES, build_model, model_class
from common.model.tiny import make_tiny_model
from common.parallel.shard import plan_shard
from kernels import get_backend

SMALL = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=320)


def test_every_architecture_resolves_to_its_family():
    assert {arch: model_class(arch) for arch in ARCHITECTURES} == {
        "LlamaForCausalLM": LlamaForCausalLM, "MistralForCausalLM": LlamaForCausalLM,
        "Qwen2ForCausalLM": LlamaForCausalLM, "Qwen3ForCausalLM": LlamaForCausalLM,
        "Qwen3MoeForCausalLM": LlamaForCausalLM, "MixtralForCausalLM": LlamaForCausalLM,
        "DeepseekV2ForCausalLM": DeepseekForCausalLM, "DeepseekV3ForCausalLM": DeepseekForCausalLM}
    with pytest.raises(ValueError, match=r"architecture 'GPT2LMHeadModel' is not supported; allowed: "
                                         r"\['DeepseekV2ForCausalLM', 'DeepseekV3ForCausalLM', "
                                         r"'LlamaForCausalLM', 'MistralForCausalLM', 'MixtralForCausalLM', "
                                         r"'Qwen2ForCausalLM', 'Qwen3ForCausalLM', 'Qwen3MoeForCausalLM'\]"):
        model_class("GPT2LMHeadModel")


class ScaledInt8Spec(LinearMethod):
    """The parameter shapes of a W8A8-static-like scheme (int8 weight, a per-channel scale,
    a per-tensor input scale of each part, int4-packed codes), to check the slots the seam
    derives for them; its apply is the dequantized matmul."""

    scheme = "TEST"

    def weight_specs(self, layer):
        return [WeightSpec("weight", rows="out", cols="in", dtype=torch.int8),
                WeightSpec("weight_scale", rows="out", cols=1),
                WeightSpec("input_scale", rows="part"),
                WeightSpec("weight_packed", rows="out", cols="in", dtype=torch.int32, in_pack=8)]

    def apply(self, layer, backend, x, bias):
        w = layer.weight.float() * layer.weight_scale
        return torch.nn.functional.linear(x, w, bias)


def slots_of(linear: Linear, prefix: str = "p.") -> dict[str, tuple]:
    return {name: (tuple(s.param.shape), s.start, s.end, s.full_shape, s.source)
            for name, s in linear.weight_slots(prefix).items()}


def test_a_column_parallel_fused_layer_shards_every_parameter_with_its_rows():
    # rank 1 of 2 of q (8 rows) + k (4 rows) fused, 16 inputs
    parts = [LinearPart("q_proj", 8, 4, 4), LinearPart("k_proj", 4, 2, 2)]
    linear = Linear(parts, 16, ScaledInt8Spec(), torch.float32, bias=True)
    assert slots_of(linear) == {
        "p.q_proj.weight": ((6, 16), 0, 4, (8, 16), (slice(4, 8), slice(0, 16))),
        "p.q_proj.weight_scale": ((6, 1), 0, 4, (8, 1), (slice(4, 8),)),
        "p.q_proj.input_scale": ((2,), 0, 1, (1,), None),
        "p.q_proj.weight_packed": ((6, 2), 0, 4, (8, 2), (slice(4, 8), slice(0, 2))),
        "p.q_proj.bias": ((6,), 0, 4, (8,), (slice(4, 8),)),
        "p.k_proj.weight": ((6, 16), 4, 6, (4, 16), (slice(2, 4), slice(0, 16))),
        "p.k_proj.weight_scale": ((6, 1), 4, 6, (4, 1), (slice(2, 4),)),
        "p.k_proj.input_scale": ((2,), 1, 2, (1,), None),
        "p.k_proj.weight_packed": ((6, 2), 4, 6, (4, 2), (slice(2, 4), slice(0, 2))),
        "p.k_proj.bias": ((6,), 4, 6, (4,), (slice(2, 4),)),
    }
    assert linear.weight.dtype == torch.int8 and linear.weight_packed.dtype == torch.int32


def test_a_row_parallel_layer_splits_inputs_and_keeps_its_bias_whole():
    # rank 1 of 2: inputs [8, 16) of 16
    linear = Linear([LinearPart("o_proj", 6, 6)], 16, ScaledInt8Spec(), torch.float32, bias=True,
                    row_parallel=True, in_features=8, in_start=8)
    assert slots_of(linear) == {
        "p.o_proj.weight": ((6, 8), 0, 6, (6, 16), (slice(None), slice(8, 16))),
        "p.o_proj.weight_scale": ((6, 1), 0, 6, (6, 1), None),
        "p.o_proj.input_scale": ((1,), 0, 1, (1,), None),
        "p.o_proj.weight_packed": ((6, 1), 0, 6, (6, 2), (slice(None), slice(1, 2))),
        "p.o_proj.bias": ((6,), 0, 6, (6,), None),
    }
    with pytest.raises(ValueError, match="one part with all of its outputs"):
        Linear([LinearPart("o_proj", 6, 3)], 16, ScaledInt8Spec(), torch.float32, row_parallel=True)


class MixedConfig(QuantizationConfig):
    name = "test-mixed"

    def scheme_of(self, projection):
        return "W8A8" if projection.endswith("k_proj") else "FLOAT"

    def method_for(self, scheme):
        return FloatLinearMethod()


def test_fused_projections_of_different_types_are_refused_with_their_names(tmp_path):
    model = make_tiny_model("llama", tmp_path / "m", seed=3, **SMALL)
    cfg = load_model_config(model)
    with pytest.raises(ValueError, match=r"test-mixed: fused projections must share one quantization type "
                                         r"\(they are one matmul\); got model\.layers\.0\.self_attn\.q_proj=FLOAT, "
                                         r"model\.layers\.0\.self_attn\.k_proj=W8A8, "
                                         r"model\.layers\.0\.self_attn\.v_proj=FLOAT"):
        build_model(cfg, get_backend("ref", "cpu"), torch.float32, quant=MixedConfig())


def test_every_linear_of_a_float_model_gets_the_float_method_and_rank_rows(tmp_path):
    model = make_tiny_model("llama", tmp_path / "m", seed=3, **SMALL)
    cfg = load_model_config(model)
    lm = build_model(cfg, get_backend("ref", "cpu"), torch.float32, shard=plan_shard(cfg, 2, 1),
                     quant=FloatConfig())
    linears = dict(lm.linears())
    assert {type(linear.method) for linear in linears.values()} == {FloatLinearMethod}
    hd = cfg.head_dim
    qkv, o = linears["layers.0.self_attn.qkv"], linears["layers.0.self_attn.o"]
    assert (qkv.out_features, qkv.in_features, o.out_features, o.in_features, o.in_start) == (
        (2 + 2 * 1) * hd, 64, 64, 2 * hd, 2 * hd)


@pytest.mark.parametrize("files, message", [
    ({"quant_model_description.json": {"model_quant_type": "W8A8", "version": "1.0.0"}},
     r"quant_model_description\.json: no entry for 'model\.layers\.0\.self_attn\.q_proj\.weight'"),
    ({"config.json": {"quantization_config": {"quant_method": "gptq", "bits": 4}}},
     r"quantization 'gptq' is not supported; supported: \['float', 'compressed-tensors', 'msmodelslim'\]"),
    ({"quant_model_description_w8a8.json": {"model_quant_type": "W8A8"}},
     r"quant_model_description_w8a8\.json: msModelSlim descriptions are read from quant_model_description\.json"),
])
def test_a_quantized_checkpoint_it_cannot_read_is_refused_at_load(tmp_path, files, message):
    model = make_tiny_model("llama", tmp_path / "m", seed=3, **SMALL)
    for name, extra in files.items():
        path = model / name
        raw = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**raw, **extra}))
    with pytest.raises(ValueError, match=message):
        LLMEngine(EngineConfig(model=str(model), num_blocks=64))
