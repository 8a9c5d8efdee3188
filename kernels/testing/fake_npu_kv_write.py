"""The KV-cache writes of the torch_npu emulator (fake_torch_npu.install() adds them); the
contract is in fake_torch_npu's module doc.

  npu_scatter_pa_kv_cache   3-D key/value [T, N, D]; ND caches [blocks, block_size, N, D]
                            need cache_mode="Norm"; one dtype for all four; slot_mapping
                            int32/int64 [T], unique, in [0, blocks * block_size); contiguous.
  _npu_reshape_and_cache    the same with slot_indices int32 only (older torch_npu).
"""
from __future__ import annotations

import torch

from kernels.testing.fake_torch_npu import _check_contiguous, _require


def _check_slots(op: str, slots: torch.Tensor, num_tokens: int, capacity: int, dtypes) -> None:
    _require(slots.dtype in dtypes, op, f"slot mapping dtype must be one of {dtypes}, got {slots.dtype}")
    _require(slots.dim() == 1 and slots.shape[0] == num_tokens, op,
             f"slot mapping must be 1-D with one slot per token ({num_tokens}), got {tuple(slots.shape)}")
    if num_tokens:
        lo, hi = int(slots.min()), int(slots.max())
        _require(lo >= 0 and hi < capacity, op,
                 f"slots must lie in [0, num_blocks * block_size = {capacity}), got [{lo}, {hi}]")
        _require(slots.unique().numel() == num_tokens, op, "slots must be unique")


def _scatter(op: str, key, value, key_cache, value_cache, slots, slot_dtypes) -> None:
    _require(key.dim() == 3 and value.dim() == 3, op, "key and value must be 3-D [T, N, D]")
    _require(key.shape[:2] == value.shape[:2], op, "key and value must share their first two dims")
    _require(key_cache.dim() == 4 and value_cache.dim() == 4, op, "caches must be 4-D")
    dtypes = {key.dtype, value.dtype, key_cache.dtype, value_cache.dtype}
    _require(len(dtypes) == 1, op, f"key, value and caches must share one dtype, got {dtypes}")
    _require(key_cache.shape[2:] == key.shape[1:] and value_cache.shape[2:] == value.shape[1:]
             and key_cache.shape[:2] == value_cache.shape[:2], op,
             "ND caches must be [num_blocks, block_size, N, D] matching key/value")
    _check_contiguous(op, key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                      slot_mapping=slots)
    capacity = key_cache.shape[0] * key_cache.shape[1]
    _check_slots(op, slots, key.shape[0], capacity, slot_dtypes)
    idx = slots.long()
    key_cache.view(capacity, *key.shape[1:]).index_copy_(0, idx, key)
    value_cache.view(capacity, *value.shape[1:]).index_copy_(0, idx, value)


def npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, *,
                            compress_lens=None, compress_seq_offsets=None, seq_lens=None,
                            cache_mode="PA_NZ"):
    """Scenario 1 of torch_npu.npu_scatter_pa_kv_cache; caches updated in place."""
    op = "npu_scatter_pa_kv_cache"
    if compress_lens is not None or compress_seq_offsets is not None or seq_lens is not None:
        raise NotImplementedError(f"{op}: the emulator models 3-D key/value (no compression) only")
    _require(cache_mode in (None, "Norm"), op,
             f"cache_mode {cache_mode!r} takes NZ caches [num_blocks, N*D//16, block_size, 16]; "
             "an ND cache [num_blocks, block_size, N, D] needs cache_mode='Norm'")
    _scatter(op, key, value, key_cache, value_cache, slot_mapping, (torch.int32, torch.int64))


def _npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices):
    """Older torch_npu KV write: same layouts, int32 slot_indices; caches updated in place."""
    _scatter("_npu_reshape_and_cache", key, value, key_cache, value_cache, slot_indices,
             (torch.int32,))
