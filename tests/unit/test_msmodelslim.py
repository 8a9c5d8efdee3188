"""msModelSlim W8A8 (static), W8A8_DYNAMIC and W8A8_MIX through the quantization seam, on
checkpoints in its exporter's layout (tests/msmodelslim_checkpoints.py), against a float64
reference of each scheme computed from the written tensors. Qwen2 has q/k/v biases: the
static path must take them from quant_bias only."""
from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.config import mesh_config_from_dict
from common.engine import LLM
from common.model.tiny import make_tiny_model
from tests.msmodelslim_checkpoints import reference_model, write_msmodelslim

SMALL = dict(hidden_size=128, num_layers=1, num_heads=4, num_kv_heads=2, vocab_size=512)
IDS = list(range(3, 40))


def calibration_prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, vocab) for _ in range(48)] for _ in range(4)]


@pytest.fixture(scope="module")
def float_model(tmp_path_factory):
    return make_tiny_model("qwen2", tmp_path_factory.mktemp("msmodelslim") / "float", seed=3, **SMALL)


@pytest.fixture(scope="module")
def checkpoints(float_model):
    prompts = calibration_prompts(SMALL["vocab_size"])
    return {kind: write_msmodelslim(float_model, float_model.parent / kind, kind, prompts)
            for kind in ("W8A8", "W8A8_DYNAMIC", "W8A8_MIX")}


def kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    return (p_log.exp() * (p_log - q_log)).sum(-1)


def logprobs(model_dir, **kwargs) -> torch.Tensor:
    with LLM(str(model_dir), num_blocks=64, **kwargs) as llm:
        return llm.prompt_logprobs_full(IDS).double()


def reference_kls(model_dir, path: str, ours: torch.Tensor) -> tuple[float, float]:
    """(KL from the float64 reference to ours, to the reference's own float32 run)."""
    ref = reference_model(model_dir, path)
    with torch.no_grad():
        ref64 = torch.log_softmax(ref(torch.tensor([IDS])).logits[0, :-1], -1)
        ref32 = torch.log_softmax(ref.float()(torch.tensor([IDS])).logits[0, :-1].double(), -1)
    return kl(ref64, ours).mean().item(), kl(ref64, ref32).mean().item()


@pytest.mark.parametrize("kind, path", [("W8A8", "static"), ("W8A8_DYNAMIC", "dynamic")])
@pytest.mark.parametrize("backend", ["cpu", "ref", "npu"])
def test_each_scheme_is_as_close_to_its_float64_math_as_float32_gets(checkpoints, kind, path, backend, request):
    calls = request.getfixturevalue("npu_op_calls") if backend == "npu" else None
    ours_kl, fp32_kl = reference_kls(checkpoints[kind], path, logprobs(checkpoints[kind], kernel_backend=backend))
    assert ours_kl <= 1.5 * fp32_kl + 2e-5, (ours_kl, fp32_kl)   # 2e-5: about one code that rounds the other way
    if calls is not None:       # every projection of every step went through the NPU's quantized ops
        quantize = "npu_quantize" if path == "static" else "npu_dynamic_quant"
        assert calls["npu_quant_matmul"] == calls[quantize] > 0 and calls["npu_quant_matmul"] % 4 == 0


def test_the_static_path_never_adds_the_float_bias(checkpoints):
    """The same checkpoint with its float biases zeroed gives the same distributions: they
    are folded into quant_bias (a path that added them would move every logit)."""
    ours = logprobs(checkpoints["W8A8"], kernel_backend="ref")
    tensors = load_file(checkpoints["W8A8"] / "quant_model_weights.safetensors")
    biases = [name for name in tensors if name.endswith("proj.bias")]
    assert biases, "qwen2 has q/k/v biases"
    for name in biases:
        tensors[name] = torch.full_like(tensors[name], 100.0)
    moved = checkpoints["W8A8"].parent / "W8A8-bias"
    shutil.copytree(checkpoints["W8A8"], moved, dirs_exist_ok=True)
    save_file(tensors, moved / "quant_model_weights.safetensors")
    assert torch.equal(logprobs(moved, kernel_backend="ref"), ours)


@pytest.mark.parametrize("path, kind", [("static", "W8A8"), ("dynamic", "W8A8_DYNAMIC")])
def test_w8a8_mix_runs_the_path_it_is_given(checkpoints, path, kind):
    """W8A8_MIX carries both sets: each path computes exactly what the checkpoint of that
    scheme alone computes (same tensors, same math)."""
    mixed = logprobs(checkpoints["W8A8_MIX"], kernel_backend="ref", w8a8_mix_path=path)
    assert torch.equal(mixed, logprobs(checkpoints[kind], kernel_backend="ref"))


