"""C8: an int8 KV cache with per-channel scales from the checkpoint (msModelSlim's layout,
tests/c8_checkpoints.py). The kernels attend over the codes with the scales folded
around (kernels/kv_int8.py): checked against float64 attention over the dequantized
values; the model against transformers in float64 with the same store/read rules; the
cache, the layout key and the block hashes say int8 and which scales; bad scales are
refused at load naming the tensor."""
from __future__ import annotations

import dataclasses
import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.engine import LLM, SamplingParams
from common.kv_layout import KVLayout
from common.model.tiny import make_tiny_model
from kernels import DecodeMetadata, PrefillMetadata, get_backend
from kernels.kv_int8 import KVCacheScales, dequantize_kv, quantize_kv
from tests.c8_checkpoints import c8_reference, patched, write_c8
from tests.quant_checkpoints import ENGINE_CASE_IDS, ENGINE_CASES, kl

SMALL = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=512)
IDS = list(range(3, 60))


def prompts(vocab: int, n: int = 4, length: int = 48, seed: int = 11) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


@pytest.fixture(scope="module")
def float_model(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("c8") / "float", seed=5, **SMALL)


@pytest.fixture(scope="module")
def c8_model(float_model):
    return write_c8(float_model, float_model.parent / "c8", prompts(SMALL["vocab_size"]))


# ---- kernels ------------------------------------------------------------------------------
def scales(kv_heads: int, head_dim: int, seed: int) -> KVCacheScales:
    g = torch.Generator().manual_seed(seed)
    rand = lambda: torch.rand(kv_heads, head_dim, generator=g)   # noqa: E731
    return KVCacheScales(rand() * 0.02 + 0.01, torch.randint(-4, 5, (kv_heads, head_dim), generator=g).float(),
                         rand() * 0.02 + 0.01, torch.randint(-4, 5, (kv_heads, head_dim), generator=g).float())


