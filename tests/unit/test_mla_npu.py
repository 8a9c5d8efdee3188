"""MLA on the npu kernel backend through the torch_npu emulator. With DeepSeek's latent sizes
(kv_lora_rank 512, rope 64) the backend asks for the split latent cache (c_kv and k_pe
planes, common/runner/split_latent_cache.py): the latent's norm, rope and cache write through
one npu_kv_rmsnorm_rope_cache (into the two planes, or into one plane through two strided
views) against the backend default; the absorbed decode through FIA's MLA mode against the
one-plane paged decode, torch's split decode for a head count FIA refuses; other sizes on a
one-plane cache and torch's paths, said once; and the tiny DeepSeek-V2 / V3 through the
engine against transformers."""
from __future__ import annotations

import pytest
import torch

from common.engine import LLM, SamplingParams
from common.runner.split_latent_cache import SplitLatentCache
from kernels import get_backend
from kernels.api import DecodeMetadata
from kernels.ref import RefBackend
from kernels.rope import rope_cos_sin, rope_inv_freq
from tests.conftest import assert_no_blocks_in_use
from tests.mla_checkpoints import saved_deepseek  # noqa: F401  (a fixture)
from tests.moe_checkpoints import IDS, greedy_reference

SIZES = dict(kv_lora_rank=512, qk_rope_head_dim=64)      # DeepSeek-V2/V3's, the only ones the ops take
HEADS, BS, NB = 4, 128, 3
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
FALLBACK_DECODE = "MLA's absorbed decode runs torch's"


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
                planes=(torch.zeros(NB, BS, 1, rank + rope),),
                slot_mapping=torch.randperm(NB * BS, generator=g)[:n])


def _split(case: dict) -> dict:
    """The case with its one plane cut into a split cache's two (c_kv, k_pe), each contiguous."""
    rank = case["norm_weight"].shape[0]
    plane = case["planes"][0]
    return {**case, "planes": (plane[..., :rank].contiguous(), plane[..., rank:].contiguous())}


def _both(backend, case) -> tuple[tuple, tuple, torch.Tensor, torch.Tensor]:
    """(npu's result, the default's, npu's cache, the default's), each cache as one plane."""
    theirs = tuple(p.clone() for p in case["planes"])
    got = backend.mla_latent(**case)
    want = RefBackend().mla_latent(**{**case, "planes": theirs})
    return got, want, torch.cat(case["planes"], dim=-1), torch.cat(theirs, dim=-1)


@pytest.mark.parametrize("split", [True, False], ids=["two planes", "one plane, two views"])
def test_the_latent_through_the_fused_op_equals_the_default(backend, npu_op_calls, split):
    case = _latent_case(512, 64)
    got, want, cache, ref_cache = _both(backend, _split(case) if split else case)
    assert npu_op_calls["npu_kv_rmsnorm_rope_cache"] == 1 and npu_op_calls["npu_rotary_mul"] == 1
    for g, w in zip(got, want):                                # q_pe, c_kv, k_pe
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
    torch.testing.assert_close(cache, ref_cache, rtol=0, atol=1e-5)
    assert int((cache.abs().sum(-1) > 0).sum()) == 9            # the 9 slots' rows, nothing else


def test_other_latent_sizes_and_a_torch_npu_without_the_op_run_torch_s_path_said_once(
        backend, npu_op_calls, monkeypatch, caplog):
    assert backend.latent_planes(512, 64) == 2 and backend.latent_planes(32, 8) == 1
    with caplog.at_level("WARNING", logger="pdmesh.kernels"):
        for seed in (1, 2):
            got, want, cache, ref_cache = _both(backend, _latent_case(32, 8, seed=seed))
            assert all(torch.equal(g, w) for g, w in zip(got, want)) and torch.equal(cache, ref_cache)
        monkeypatch.setattr(backend, "_mla_missing", ["npu_kv_rmsnorm_rope_cache"])
        got, want, cache, ref_cache = _both(backend, _split(_latent_case(512, 64)))
    assert torch.equal(cache, ref_cache)
    assert npu_op_calls["npu_kv_rmsnorm_rope_cache"] == 0
    assert caplog.text.count("takes kv_lora_rank 512 and qk_rope_head_dim 64 only, this model has 32 and 8") == 1
    assert caplog.text.count("lacks ['npu_kv_rmsnorm_rope_cache']; MLA's latent norm, rope and cache write "
                             "run torch's ops") == 1


def test_a_slot_of_minus_one_is_skipped_through_torch_s_path(backend, npu_op_calls):
    case = _split(_latent_case(512, 64))
    case["slot_mapping"][3] = -1
    got, want, cache, ref_cache = _both(backend, case)
    assert npu_op_calls["npu_kv_rmsnorm_rope_cache"] == 0
    assert torch.equal(cache, ref_cache) and int((cache.abs().sum(-1) > 0).sum()) == 8


