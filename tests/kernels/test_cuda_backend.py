"""CudaBackend: block-size rules and API selection (pure logic, CPU), its flash-attn
plumbing against a contract-checking stand-in for flash_attn_varlen_func (CPU), and the
real thing on a GPU (skipped without CUDA)."""
from __future__ import annotations

import pytest
import torch

from kernels.api import DecodeMetadata, PrefillMetadata
from kernels.cuda import CudaBackend, FlashAttn, accepts_seqused_k, find_flash_attn, paged_block_sizes
from kernels.ref import RefBackend
from kernels.testing.fake_torch_npu import paged_attention_math

HEADS, KV_HEADS, DIM = 8, 2, 32
SCALE = DIM ** -0.5


def test_paged_block_size_rules():
    assert paged_block_sizes("vllm_flash_attn", "2.6.2") == [16, 32, 64, 128, 256]
    assert paged_block_sizes("flash_attn", "2.7.4.post1") == [256, 512]
    assert paged_block_sizes("flash_attn", "3.0.0b1") is None
    assert paged_block_sizes("xformers", "0.0.28") is None


def test_kv_length_argument_follows_the_signature():
    def vllm_style(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None,
                   seqused_k=None, block_table=None): ...

    def flash_attn_style(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         block_table=None): ...

    assert accepts_seqused_k(vllm_style) and not accepts_seqused_k(flash_attn_style)
    assert not accepts_seqused_k(object())


def test_without_flash_attn_it_is_ref_with_any_block_size():
    backend = CudaBackend(flash=None)
    assert backend.name == "cuda" and backend.supported_block_sizes() is None
    if find_flash_attn() is None:
        assert CudaBackend().flash is None


def _fake_varlen(seqused: bool, block_rule: int):
    """flash_attn_varlen_func stand-in: checks the paged-KV contract, computes with plain torch."""
    def varlen(*, q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
               block_table, seqused_k=None, cu_seqlens_k=None):
        assert q.dtype in (torch.float16, torch.bfloat16) and k.dtype == v.dtype == q.dtype
        assert causal and k.shape[1] % block_rule == 0 and k.dim() == 4
        assert cu_seqlens_q.dtype == block_table.dtype == torch.int32
        assert block_table.shape[0] == cu_seqlens_q.numel() - 1
        if seqused:
            assert cu_seqlens_k is None and seqused_k.dtype == torch.int32
            kv_lens = seqused_k.tolist()
        else:
            assert seqused_k is None and cu_seqlens_k.dtype == torch.int32 and cu_seqlens_k[0] == 0
            kv_lens = cu_seqlens_k.diff().tolist()
        q_lens = cu_seqlens_q.diff().tolist()
        assert max(q_lens) == max_seqlen_q and max(kv_lens) == max_seqlen_k
        return paged_attention_math(q, k, v, block_table, q_lens, kv_lens, softmax_scale, True)[0]

    if seqused:
        def vllm_varlen(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None,
                        seqused_k=None, softmax_scale=None, causal=False, block_table=None):
            return varlen(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
                          max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
                          block_table=block_table, seqused_k=seqused_k, cu_seqlens_k=cu_seqlens_k)
        return vllm_varlen
    return varlen


def _batch(block_size: int, dtype, device="cpu"):
    gen = torch.Generator().manual_seed(block_size)
    seq_lens, q_lens = [block_size + 3, 5, 2 * block_size], [block_size + 3, 2, 1]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, block_size, KV_HEADS, DIM)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(dtype).to(device) for _ in range(2))
    tables, slots = [], []
    for q_len, n in zip(q_lens, seq_lens):
        tables.append([perm.pop() for _ in range(-(-n // block_size))] + [0])
        slots += [tables[-1][p // block_size] * block_size + p % block_size for p in range(n - q_len, n)]
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    total = sum(q_lens)
    new = [torch.randn(total, h, DIM, generator=gen).to(dtype).to(device) for h in (HEADS, KV_HEADS, KV_HEADS)]
    ends = torch.tensor([0, *q_lens[:2]]).cumsum(0).to(torch.int32).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    prefill = PrefillMetadata(ends, lens[:2], table[:2], q_lens[:2], seq_lens[:2])
    decode = DecodeMetadata(lens[2:], table[2:], seq_lens[2:])
    return k_cache, v_cache, torch.tensor(slots, device=device), new, prefill, decode


def _run(backend, block_size, dtype, device="cpu"):
    k_cache, v_cache, slots, (q, k, v), prefill, decode = _batch(block_size, dtype, device)
    backend.write_kv(k, v, k_cache, v_cache, slots)
    n = prefill.num_tokens
    out = torch.cat([backend.prefill(q[:n], k[:n], v[:n], k_cache, v_cache, prefill, SCALE),
                     backend.decode(q[n:], k_cache, v_cache, decode, SCALE)])
    return out, k_cache


@pytest.mark.parametrize("seqused,block_size", [(True, 16), (False, 256)], ids=["vllm_flash_attn", "flash_attn"])
def test_flash_plumbing_matches_ref(seqused, block_size):
    flash = FlashAttn("fake", _fake_varlen(seqused, block_size), (block_size,), seqused)
    backend = CudaBackend(flash=flash)
    assert backend.supported_block_sizes() == [block_size]
    out, k_cache = _run(backend, block_size, torch.bfloat16)
    ref_out, ref_k = _run(RefBackend(), block_size, torch.bfloat16)
    assert torch.equal(k_cache, ref_k)
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
    fp32_out, _ = _run(backend, block_size, torch.float32)
    torch.testing.assert_close(fp32_out, _run(RefBackend(), block_size, torch.float32)[0])
    with pytest.raises(ValueError, match="block_size in"):
        _run(backend, block_size * 2, torch.bfloat16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_on_gpu_matches_ref(dtype):
    backend = CudaBackend(device="cuda")
    block_size = (backend.supported_block_sizes() or [16])[0]
    out, k_cache = _run(backend, block_size, dtype, "cuda")
    ref_out, ref_k = _run(RefBackend(), block_size, dtype, "cuda")
    assert torch.equal(k_cache, ref_k)
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
