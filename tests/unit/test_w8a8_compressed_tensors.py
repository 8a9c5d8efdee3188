"""compressed-tensors W8A8 (int-quantized: int8 per-channel weights, int8 per-token dynamic
activations) through the quantization seam, on every kernel backend's int8 path.

The layer's math against float64 on the same input; the whole model against transformers
running the same math in float64 (tests/quant_checkpoints.py): W8A8 greedy tokens are
fragile (a code that rounds the other way in float32 moves everything after it), so the
model is judged by how close its distributions come, next to what the same math in
float32 reaches."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.engine import LLM
from common.model.formats.compressed_tensors import SYMMETRIC_DIVISOR
from common.model.layers.int8_linear import Int8DynamicLinearMethod
from common.model.layers.linear import Linear, LinearPart
from common.model.tiny import make_tiny_model
from kernels import get_backend
from tests.quant_checkpoints import (
    W8A8_CONFIG,
    fake_quant_per_token,
    kl,
    quantize_per_channel,
    w8a8_reference_model,
    write_compressed_tensors_w8a8,
)

SMALL = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=512)
BACKENDS = ("ref", "cpu", "npu")


@pytest.fixture(scope="module")
def float_model(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("w8a8") / "float", seed=5, **SMALL)


@pytest.fixture(scope="module")
def w8a8_model(float_model):
    return write_compressed_tensors_w8a8(float_model, float_model.parent / "w8a8")


def backend_of(name: str):
    if name == "npu":
        from kernels.testing.fake_torch_npu import install
        install()
    return get_backend(name, "cpu")


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_the_layer_computes_the_scheme_exactly_where_codes_agree(backend_name):
    torch.manual_seed(0)
    backend = backend_of(backend_name)
    w = torch.randn(48, 96)
    codes, scale = quantize_per_channel(w, SYMMETRIC_DIVISOR)
    layer = Linear([LinearPart("proj", 48, 48)], 96, Int8DynamicLinearMethod(SYMMETRIC_DIVISOR), torch.float32,
                   bias=True)
    layer.weight.data.copy_(codes)
    layer.weight_scale.data.copy_(scale)
    layer.bias.data.copy_(torch.randn(48))
    layer.prepare(backend)
    x = torch.randn(7, 96) * torch.logspace(-2, 2, 7)[:, None]       # rows of very different ranges
    x[3] = 0                                                         # and an all-zero row
    got = layer(x, backend)

    x_q, x_scale = backend.quantize_per_token(x, SYMMETRIC_DIVISOR)
    amax = x.double().abs().amax(-1, keepdim=True)
    want_scale = torch.where(amax > 0, amax / SYMMETRIC_DIVISOR, torch.ones_like(amax))
    want_codes = torch.round(x.double() / want_scale).clamp(-128, 127)
    assert x_q.dtype == torch.int8 and (x_q.double() - want_codes).abs().max() <= 1
    assert torch.allclose(x_scale.double(), want_scale, rtol=1e-6, atol=0)
    assert x_q[3].abs().sum() == 0
    want = (want_codes @ codes.double().t()) * want_scale * scale.double().t() + layer.bias.double()
    same_codes = (x_q.double() == want_codes).all(-1)
    assert same_codes.sum() >= 6
    assert torch.allclose(got.double()[same_codes], want[same_codes], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend_name", ["cpu", "ref", "npu"])
def test_the_model_is_as_close_to_the_float64_scheme_as_float32_gets(w8a8_model, float_model, backend_name,
                                                                     request):
    """KL per position from transformers computing the same W8A8 math in float64: ours within
    1.5x of what transformers' own float32 run of that math reaches, and a quarter of the
    float model's distance (what the quantization itself costs: a path that ran float would be 1x)."""
    if backend_name == "npu":
        request.getfixturevalue("npu_emulator")
    ids = list(range(3, 40))
    ref = w8a8_reference_model(w8a8_model)
    with torch.no_grad():
        ref64 = torch.log_softmax(ref(torch.tensor([ids])).logits[0, :-1], -1)
        ref32 = torch.log_softmax(ref.float()(torch.tensor([ids])).logits[0, :-1].double(), -1)
    ours = LLM(str(w8a8_model), kernel_backend=backend_name, num_blocks=64).prompt_logprobs_full(ids).double()
    plain = LLM(str(float_model), kernel_backend=backend_name, num_blocks=64).prompt_logprobs_full(ids).double()
    ours_kl, fp32_kl, float_kl = (kl(ref64, other).mean().item() for other in (ours, ref32, plain))
    assert ours_kl <= 1.5 * fp32_kl + 1e-5, (ours_kl, fp32_kl)
    assert ours_kl <= 0.25 * float_kl, (ours_kl, float_kl)