def attention64(q, k, v, scale, causal_from: int) -> torch.Tensor:
    """q [n, heads, d], k/v [ctx, kv_heads, d] float64; query i sees context [0, causal_from + i]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("nhd,thd->hnt", q, k) * scale
    visible = torch.arange(k.shape[0])[None, :] <= (causal_from + torch.arange(q.shape[0]))[:, None]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hnt,thd->nhd", scores.softmax(-1), v)


@pytest.mark.parametrize("backend", ["ref", "cpu", "npu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_over_int8_codes_equals_float64_over_the_values(backend, dtype, request):
    calls = request.getfixturevalue("npu_op_calls") if backend == "npu" else None
    be = get_backend(backend, "cpu")
    bs = 128 if backend == "npu" else 16
    num_blocks, kv_heads, heads, d, ctx, new = 12, 2, 6, 32, 70 if backend != "npu" else 300, 9
    s = scales(kv_heads, d, seed=1)
    g = torch.Generator().manual_seed(2)
    k = torch.randn(ctx, kv_heads, d, generator=g) * 0.6
    v = torch.randn(ctx, kv_heads, d, generator=g) * 0.6
    k8, v8 = quantize_kv(k, s.k_scale, s.k_offset), quantize_kv(v, s.v_scale, s.v_offset)
    k_cache = torch.zeros(num_blocks, bs, kv_heads, d, dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    table = torch.tensor([[7, 2, 9, 0, 11]], dtype=torch.int32)
    slots = torch.tensor([int(table[0, p // bs]) * bs + p % bs for p in range(ctx)])
    be.write_kv(k8, v8, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, kv_heads, d)[slots], k8)
    kd, vd = dequantize_kv(k8, s.k_scale, s.k_offset).double(), dequantize_kv(v8, s.v_scale, s.v_offset).double()
    q = (torch.randn(new, heads, d, generator=g)).to(dtype)
    scale = d ** -0.5
    tol = dict(atol=2e-3, rtol=0) if dtype == torch.float32 else dict(atol=4e-2, rtol=0)
    # decode: the last query token over the whole context
    meta = DecodeMetadata(torch.tensor([ctx], dtype=torch.int32), table, [ctx])
    out = be.decode(q[-1:], k_cache, v_cache, meta, scale, s)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), attention64(q[-1:].double(), kd, vd, scale, ctx - 1), **tol)
    # prefill: the last `new` tokens of the context, the rest a cached prefix
    pmeta = PrefillMetadata(torch.tensor([0, new], dtype=torch.int32), torch.tensor([ctx], dtype=torch.int32),
                            table, [new], [ctx])
    out = be.prefill(q, k8[-new:], v8[-new:], k_cache, v_cache, pmeta, scale, s)
    torch.testing.assert_close(out.double(), attention64(q.double(), kd, vd, scale, ctx - new), **tol)
    # prefill without a prefix: over the new tokens' own codes
    pmeta = PrefillMetadata(torch.tensor([0, ctx], dtype=torch.int32), torch.tensor([ctx], dtype=torch.int32),
                            table, [ctx], [ctx])
    qq = torch.randn(ctx, heads, d, generator=g).to(dtype)
    out = be.prefill(qq, k8, v8, k_cache, v_cache, pmeta, scale, s)
    torch.testing.assert_close(out.double(), attention64(qq.double(), kd, vd, scale, 0), **tol)
    if calls is not None:   # decode on FIA's int8 pages; both prefills on FIA over dequantized blocks
        assert calls["npu_fused_infer_attention_score"] == 3


def test_the_npu_emulator_refuses_int8_pages_where_fia_does(npu_emulator):
    import torch_npu as npu

    from kernels.testing.fake_torch_npu import ContractError
    q = torch.randn(2, 1, 128)
    k = torch.zeros(4, 128, 64, dtype=torch.int8)
    ok = dict(block_table=torch.zeros(2, 1, dtype=torch.int32), input_layout="BSH", block_size=128,
              actual_seq_lengths_kv=[5, 9], num_heads=4, num_key_value_heads=2,
              key_antiquant_scale=torch.ones(1, 64), value_antiquant_scale=torch.ones(1, 64))
    out, _ = npu.npu_fused_infer_attention_score(q, k, k, **ok)
    assert out.shape == (2, 1, 128)
    for change, rule in [
        (dict(value_antiquant_scale=None), "need key_antiquant_scale and value_antiquant_scale"),
        (dict(input_layout="TND"), "TND does not support antiquant"),
        (dict(key_antiquant_scale=torch.ones(1, 64, dtype=torch.float16)), "dtype must equal query's"),
        (dict(key_antiquant_scale=torch.ones(64)), "must be shaped one of"),
        (dict(key_antiquant_mode=1), "per-channel antiquant"),
        (dict(block_size=100), "multiple of 32"),
    ]:
        with pytest.raises(ContractError, match=rule):
            npu.npu_fused_infer_attention_score(q, k, k, **{**ok, **change})
    with pytest.raises(ContractError, match="query length of 1"):
        npu.npu_fused_infer_attention_score(torch.randn(2, 3, 128), k, k, **ok)


# ---- the model ----------------------------------------------------------------------------
def logprobs(model_dir, **kwargs) -> torch.Tensor:
    with LLM(str(model_dir), num_blocks=64, **kwargs) as llm:
        return llm.prompt_logprobs_full(IDS).double()


@pytest.mark.parametrize("kwargs", ENGINE_CASES, ids=ENGINE_CASE_IDS)
def test_c8_model_is_as_close_to_its_float64_math_as_float32_gets(c8_model, float_model, kwargs, request):
    if kwargs["kernel_backend"] == "npu":
        request.getfixturevalue("npu_emulator")
    ref = c8_reference(c8_model)
    with torch.no_grad(), patched(ref):
        ref64 = torch.log_softmax(ref(torch.tensor([IDS])).logits[0, :-1], -1)
        ref32 = torch.log_softmax(ref.float()(torch.tensor([IDS])).logits[0, :-1].double(), -1)
    ours = logprobs(c8_model, **kwargs)
    ours_kl, fp32_kl = kl(ref64, ours).mean().item(), kl(ref64, ref32).mean().item()
    assert ours_kl <= 1.5 * fp32_kl + 2e-5, (ours_kl, fp32_kl)
    # and the scales do something: the float model is measurably further away
    assert kl(ref64, logprobs(float_model, kernel_backend="ref")).mean().item() > 10 * max(ours_kl, 1e-7)


def test_c8_cache_is_int8_and_its_layout_names_the_scales(c8_model, float_model, tmp_path, npu_op_calls):
    with LLM(str(c8_model), kernel_backend="cpu", kv_cache_memory=1 << 20) as c8, \
            LLM(str(float_model), kernel_backend="cpu", kv_cache_memory=1 << 20) as fp:
        assert c8.engine.kv_cache.dtype == torch.int8 and fp.engine.kv_cache.dtype == torch.float32
        assert c8.engine.num_blocks == 4 * fp.engine.num_blocks      # a quarter of float32's bytes a block
        layout = KVLayout.of_tensor(c8.engine.kv_cache, c8.engine.kv_scales_id)
        assert c8.engine.kv_scales_id.startswith("c8:") and fp.engine.kv_scales_id == ""
        assert c8.engine.layout.startswith("int8:") and c8.engine.layout.endswith(c8.engine.kv_scales_id)
        assert KVLayout.from_proto(layout.to_proto()) == layout
        for bogus in ("c8:1234", "x:O4", "c8:" + "g" * 16):     # a peer's field, echoed in errors and keys
            with pytest.raises(ValueError, match="scales_id must be empty or 'c8:' and 16 hex digits"):
                dataclasses.replace(layout, scales_id=bogus)
        # greedy tokens through decode steps over the int8 cache: the same on ref, cpu and npu
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        got = c8.generate({"prompt_token_ids": IDS}, params)[0].outputs[0].token_ids
    for kwargs in (dict(kernel_backend="ref"), dict(kernel_backend="npu", block_size=128)):
        with LLM(str(c8_model), num_blocks=8, **kwargs) as other:
            assert other.generate({"prompt_token_ids": IDS}, params)[0].outputs[0].token_ids == got, kwargs
    assert npu_op_calls["npu_fused_infer_attention_score"] == 11 * SMALL["num_layers"] + SMALL["num_layers"]
    # other scales: another identity, so neither blocks nor hashes are shared
    other = edited(c8_model, tmp_path, lambda t: t.__setitem__(
        "model.layers.1.self_attn.v_proj.kv_cache_scale", t["model.layers.1.self_attn.v_proj.kv_cache_scale"] * 1.01))
    with LLM(str(other), kernel_backend="cpu", num_blocks=64) as llm:
        assert llm.engine.kv_scales_id not in ("", c8.engine.kv_scales_id)
        with pytest.raises(ValueError, match="scales_id"):
            layout.check_compatible(KVLayout.of_tensor(llm.engine.kv_cache, llm.engine.kv_scales_id))


def edited(c8_dir, tmp_path, change_tensors=None, change_description=None):
    out = tmp_path / "edited"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(c8_dir, out)
    tensors = load_file(out / "quant_model_weights.safetensors")
    description = json.loads((out / "quant_model_description.json").read_text())
    if change_tensors:
        change_tensors(tensors)
    if change_description:
        change_description(description)
    save_file(tensors, out / "quant_model_weights.safetensors")
    (out / "quant_model_description.json").write_text(json.dumps(description))
    return out


K_SCALE = "model.layers.0.self_attn.k_proj.kv_cache_scale"
V_OFFSET = "model.layers.1.self_attn.v_proj.kv_cache_offset"


def _set(name, index, value):
    def change(t):
        t[name] = t[name].clone()
        t[name][index] = value
    return change


@pytest.mark.parametrize("tensors, description, match", [
    (_set(K_SCALE, 5, 0.0), None, rf"{K_SCALE}: channel 5 .* must be finite and > 0"),
    (_set(K_SCALE, 3, float("nan")), None, rf"{K_SCALE}: channel 3 .* finite and > 0"),
    (_set(V_OFFSET, 7, 0.5), None, rf"{V_OFFSET}: channel 7 .* whole number in \[-128, 127\]"),
    (_set(V_OFFSET, 0, 200.0), None, rf"{V_OFFSET}: channel 0 .* whole number"),
    (lambda t: t.__setitem__(K_SCALE, t[K_SCALE][:10]), None, rf"tensor '{K_SCALE}' has shape \(10,\), expected \(64,\)"),
    (lambda t: t.pop(V_OFFSET), None, rf"missing 1 tensor\(s\): {V_OFFSET}"),
    (None, lambda d: d.__setitem__("kv_cache_type", "C4"), r"kv_cache_type 'C4' is not supported; supported: 'C8'"),
], ids=["zero-scale", "nan-scale", "fractional-offset", "offset-out-of-range", "wrong-shape", "missing",
        "unknown-kv-type"])
def test_bad_c8_checkpoints_are_refused_at_load_naming_the_tensor(c8_model, tmp_path, tensors, description, match):
    bad = edited(c8_model, tmp_path, tensors, description)
    with pytest.raises(ValueError, match=match):
        LLM(str(bad), kernel_backend="cpu", num_blocks=16)