def _decode_case(heads: int):
    g = torch.Generator().manual_seed(3)
    plane = torch.randn(NB, BS, 1, 576, generator=g) * 0.3
    seq_lens = [200, 1, 128]
    meta = DecodeMetadata(seq_lens=torch.tensor(seq_lens, dtype=torch.int32), seq_lens_list=seq_lens,
                          block_tables=torch.tensor([[2, 0], [1, 0], [0, 0]], dtype=torch.int32))
    return torch.randn(3, heads, 576, generator=g) * 0.3, plane, meta


@pytest.mark.parametrize("heads,fia_calls", [(8, 2), (6, 0)])
def test_the_absorbed_decode_over_two_planes_equals_the_one_plane_paged_decode(backend, npu_op_calls, caplog,
                                                                              heads, fia_calls):
    """8 query heads: FIA's MLA mode; 6 (not a power of 2): torch's split decode, said once."""
    query, plane, meta = _decode_case(heads)
    planes = (plane[..., :512].contiguous(), plane[..., 512:].contiguous())
    with caplog.at_level("WARNING", logger="pdmesh.kernels"):
        outs = [backend.mla_decode(query, planes, meta, 0.04, 512) for _ in range(2)]
    want = RefBackend().mla_decode(query, (plane,), meta, 0.04, 512)
    assert outs[0].shape == (3, heads, 512) and torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0], want, rtol=0, atol=1e-5)
    assert npu_op_calls["npu_fused_infer_attention_score"] == fia_calls
    assert caplog.text.count("FIA's MLA mode takes [1, 2, 4, 8, 16, 32, 64, 128] query heads, this rank has 6") == \
        (0 if fia_calls else 1)


def test_the_absorbed_decode_over_one_plane_runs_torch_s_paged_decode_said_once(backend, npu_op_calls, caplog):
    query, plane, meta = _decode_case(8)
    with caplog.at_level("WARNING", logger="pdmesh.kernels"):
        outs = [backend.mla_decode(query, (plane,), meta, 0.04, 512) for _ in range(2)]
    assert torch.equal(outs[0], RefBackend().mla_decode(query, (plane,), meta, 0.04, 512))
    assert npu_op_calls["npu_fused_infer_attention_score"] == 0
    assert caplog.text.count(FALLBACK_DECODE) == 1


@pytest.mark.parametrize("family,sizes", [("deepseek_v2", SIZES), ("deepseek_v3", SIZES), ("deepseek_v3", {})])
def test_deepseek_through_the_npu_emulator_equals_transformers(saved_deepseek, backend, npu_op_calls, caplog,
                                                               family, sizes):
    """DeepSeek's sizes: a split latent cache; every layer's latent through
    npu_kv_rmsnorm_rope_cache each step, every decode step's attention through FIA's MLA
    mode (MLA's prefill is torch's). The tiny test sizes (kv_lora_rank 32, rope 8): a
    one-plane cache and torch's paths, said once."""
    folder, theirs = saved_deepseek(family, **sizes)
    ref, want = greedy_reference(theirs)
    with caplog.at_level("WARNING", logger="pdmesh.kernels"), \
            LLM(str(folder), kernel_backend="npu", block_size=BS, num_blocks=16) as llm:
        assert llm.engine.backend is backend
        cache = llm.engine.kv_cache
        if sizes:
            assert isinstance(cache, SplitLatentCache) and llm.engine.layout.endswith(":latent_split:R64")
            assert tuple(cache[0][0].shape) == (16, BS, 1, 512) and tuple(cache[0][1].shape) == (16, BS, 1, 64)
        else:
            assert tuple(cache.shape) == (3, 1, 16, BS, 1, 40)
        torch.testing.assert_close(llm.prompt_logprobs_full(IDS).double(), ref, atol=1e-4, rtol=0)
        out = llm.generate([{"prompt_token_ids": IDS}], GREEDY)[0].outputs[0]
        assert list(out.token_ids) == want
        assert_no_blocks_in_use(llm.engine)
    steps = 1 + len(want)               # the log-probs' prefill, then the generation's prefill and 9 decodes
    assert npu_op_calls["npu_kv_rmsnorm_rope_cache"] == (3 * steps if sizes else 0)
    assert npu_op_calls["npu_fused_infer_attention_score"] == (3 * (len(want) - 1) if sizes else 0)
    assert caplog.text.count(FALLBACK_DECODE) == (0 if sizes else 1)
    assert caplog.text.count("this model has 32 and 8") == (0 if sizes else 1)