def test_the_engine_holds_the_files_int8_codes_and_a_quarter_of_the_bytes(w8a8_model, float_model):
    llm = LLM(str(w8a8_model), kernel_backend="ref", num_blocks=64)
    floats = LLM(str(float_model), kernel_backend="ref", num_blocks=64)
    tensors = load_file(w8a8_model / "model.safetensors")
    linears = dict(llm.engine.model.linears())
    qkv = linears["layers.1.self_attn.qkv"]
    file_codes = torch.cat([tensors[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert qkv.method.scheme == "W8A8_DYNAMIC" and torch.equal(qkv.prepared, file_codes)
    linear_bytes = [sum(size for name, size in lm.dense_bytes.items() if "self_attn" in name or "mlp" in name)
                    for lm in (llm.engine.model, floats.engine.model)]
    assert linear_bytes[0] <= 0.26 * linear_bytes[1]


def test_compressed_tensors_reads_the_layout_back(w8a8_model):
    """The package's own config model and decompressor take our files: the config parses to
    its W8A8 preset and every projection decompresses to codes * scale."""
    from compressed_tensors.compressors import IntQuantizationCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        preset_name_to_scheme,
    )
    config = QuantizationConfig.model_validate(json.loads((w8a8_model / "config.json").read_text())
                                               ["quantization_config"])
    scheme = config.config_groups["group_0"]
    preset = preset_name_to_scheme("W8A8", ["Linear"])
    def math(args):   # the observer is how a calibration found the scales, not how they are used
        return args.model_dump(exclude={"observer", "observer_kwargs"})

    assert [math(scheme.weights), math(scheme.input_activations)] == [math(preset.weights),
                                                                     math(preset.input_activations)]
    tensors = load_file(w8a8_model / "model.safetensors")
    prefix = "model.layers.0.mlp.down_proj."
    out = IntQuantizationCompressor.decompress({"weight": tensors[prefix + "weight"],
                                                "weight_scale": tensors[prefix + "weight_scale"]}, scheme)
    assert torch.equal(out["weight"], tensors[prefix + "weight"].float() * tensors[prefix + "weight_scale"])


@pytest.mark.parametrize("change, message", [
    (lambda g: g["weights"].update(strategy="tensor"),
     r"config_groups\.group_0\.weights\.strategy must be 'channel' .*got 'tensor'"),
    (lambda g: g["input_activations"].update(dynamic=False),
     r"config_groups\.group_0\.input_activations\.dynamic must be True .*got False"),
    (lambda g: g.update(format="float-quantized"),
     r"config_groups\.group_0: format 'float-quantized' is not supported; supported: \['int-quantized', "
     r"'pack-quantized'\]"),
])
def test_an_unsupported_scheme_is_refused_naming_the_field(float_model, tmp_path, change, message):
    config = json.loads(json.dumps(W8A8_CONFIG))
    change(config["config_groups"]["group_0"])
    model = write_compressed_tensors_w8a8(float_model, tmp_path / "q", config=config)
    with pytest.raises(ValueError, match=message):
        LLM(str(model), kernel_backend="ref", num_blocks=64)


def test_a_scale_of_the_wrong_shape_or_a_missing_one_is_named(w8a8_model, tmp_path):
    import shutil
    bad = shutil.copytree(w8a8_model, tmp_path / "bad")
    tensors = load_file(bad / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight_scale"
    tensors[name] = tensors[name].flatten()
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(ValueError, match=rf"tensor '{name}' has shape \(384,\), expected \(384, 1\)"):
        LLM(str(bad), kernel_backend="ref", num_blocks=64)
    del tensors[name]
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(ValueError, match=rf"checkpoint is missing 1 tensor\(s\): {name}"):
        LLM(str(bad), kernel_backend="ref", num_blocks=64)


def test_ignored_projections_stay_float(float_model, tmp_path):
    config = json.loads(json.dumps(W8A8_CONFIG))
    config["ignore"] = ["lm_head", "re:.*mlp\\.down_proj$"]
    model = write_compressed_tensors_w8a8(float_model, tmp_path / "q", config=config)
    tensors = load_file(model / "model.safetensors")
    for name in [n for n in tensors if n.endswith("down_proj.weight")]:   # written float, as the config says
        tensors[name] = load_file(float_model / "model.safetensors")[name]
        del tensors[name[:-len("weight")] + "weight_scale"]
    save_file(tensors, model / "model.safetensors")
    linears = dict(LLM(str(model), kernel_backend="ref", num_blocks=64).engine.model.linears())
    assert {name: linear.method.scheme for name, linear in linears.items() if name.startswith("layers.0.")} == {
        "layers.0.self_attn.qkv": "W8A8_DYNAMIC", "layers.0.self_attn.o": "W8A8_DYNAMIC",
        "layers.0.mlp.gate_up": "W8A8_DYNAMIC", "layers.0.mlp.down": "FLOAT"}


def test_fake_quant_reference_is_the_per_token_scheme():
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]], dtype=torch.float64)
    s = 2.0 / SYMMETRIC_DIVISOR            # row 0: max|x| = 2
    want = torch.tensor([[64.0, -128.0, 32.0], [0.0, 0.0, 0.0]], dtype=torch.float64)   # 1/s = 63.75 -> 64
    assert torch.equal(fake_quant_per_token(x, SYMMETRIC_DIVISOR), want * torch.tensor([[s], [1.0]], dtype=torch.float64))


