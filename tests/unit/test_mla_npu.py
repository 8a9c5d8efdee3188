"""MLA on the npu kernel backend through the torch_npu emulator: the latent's norm, rope and
cache write through one npu_kv_rmsnorm_rope_cache (into the one latent plane through two
strided views) against the backend default; the absorbed decode on torch's paged decode (FIA's
MLA mode needs two contiguous planes: kernels/npu_mla.py); the torch paths said once; and the
tiny DeepSeek-V2 / V3 with DeepSeek's latent sizes (kv_lora_rank 512, rope 64) through the
engine against transformers."""
from __future__ import annotations

import pytest
import torch

from common.engine import LLM, SamplingParams
from kernels import get_backend
from kernels.api import DecodeMetadata
from kernels.ref import RefBackend
from kernels.rope import rope_cos_sin, rope_inv_freq
from tests.conftest import assert_no_blocks_in_use
from tests.mla_checkpoints import saved_deepseek  # noqa: F401  (a fixture)
from tests.moe_checkpoints import IDS, greedy_reference

SIZES = dict(kv_lora_rank=512, qk_rope_head_dim=64)      # DeepSeek-V2/V3's, the only ones the op takes
HEADS, BS, NB = 4, 128, 3
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
FALLBACK_DECODE = "MLA's absorbed decode runs torch's paged decode"


@pytest.fixture()
def backend(npu_emulator, monkeypatch):
    """The cached npu backend with its one-time notes unsaid."""
    b = get_backend("npu", "cpu")
    monkeypatch.setattr(b, "_told", set())
    return b


