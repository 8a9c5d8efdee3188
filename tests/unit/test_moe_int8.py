"""W8A8-dynamic experts (layers/moe_int8.py): a tiny Qwen3-MoE's projections, its experts'
included, written int8 per channel in compressed-tensors' layout and in msModelSlim's
(W8A8_DYNAMIC, zero weight_offset), served by the engine against transformers computing the
same math in float64 (tests/moe_checkpoints.py w8a8_reference), judged as the dense W8A8
tests judge (a code rounding the other way in float32 moves the tokens after it): KL to the
float64 scheme within 1.5x of what its own float32 run reaches, and a quarter of the float
model's. Whole, expert-parallel at TP 2 and split by columns at TP 2 (each rank quantizing
its own columns of an expert's down input, as the reference does), and on the NPU emulator.
The int8 codes are what the engine holds; a non-zero offset, W8A8 static experts and int8
fused experts are refused by name."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.engine import LLM
from common.model.formats.compressed_tensors import SYMMETRIC_DIVISOR
from tests.conftest import assert_no_blocks_in_use
from tests.moe_checkpoints import IDS, save, w8a8_reference
from tests.msmodelslim_checkpoints import DIVISOR as MSMODELSLIM_DIVISOR
from tests.msmodelslim_checkpoints import write_msmodelslim
from tests.quant_checkpoints import kl, write_compressed_tensors_w8a8

FORMATS = {"compressed-tensors": ("model.safetensors", SYMMETRIC_DIVISOR),
           "msmodelslim": ("quant_model_weights.safetensors", MSMODELSLIM_DIVISOR)}
CASES = {"ref": dict(kernel_backend="ref"), "cpu": dict(kernel_backend="cpu"),
         "cpu-ep2": dict(kernel_backend="cpu", tensor_parallel_size=2, enable_expert_parallel=True),
         "cpu-tp2-columns": dict(kernel_backend="cpu", tensor_parallel_size=2),
         "npu": dict(kernel_backend="npu", block_size=128)}


@pytest.fixture(scope="module")
def float_model(tmp_path_factory, tiny_model):
    out = tmp_path_factory.mktemp("moe-float")
    save("qwen3_moe", "per-expert", out, tiny_model("llama"))
    return out


@pytest.fixture(scope="module")
def quantized(float_model):
    return {"compressed-tensors": write_compressed_tensors_w8a8(float_model, float_model.parent / "ct"),
            "msmodelslim": write_msmodelslim(float_model, float_model.parent / "msmodelslim", "W8A8_DYNAMIC", [])}


# each format at one TP 2 layout (a rank's scales and, msModelSlim's, offsets cut with its
# columns; whole experts a rank): the layouts' slicing is format-blind past that
SKIPPED_PAIRS = {("compressed-tensors", "cpu-tp2-columns"), ("msmodelslim", "cpu-ep2")}


@pytest.mark.parametrize("fmt,case", [(f, c) for f in FORMATS for c in CASES if (f, c) not in SKIPPED_PAIRS])
def test_int8_experts_compute_the_scheme(quantized, float_model, fmt, case, request):
    if case == "npu":
        request.getfixturevalue("npu_emulator")
    folder, (weights, divisor) = quantized[fmt], FORMATS[fmt]
    ranks = CASES[case].get("tensor_parallel_size", 1)
    ref = w8a8_reference(folder, weights, divisor, attention_ranks=ranks,
                         expert_ranks=ranks if case == "cpu-tp2-columns" else 1)
    with torch.no_grad():
        ref64 = torch.log_softmax(ref(torch.tensor([IDS])).logits[0, :-1], -1)
        ref32 = torch.log_softmax(ref.float()(torch.tensor([IDS])).logits[0, :-1].double(), -1)
    with LLM(str(folder), num_blocks=64, **CASES[case]) as llm:
        moe = [layer.mlp for layer in llm.engine.model.layers if hasattr(layer.mlp, "int8")]
        assert moe and all(m.int8 is not None and m.w13.dtype == torch.int8 for m in moe)   # the int8 path ran
        if case == "npu":      # the op's layout is a copy: the codes as loaded are released
            assert all(m.w13.numel() == 0 and m.w2.numel() == 0 for m in moe)
        ours = llm.prompt_logprobs_full(IDS).double()
        assert_no_blocks_in_use(llm.engine)
    with LLM(str(float_model), num_blocks=64, **CASES[case]) as llm:
        plain = llm.prompt_logprobs_full(IDS).double()
        assert_no_blocks_in_use(llm.engine)
    ours_kl, fp32_kl, float_kl = (kl(ref64, other).mean().item() for other in (ours, ref32, plain))
    assert ours_kl <= 1.5 * fp32_kl + 1e-5, (ours_kl, fp32_kl)
    assert ours_kl <= 0.25 * float_kl, (ours_kl, float_kl)


def test_the_engine_holds_the_files_codes(quantized):
    folder = quantized["msmodelslim"]
    tensors = load_file(folder / "quant_model_weights.safetensors")
    with LLM(str(folder), kernel_backend="ref", num_blocks=64) as llm:
        moe = llm.engine.model.layers[2].mlp
        p = "model.layers.2.mlp.experts.5."
        codes = moe.w13.view(8, 2 * 64, 128)[5]
        assert torch.equal(codes, torch.cat([tensors[p + "gate_proj.weight"], tensors[p + "up_proj.weight"]]))
        assert torch.equal(moe.int8.w13_scale[5, 0], torch.cat([tensors[p + "gate_proj.weight_scale"],
                                                                tensors[p + "up_proj.weight_scale"]])[:, 0])


def edited(folder, tmp_path, change, description=None):
    out = shutil.copytree(folder, tmp_path / "edited")
    tensors = load_file(out / "quant_model_weights.safetensors")
    change(tensors)
    save_file(tensors, out / "quant_model_weights.safetensors")
    if description:
        path = out / "quant_model_description.json"
        path.write_text(json.dumps(description(json.loads(path.read_text()))))
    return out


def test_a_nonzero_offset_is_refused(quantized, tmp_path):
    def change(t):
        t["model.layers.0.mlp.experts.3.up_proj.weight_offset"][7] = 2.0
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts.3.up_proj.weight_offset is not all zeros: "
                                         r"asymmetric int8 weights are not supported"):
        LLM(str(edited(quantized["msmodelslim"], tmp_path, change)), kernel_backend="ref", num_blocks=64)


def test_a_missing_scale_is_named(quantized, tmp_path):
    name = "model.layers.2.mlp.experts.6.down_proj.weight_scale"
    with pytest.raises(ValueError, match=rf"checkpoint is missing 1 tensor\(s\): {name}"):
        LLM(str(edited(quantized["msmodelslim"], tmp_path, lambda t: t.pop(name))), kernel_backend="ref",
            num_blocks=64)


def test_static_w8a8_experts_are_refused(quantized, tmp_path):
    def static(d):
        return {k: ("W8A8" if ".experts." in k and v == "W8A8_DYNAMIC" else v) for k, v in d.items()}
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts: quantization type W8A8 is not supported for "
                                         r"experts; supported: FLOAT, W8A8_DYNAMIC"):
        LLM(str(edited(quantized["msmodelslim"], tmp_path, lambda t: None, static)), kernel_backend="ref",
            num_blocks=64)