def test_tensor_parallel_2_computes_the_scheme_with_each_ranks_scales(tmp_path):
    """At tensor_parallel_size 2 a row-parallel layer quantizes each token's columns on its
    own rank (as vLLM does): the float64 reference that does the same is as close as its
    own float32 run, and the TP 1 reference is not (the scales did move). One layer, so
    that a code rounding the other way does not drown that difference."""
    one_layer = make_tiny_model("llama", tmp_path / "f", seed=5, **{**SMALL, "num_layers": 1})
    w8a8_model = write_compressed_tensors_w8a8(one_layer, tmp_path / "q")
    ids = list(range(3, 40))
    with torch.no_grad():
        ref = w8a8_reference_model(w8a8_model, tensor_parallel_size=2)
        ref64 = torch.log_softmax(ref(torch.tensor([ids])).logits[0, :-1], -1)
        ref32 = torch.log_softmax(ref.float()(torch.tensor([ids])).logits[0, :-1].double(), -1)
        tp1 = torch.log_softmax(w8a8_reference_model(w8a8_model)(torch.tensor([ids])).logits[0, :-1], -1)
    with LLM(str(w8a8_model), tensor_parallel_size=2, num_blocks=64) as llm:
        ours = llm.prompt_logprobs_full(ids).double()
    ours_kl, fp32_kl, tp1_kl = (kl(ref64, other).mean().item() for other in (ours, ref32, tp1))
    assert ours_kl <= 1.5 * fp32_kl + 1e-5, (ours_kl, fp32_kl)
    assert tp1_kl > 2 * ours_kl, (tp1_kl, ours_kl)


def test_float_weights_under_an_int8_config_are_refused_not_cast(float_model, tmp_path):
    """A config that says int-quantized over float weights: a cast would truncate them to
    garbage codes."""
    model = write_compressed_tensors_w8a8(float_model, tmp_path / "q")
    tensors = load_file(model / "model.safetensors")
    name = "model.layers.0.mlp.gate_proj.weight"
    tensors[name] = load_file(float_model / "model.safetensors")[name]
    save_file(tensors, model / "model.safetensors")
    with pytest.raises(ValueError, match=rf"tensor '{name}' is float32, expected an integer tensor \(int8\)"):
        LLM(str(model), kernel_backend="ref", num_blocks=64)
