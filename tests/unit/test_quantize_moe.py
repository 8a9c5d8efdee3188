"""`pdmesh quantize` on Mixture-of-Experts and MLA models (services/quantize/experts.py,
kept_float.py), on a tiny DeepSeek-V3 (MLA in both layers, layer 1 MoE: 8 routed experts
and a shared one): w8a8-dynamic writes every routed expert int8 per output channel with
the format's own divisor, bit for bit what an independent writer computes; kv_b_proj and
the router stay float in every scheme; a scheme the MoE layer cannot read experts in
leaves them float, says so, and loads; fused float experts are split into the per-expert
names the engine reads int8 experts by. Near the float model: the dense tests' measure
(KL a quarter of a model of other random weights', test_quantize.py)."""
from __future__ import annotations

import json
import logging
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.engine import LLM
from common.model.tiny import make_tiny_model
from services.cli import main as pdmesh_main
from services.quantize.experts import split_fused_experts
from services.quantize.kept_float import EXPERTS_IGNORE
from services.quantize.quantizer import QuantizeOptions, quantize_model
from tests.quant_checkpoints import quantize_per_channel

SMALL = dict(hidden_size=128, num_layers=2, num_heads=4, vocab_size=512)    # moe_intermediate_size 96
NUM_EXPERTS, INTER, HIDDEN = 8, 96, 128
IDS = list(range(3, 40))
PROJECTIONS = {"gate_proj": (INTER, 1), "up_proj": (INTER, 1), "down_proj": (HIDDEN, 1)}   # -> scale shape
FORMATS = {"modelslim": ("quant_model_weights.safetensors", 127.0),
           "compressed-tensors": ("model.safetensors", 127.5)}
KV_B = [f"model.layers.{i}.self_attn.kv_b_proj" for i in range(2)]
GATE = "model.layers.1.mlp.gate"


def prompts(n: int = 4, length: int = 48) -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, SMALL["vocab_size"]) for _ in range(length)] for _ in range(n)]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return make_tiny_model("deepseek_v3", tmp_path_factory.mktemp("quantize-moe") / "float", seed=3, **SMALL)


def logprobs(model_dir) -> torch.Tensor:
    with LLM(str(model_dir), kernel_backend="ref", num_blocks=64) as llm:
        return llm.prompt_logprobs_full(IDS).double()


def kl(p_log: torch.Tensor, q_log: torch.Tensor) -> float:
    return (p_log.exp() * (p_log - q_log)).sum(-1).mean().item()


@pytest.fixture(scope="module")
def far(deepseek):
    """KL from the float model to one of other random weights (what a misread costs)."""
    unrelated = make_tiny_model("deepseek_v3", deepseek.parent / "unrelated", seed=4, **SMALL)
    return kl(logprobs(deepseek), logprobs(unrelated))