def test_a_split_latent_cache_under_prefix_hits_and_chunks(saved_deepseek, backend, npu_op_calls):
    """The prefill's cached prefix read back from the two planes (layers/mla.py's expanded
    path): the same greedy tokens cold, with a warm prefix cache, and in chunks of one block."""
    folder, _ = saved_deepseek("deepseek_v3", **SIZES)
    prompt = [(7 * i) % 1000 + 3 for i in range(300)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with LLM(str(folder), kernel_backend="npu", block_size=BS, num_blocks=16, enable_prefix_caching=False) as llm:
        cold = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
    with LLM(str(folder), kernel_backend="npu", block_size=BS, num_blocks=16, max_num_batched_tokens=BS) as llm:
        assert isinstance(llm.engine.kv_cache, SplitLatentCache)
        first, second = (llm.generate([{"prompt_token_ids": prompt}], params)[0] for _ in range(2))
        assert first.outputs[0].token_ids == cold and second.outputs[0].token_ids == cold
        assert second.num_cached_tokens == 2 * BS
        assert_no_blocks_in_use(llm.engine)
    assert npu_op_calls["npu_fused_infer_attention_score"] == 3 * 3 * 5       # 3 runs x 3 layers x 5 decodes


def test_deepseek_v3_at_tensor_parallel_2_with_expert_parallelism_through_the_emulator(
        saved_deepseek, backend, npu_op_calls):
    """Both ranks on the emulator (the worker installs it as rank 0 has): 4 query heads a rank
    through FIA's MLA mode over each rank's split latent cache, 4 experts a rank through the
    npu MoE ops, equal to transformers."""
    folder, theirs = saved_deepseek("deepseek_v3", "per-expert", **SIZES)
    ref, want = greedy_reference(theirs)
    with LLM(str(folder), kernel_backend="npu", block_size=BS, num_blocks=16, tensor_parallel_size=2,
             enable_expert_parallel=True) as llm:
        assert isinstance(llm.engine.kv_cache, SplitLatentCache)
        assert llm.engine.model.layers[0].self_attn.num_heads == 4 and llm.engine.model.layers[1].mlp.num_local == 4
        torch.testing.assert_close(llm.prompt_logprobs_full(IDS).double(), ref, atol=1e-4, rtol=0)
        assert list(llm.generate([{"prompt_token_ids": IDS}], GREEDY)[0].outputs[0].token_ids) == want
        assert_no_blocks_in_use(llm.engine)
    assert npu_op_calls["npu_fused_infer_attention_score"] == 3 * (len(want) - 1)      # rank 0's
    assert npu_op_calls["npu_grouped_matmul"] > 0


def test_a_fia_without_its_mla_mode_gets_a_one_plane_cache_and_torch_s_decode(backend, monkeypatch, caplog):
    monkeypatch.setattr(backend, "_fia_mla", False)
    assert backend.latent_planes(512, 64) == 1
    query, plane, meta = _decode_case(8)
    with caplog.at_level("WARNING", logger="pdmesh.kernels"):
        got = backend.mla_decode(query, (plane,), meta, 0.04, 512)
    assert torch.equal(got, RefBackend().mla_decode(query, (plane,), meta, 0.04, 512))
    assert caplog.text.count("npu_fused_infer_attention_score has no MLA mode (query_rope / key_rope)") == 1


def test_a_remote_prefill_pushes_both_planes_of_a_split_latent(saved_deepseek, backend, npu_op_calls):
    """A prefill engine and a decode engine on the npu backend (split latent caches) over the
    real PrefillServicer and RemotePrefill, the fake transfer between them: the decode's c_kv
    and k_pe planes of the prompt's blocks equal the prefill's, the rows past the prompt in
    its last block untouched, and the tokens equal the offline engine's."""
    import asyncio
    from tests.prefill_pair import PrefillPair
    folder, _ = saved_deepseek("deepseek_v3", **SIZES)
    prompt = [(11 * i) % 1000 + 3 for i in range(200)]          # 1 whole block + 72 rows of a second
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    with LLM(str(folder), kernel_backend="npu", block_size=BS, num_blocks=8) as llm:
        offline = list(llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids)

    async def scenario():
        pair = await PrefillPair(folder, decode_blocks=8, prefill_blocks=8, kernel_backend="npu", block_size=BS).start()
        try:
            assert isinstance(pair.decode_engine.kv_cache, SplitLatentCache)
            pushed: list = []
            send = pair.prefill_node.sender.send_blocks

            def recording(peer, layout, src, dst, *args, **kwargs):
                pushed.append((list(src), list(dst), kwargs.get("last_block_tokens")))
                return send(peer, layout, src, dst, *args, **kwargs)
            pair.prefill_node.sender.send_blocks = recording
            for cache in (pair.decode_engine.kv_cache, pair.prefill_engine.kv_cache):
                cache.buffer.fill_(7.0)          # what no write leaves behind
            remote = pair.remote("a", prompt, params)
            tokens = [t async for out in pair.decode.generate("a", prompt, params, remote=remote)
                      for t in out.new_token_ids]
            return tokens, pushed, pair
        finally:
            await pair.close()

    tokens, pushed, pair = asyncio.run(scenario())
    assert tokens == offline
    assert pushed and all(last == 200 - BS for _, _, last in pushed if last is not None)
    src, dst = pushed[0][0], pushed[0][1]
    mine, theirs = pair.prefill_engine.kv_cache, pair.decode_engine.kv_cache
    for plane in ("nope", "rope"):
        a, b = getattr(mine, plane), getattr(theirs, plane)
        assert torch.equal(b[:, dst[0]], a[:, src[0]])                        # the whole first block
        assert torch.equal(b[:, dst[1], :200 - BS], a[:, src[1], :200 - BS])   # the prompt's rows of the last
        # past them the decode's own 4 tokens' rows (72..75), then nothing written
        assert bool((b[:, dst[1], 200 - BS + 4:] == 7.0).all()) and not bool((b[:, dst[1], :200 - BS + 4] == 7.0).any())
