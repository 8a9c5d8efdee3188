"""compressed-tensors W4A16 (pack-quantized: int4 codes per group of inputs, packed eight to
an int32) through the quantization seam. W4A16 is token-stable: greedy tokens equal
transformers running the dequantized weights in float64."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from common.engine import LLM, SamplingParams
from common.model.layers.int4_linear import unpack_int4
from common.model.tiny import make_tiny_model
from tests.quant_checkpoints import (dequantized_w4a16, pack_int4, quantize_per_group, w4a16_reference_model,
                                     write_compressed_tensors_w4a16)

SMALL = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=512)
GROUP = 32


@pytest.fixture(scope="module")
def float_model(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("w4a16") / "float", seed=7, **SMALL)


@pytest.fixture(scope="module")
def w4a16_model(float_model):
    return write_compressed_tensors_w4a16(float_model, float_model.parent / "w4a16", GROUP)


def test_unpacking_reads_each_code_at_its_bits():
    codes = torch.tensor([[-8, -1, 0, 1, 7, 3, -5, 2, 6, -7, 0, 0, 0, 0, 0, 0]], dtype=torch.int8)
    packed = pack_int4(codes)
    assert packed.shape == (1, 2)
    assert int(packed[0, 0]) & 0xF == 0 and (int(packed[0, 0]) >> 28) & 0xF == 2 + 8
    assert torch.equal(unpack_int4(packed) - 8, codes.to(torch.int32))


@pytest.mark.parametrize("backend_name", ["cpu", "ref", "npu"])
def test_greedy_tokens_equal_the_float64_dequantized_model(w4a16_model, backend_name, request):
    calls = request.getfixturevalue("npu_op_calls") if backend_name == "npu" else None
    prompt = list(range(5, 29))
    ref = w4a16_reference_model(w4a16_model, GROUP)
    ids = torch.tensor([prompt])
    want = []
    with torch.no_grad():
        for _ in range(16):
            nxt = int(ref(ids).logits[0, -1].argmax())
            want.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    llm = LLM(str(w4a16_model), kernel_backend=backend_name, num_blocks=64)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=16, temperature=0.0,
                                                                      ignore_eos=True))
    assert out[0].outputs[0].token_ids == want
    linears = dict(llm.engine.model.linears())
    assert {linear.method.scheme for linear in linears.values()} == {"W4A16"}
    if calls is not None:       # packed once per layer, multiplied once per layer and step
        assert calls["npu_convert_weight_to_int4pack"] == len(linears)
        assert calls["npu_weight_quant_batchmatmul"] >= 16 * len(linears)


@pytest.mark.parametrize("int4_kernel", [False, True], ids=["cpu-dequantized", "cpu-int4-kernel"])
def test_the_kernels_match_the_dequantized_weight(int4_kernel, monkeypatch):
    """cpu (oneDNN on the weight dequantized at load, or torch's packed int4 matmul) and
    ref's dequantized weight against float64, one layer."""
    from kernels import get_backend
    from kernels.cpu import CpuBackend, Int4Packed
    monkeypatch.setattr(CpuBackend, "use_int4_kernel", int4_kernel)
    torch.manual_seed(0)
    w = torch.randn(64, 128)
    codes, scale = quantize_per_group(w, GROUP)
    stored = codes.to(torch.int32) + 8
    x = torch.randn(5, 128)
    want = x.double() @ ((codes.double() * scale.double().repeat_interleave(GROUP, 1)).t())
    for name in ("cpu", "ref"):
        backend = get_backend(name, "cpu")
        prepared = backend.prepare_int4_weight(stored, scale.float(), GROUP, torch.float32)
        if name == "cpu":
            assert isinstance(prepared, Int4Packed) == int4_kernel
        got = backend.int4_linear(x, prepared, None)
        assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-4), name


def test_compressed_tensors_reads_the_layout_back(w4a16_model):
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    import json
    config = QuantizationConfig.model_validate(json.loads((w4a16_model / "config.json").read_text())
                                               ["quantization_config"])
    tensors = load_file(w4a16_model / "model.safetensors")
    prefix = "model.layers.1.self_attn.o_proj."
    out = PackedQuantizationCompressor.decompress(
        {k: tensors[prefix + k] for k in ("weight_packed", "weight_scale", "weight_shape")},
        config.config_groups["group_0"])
    assert torch.equal(out["weight"], dequantized_w4a16(tensors, prefix + "weight", GROUP).float())


def test_a_group_that_does_not_divide_the_inputs_is_refused(float_model, tmp_path):
    model = write_compressed_tensors_w4a16(float_model, tmp_path / "q", 32)
    import json
    cfg = json.loads((model / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 48
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"group_size 48 must be a multiple of 8 \(codes per int32\) dividing the input features \(128\)"):
        LLM(str(model), kernel_backend="ref", num_blocks=64)


def test_tensor_parallel_2_gives_the_same_tokens(w4a16_model):
    """Each rank reads its rows (column-parallel) or its groups of inputs (row-parallel) of
    the packed codes and scales."""
    prompt = list(range(5, 29))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    tokens = []
    for tp in (1, 2):
        with LLM(str(w4a16_model), tensor_parallel_size=tp, num_blocks=64) as llm:
            tokens.append(llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids)
    assert tokens[0] == tokens[1]