def float_tensors_kept(floats: dict, tensors: dict) -> None:
    """kv_b_proj and the router (gate and correction bias) are the float model's, bit for bit."""
    for name in [*(p + ".weight" for p in KV_B), GATE + ".weight", GATE + ".e_score_correction_bias"]:
        assert tensors[name].dtype == torch.float32 and torch.equal(tensors[name], floats[name]), name


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_w8a8_dynamic_quantizes_every_expert_and_keeps_kv_b_proj_and_the_router_float(deepseek, far, tmp_path, fmt):
    out = quantize_model(deepseek, tmp_path / "q", prompts(), QuantizeOptions("w8a8-dynamic", fmt))
    weights_file, divisor = FORMATS[fmt]
    tensors, floats = load_file(out / weights_file), load_file(deepseek / "model.safetensors")
    for e in range(NUM_EXPERTS):
        for proj, scale_shape in PROJECTIONS.items():
            p = f"model.layers.1.mlp.experts.{e}.{proj}."
            codes, scale = quantize_per_channel(floats[p + "weight"], divisor)
            assert tensors[p + "weight"].dtype == torch.int8 and torch.equal(tensors[p + "weight"], codes), p
            assert tensors[p + "weight_scale"].shape == scale_shape and torch.equal(tensors[p + "weight_scale"], scale)
            if fmt == "modelslim":
                assert torch.equal(tensors[p + "weight_offset"], torch.zeros(scale_shape))
            else:
                assert p + "weight_offset" not in tensors
    float_tensors_kept(floats, tensors)
    if fmt == "modelslim":
        types = json.loads((out / "quant_model_description.json").read_text())
        assert [types[p + ".weight"] for p in KV_B] == ["FLOAT", "FLOAT"]
        assert types[GATE + ".weight"] == types[GATE + ".e_score_correction_bias"] == "FLOAT"
        assert {types[f"model.layers.1.mlp.experts.{e}.{p}.{s}"] for e in range(NUM_EXPERTS) for p in PROJECTIONS
                for s in ("weight", "weight_scale", "weight_offset")} == {"W8A8_DYNAMIC"}
    else:
        config = json.loads((out / "config.json").read_text())["quantization_config"]
        assert config["ignore"] == ["lm_head", *KV_B, GATE]
    with LLM(str(out), kernel_backend="ref", num_blocks=64) as llm:
        model = llm.engine.model
        schemes = {name: linear.method.scheme for name, linear in model.linears()}
        assert {n for n, s in schemes.items() if s == "FLOAT"} == {"layers.0.self_attn.kv_b", "layers.1.self_attn.kv_b"}
        assert set(schemes.values()) == {"FLOAT", "W8A8_DYNAMIC"}
        assert model.layers[1].mlp.int8 is not None and model.layers[1].mlp.int8.divisor == divisor
        quantized = llm.prompt_logprobs_full(IDS).double()
    assert kl(logprobs(deepseek), quantized) < 0.25 * far


@pytest.mark.parametrize("scheme, fmt, linears", [("w8a8", "modelslim", "W8A8"),
                                                  ("w4a16", "compressed-tensors", "W4A16")])
def test_a_scheme_the_experts_cannot_take_leaves_them_float_says_so_and_loads(deepseek, far, tmp_path, caplog,
                                                                              scheme, fmt, linears):
    caplog.set_level(logging.INFO, logger="pdmesh.quantize")
    out = quantize_model(deepseek, tmp_path / "q", prompts(), QuantizeOptions(scheme, fmt, group_size=16))
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stayed FLOAT")]
    assert said == ["stayed FLOAT: kv_b_proj in 2 layer(s) (MLA's decode absorbs it into the query and output); "
                    "the router gate of 1 MoE layer(s) (not a Linear the engine quantizes); the routed experts "
                    f"(--scheme {scheme}: the engine's MoE layer reads experts FLOAT or W8A8_DYNAMIC only; "
                    "w8a8-dynamic quantizes them)"]
    tensors, floats = load_file(out / FORMATS[fmt][0]), load_file(deepseek / "model.safetensors")
    experts = [f"model.layers.1.mlp.experts.{e}.{p}.weight" for e in range(NUM_EXPERTS) for p in PROJECTIONS]
    assert all(torch.equal(tensors[name], floats[name]) for name in experts)
    assert not [name for name in tensors if ".experts." in name and name not in experts]
    float_tensors_kept(floats, tensors)
    if fmt == "modelslim":
        types = json.loads((out / "quant_model_description.json").read_text())
        assert {types[name] for name in experts} == {"FLOAT"}
    else:
        config = json.loads((out / "config.json").read_text())["quantization_config"]
        assert config["ignore"] == ["lm_head", *KV_B, GATE, EXPERTS_IGNORE]
    with LLM(str(out), kernel_backend="ref", num_blocks=64) as llm:
        model = llm.engine.model
        assert model.layers[1].mlp.int8 is None
        assert {linear.method.scheme for _, linear in model.linears()} == {"FLOAT", linears}
        quantized = llm.prompt_logprobs_full(IDS).double()
    assert kl(logprobs(deepseek), quantized) < 0.25 * far