def _latent_case(rank: int, rope: int, n: int = 9, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(n, 48 + rank + rope, generator=g)       # kv_a a view, as V3's (after q_a's columns)
    cos, sin = rope_cos_sin(rope_inv_freq(rope, 10000.0), 256)
    return dict(positions=torch.randint(0, 256, (n,), generator=g),
                q_pe=torch.randn(n, HEADS, rope, generator=g), kv_a=wide[:, 48:],
                norm_weight=torch.rand(rank, generator=g) + 0.5, eps=1e-6, cos=cos, sin=sin,
                cache=torch.zeros(NB, BS, 1, rank + rope),
                slot_mapping=torch.randperm(NB * BS, generator=g)[:n])


def _both(backend, case) -> tuple[tuple, tuple, torch.Tensor, torch.Tensor]:
    """(npu's result, the default's, npu's cache, the default's)."""
    mine, theirs = case["cache"], case["cache"].clone()
    got = backend.mla_latent(**case)
    want = RefBackend().mla_latent(**{**case, "cache": theirs})
    return got, want, mine, theirs


def test_the_latent_through_the_fused_op_equals_the_default(backend, npu_op_calls):
    got, want, cache, ref_cache = _both(backend, _latent_case(512, 64))
    assert npu_op_calls["npu_kv_rmsnorm_rope_cache"] == 1 and npu_op_calls["npu_rotary_mul"] == 1
    for g, w in zip(got, want):                                # q_pe, c_kv, k_pe
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
    torch.testing.assert_close(cache, ref_cache, rtol=0, atol=1e-5)
    assert int((cache.abs().sum(-1) > 0).sum()) == 9            # the 9 slots' rows, nothing else


def test_other_latent_sizes_and_a_torch_npu_without_the_op_run_torch_s_path_said_once(
        backend, npu_op_calls, monkeypatch, caplog):
    with caplog.at_level("WARNING", logger="pdmesh.kernels"):
        for seed in (1, 2):
            got, want, cache, ref_cache = _both(backend, _latent_case(32, 8, seed=seed))
            assert all(torch.equal(g, w) for g, w in zip(got, want)) and torch.equal(cache, ref_cache)
        monkeypatch.setattr(backend, "_mla_missing", ["npu_kv_rmsnorm_rope_cache"])
        got, want, cache, ref_cache = _both(backend, _latent_case(512, 64))
    assert torch.equal(cache, ref_cache)
    assert npu_op_calls["npu_kv_rmsnorm_rope_cache"] == 0
    assert caplog.text.count("takes kv_lora_rank 512 and qk_rope_head_dim 64 only, this model has 32 and 8") == 1
    assert caplog.text.count("lacks ['npu_kv_rmsnorm_rope_cache']; MLA's latent norm, rope and cache write "
                             "run torch's ops") == 1


def test_a_slot_of_minus_one_is_skipped_through_torch_s_path(backend, npu_op_calls):
    case = _latent_case(512, 64)
    case["slot_mapping"][3] = -1
    got, want, cache, ref_cache = _both(backend, case)
    assert npu_op_calls["npu_kv_rmsnorm_rope_cache"] == 0
    assert torch.equal(cache, ref_cache) and int((cache.abs().sum(-1) > 0).sum()) == 8


def test_the_absorbed_decode_runs_torch_s_paged_decode_said_once(backend, npu_op_calls, caplog):
    g = torch.Generator().manual_seed(3)
    plane = torch.randn(NB, BS, 1, 576, generator=g) * 0.3
    seq_lens = [200, 1, 128]
    meta = DecodeMetadata(seq_lens=torch.tensor(seq_lens, dtype=torch.int32), seq_lens_list=seq_lens,
                          block_tables=torch.tensor([[2, 0], [1, 0], [0, 0]], dtype=torch.int32))
    query = torch.randn(3, 8, 576, generator=g) * 0.3
    with caplog.at_level("WARNING", logger="pdmesh.kernels"):
        outs = [backend.mla_decode(query, plane, meta, 0.04, 512) for _ in range(2)]
    assert torch.equal(outs[0], RefBackend().mla_decode(query, plane, meta, 0.04, 512))
    assert npu_op_calls["npu_fused_infer_attention_score"] == 0
    assert caplog.text.count(FALLBACK_DECODE) == 1


@pytest.mark.parametrize("family,sizes", [("deepseek_v2", SIZES), ("deepseek_v3", SIZES), ("deepseek_v3", {})])
def test_deepseek_through_the_npu_emulator_equals_transformers(saved_deepseek, backend, npu_op_calls, caplog,
                                                               family, sizes):
    """DeepSeek's sizes: every layer's latent through npu_kv_rmsnorm_rope_cache, each step;
    the tiny test sizes (kv_lora_rank 32, rope 8): torch's path, said once. The decode on
    torch's paged decode either way: no FIA call at all (MLA's prefill is torch's too)."""
    folder, theirs = saved_deepseek(family, **sizes)
    ref, want = greedy_reference(theirs)
    width = sizes.get("kv_lora_rank", 32) + sizes.get("qk_rope_head_dim", 8)
    with caplog.at_level("WARNING", logger="pdmesh.kernels"), \
            LLM(str(folder), kernel_backend="npu", block_size=BS, num_blocks=16) as llm:
        assert llm.engine.backend is backend
        assert tuple(llm.engine.kv_cache.shape) == (3, 1, 16, BS, 1, width)
        torch.testing.assert_close(llm.prompt_logprobs_full(IDS).double(), ref, atol=1e-4, rtol=0)
        out = llm.generate([{"prompt_token_ids": IDS}], GREEDY)[0].outputs[0]
        assert list(out.token_ids) == want
        assert_no_blocks_in_use(llm.engine)
    steps = 1 + len(want)               # the log-probs' prefill, then the generation's prefill and 9 decodes
    assert npu_op_calls["npu_kv_rmsnorm_rope_cache"] == (3 * steps if sizes else 0)
    assert npu_op_calls["npu_fused_infer_attention_score"] == 0
    assert caplog.text.count(FALLBACK_DECODE) == 1
    assert caplog.text.count("this model has 32 and 8") == (0 if sizes else 1)