def test_w8a8_mix_is_dynamic_offline_and_static_on_a_decode_node(checkpoints):
    assert torch.equal(logprobs(checkpoints["W8A8_MIX"], kernel_backend="ref"),
                       logprobs(checkpoints["W8A8_DYNAMIC"], kernel_backend="ref"))
    mesh = mesh_config_from_dict({"model": str(checkpoints["W8A8_MIX"]), "nodes": [
        {"node_id": "p0", "role": "prefill"}, {"node_id": "d0", "role": "decode"}, {"node_id": "b0", "role": "both"},
        {"node_id": "d1", "role": "decode", "engine": {"w8a8_mix_path": "dynamic"}}]})
    assert {n.node_id: mesh.engine_config(n).w8a8_mix_path for n in mesh.nodes} == {
        "p0": "dynamic", "d0": "static", "b0": "dynamic", "d1": "dynamic"}


def test_deq_scale_stored_as_float32_bits_reads_the_same(float_model, checkpoints, tmp_path):
    bits = write_msmodelslim(float_model, tmp_path / "bits", "W8A8", calibration_prompts(SMALL["vocab_size"]),
                             deq_scale_bits=True)
    assert load_file(bits / "quant_model_weights.safetensors")["model.layers.0.mlp.up_proj.deq_scale"].dtype \
        == torch.int64
    assert torch.equal(logprobs(bits, kernel_backend="ref"), logprobs(checkpoints["W8A8"], kernel_backend="ref"))


def test_static_quant_bias_is_added_once_at_tensor_parallel_size_2(checkpoints):
    """Row-parallel o/down: rank 0 alone adds quant_bias, so TP 2 computes TP 1's math (its
    per-tensor scales are the same on every rank)."""
    tp1 = logprobs(checkpoints["W8A8"])
    tp2 = logprobs(checkpoints["W8A8"], tensor_parallel_size=2)
    assert kl(tp1, tp2).mean().item() < 1e-4


def edited(checkpoint, tmp_path, tensors=None, description=None):
    out = shutil.copytree(checkpoint, tmp_path / "edited")
    if tensors is not None:
        weights = load_file(out / "quant_model_weights.safetensors")
        tensors(weights)
        save_file(weights, out / "quant_model_weights.safetensors")
    if description is not None:
        desc = json.loads((out / "quant_model_description.json").read_text())
        description(desc)
        (out / "quant_model_description.json").write_text(json.dumps(desc))
    return out


@pytest.mark.parametrize("kind, tensors, description, message", [
    ("W8A8", lambda t: t["model.layers.0.self_attn.k_proj.input_scale"].mul_(2), None,
     r"fused projections quantize one input, so their input_scale must be equal; got "
     r"model\.layers\.0\.self_attn\.q_proj\.input_scale=.*, model\.layers\.0\.self_attn\.k_proj\.input_scale="),
    ("W8A8_DYNAMIC", lambda t: t["model.layers.0.mlp.down_proj.weight_offset"].add_(1), None,
     r"model\.layers\.0\.mlp\.down_proj\.weight_offset is not all zeros: asymmetric int8 weights are not supported"),
    ("W8A8", None, lambda d: d.update({"model.layers.0.mlp.down_proj.weight": "W8A16"}),
     r"'model\.layers\.0\.mlp\.down_proj\.weight' has type 'W8A16', which is not supported; supported: "
     r"\['FLOAT', 'W8A8', 'W8A8_DYNAMIC', 'W8A8_MIX'\]"),
    ("W8A8", None, lambda d: d.update({"model.layers.0.mlp.up_proj.weight": "W8A8_DYNAMIC"}),
     r"fused projections must share one quantization type \(they are one matmul\); got "
     r"model\.layers\.0\.mlp\.gate_proj=W8A8, model\.layers\.0\.mlp\.up_proj=W8A8_DYNAMIC"),
    ("W8A8", None, lambda d: d.update(kv_cache_type="FAKQuant"), r"kv_cache_type 'FAKQuant' is not supported; supported: 'C8'"),
    ("W8A8", lambda t: t.pop("model.layers.0.self_attn.o_proj.deq_scale"), None,
     r"checkpoint is missing 1 tensor\(s\): model\.layers\.0\.self_attn\.o_proj\.deq_scale"),
])
def test_bad_checkpoints_are_refused_at_load_naming_the_tensor(checkpoints, tmp_path, kind, tensors, description,
                                                               message):
    with pytest.raises(ValueError, match=message):
        LLM(str(edited(checkpoints[kind], tmp_path, tensors, description)), kernel_backend="ref", num_blocks=64)