def test_fused_float_experts_are_quantized_under_the_per_expert_names(tmp_path):
    """A Qwen3-MoE whose experts are fused (transformers 5's layout): its w8a8-dynamic copy
    holds per-expert int8 experts and loads."""
    model = make_tiny_model("qwen3_moe", tmp_path / "float", seed=5, num_experts=4, **SMALL)
    tensors = load_file(model / "model.safetensors")
    for layer in range(SMALL["num_layers"]):
        p = f"model.layers.{layer}.mlp."
        per = [{n: tensors.pop(f"{p}experts.{e}.{n}_proj.weight") for n in ("gate", "up", "down")} for e in range(4)]
        tensors[p + "experts.gate_up_proj"] = torch.stack([torch.cat([x["gate"], x["up"]]) for x in per])
        tensors[p + "experts.down_proj"] = torch.stack([x["down"] for x in per])
    save_file(tensors, model / "model.safetensors")
    out = quantize_model(model, tmp_path / "q", prompts(), QuantizeOptions("w8a8-dynamic", "modelslim"))
    written = load_file(out / "quant_model_weights.safetensors")
    assert not [n for n in written if "gate_up_proj" in n or n.endswith("experts.down_proj")]
    inter = tensors["model.layers.1.mlp.experts.gate_up_proj"].shape[1] // 2
    up = tensors["model.layers.1.mlp.experts.gate_up_proj"][3, inter:]
    assert torch.equal(written["model.layers.1.mlp.experts.3.up_proj.weight"], quantize_per_channel(up, 127.0)[0])
    with LLM(str(out), kernel_backend="ref", num_blocks=64) as llm:
        assert all(layer.mlp.int8 is not None for layer in llm.engine.model.layers)


def test_split_fused_experts_gives_each_family_its_per_expert_names():
    gate_up, down = torch.arange(2 * 4 * 3.0).view(2, 4, 3), torch.arange(2 * 3 * 2.0).view(2, 3, 2)
    gate, bias = torch.ones(2, 3), torch.zeros(2)
    fused = {"model.layers.0.mlp.experts.gate_up_proj": gate_up, "model.layers.0.mlp.experts.down_proj": down,
             "model.layers.0.mlp.gate.weight": gate, "model.layers.0.mlp.gate.e_score_correction_bias": bias}
    for model_type, module, (g, u, d) in (("qwen3_moe", "mlp.", ("gate_proj", "up_proj", "down_proj")),
                                          ("deepseek_v3", "mlp.", ("gate_proj", "up_proj", "down_proj")),
                                          ("mixtral", "block_sparse_moe.", ("w1", "w3", "w2"))):
        tensors = dict(fused)
        assert split_fused_experts(tensors, model_type) == 1
        p = "model.layers.0." + module
        want = {**{f"{p}experts.{e}.{n}.weight": t for e in range(2)
                   for n, t in ((g, gate_up[e, :2]), (u, gate_up[e, 2:]), (d, down[e]))},
                p + "gate.weight": gate, p + "gate.e_score_correction_bias": bias}
        assert sorted(tensors) == sorted(want) and all(torch.equal(tensors[k], want[k]) for k in want)


@pytest.mark.parametrize("args, message", [
    (["--scheme", "w8a8-dynamic+c8", "--format", "modelslim"],
     "--scheme w8a8-dynamic+c8: C8 (an int8 KV cache with per-channel K and V scales) does not apply to "
     "deepseek_v3: MLA's cache holds the latent, not per-head K and V"),
    (["--scheme", "w4a16", "--format", "compressed-tensors", "--group-size", "32"],
     "--group-size 32 must divide every projection's inputs; it does not divide q_lora_rank = 48; 16 fits"),
])
def test_mla_requests_it_cannot_serve_are_refused_before_calibrating(deepseek, tmp_path, capsys, args, message):
    code = pdmesh_main(["quantize", str(deepseek), "--calib", "gpl-3", "--out", str(tmp_path / "q"),
                        "--num-prompts", "1", "--prompt-len", "16", *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
