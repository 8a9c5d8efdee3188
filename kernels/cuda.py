"""CUDA backend: flash-attn's paged varlen kernel when a flash-attn build is installed,
else the ref kernels on the GPU.

    package           call (paged KV, causal bottom-right)          paged block sizes
    vllm_flash_attn   flash_attn_varlen_func(..., seqused_k=seq_lens,  multiples of 16
                      block_table=...)  [cu_seqlens_k on old builds]
    flash_attn 2.x    flash_attn_varlen_func(..., cu_seqlens_k=        multiples of 256
                      cumsum(seq_lens), block_table=...)

Both read K/V straight from the caches [num_blocks, block_size, KV_N, D] through an int32
block_table; GQA is native. flash-attn takes float16/bfloat16 only, so a float32 model
runs attention on the ref kernels. KV write is index_copy_ into the flat cache view.
Neither package is imported before CudaBackend is constructed.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.api import DecodeMetadata, PrefillMetadata
from kernels.ref import RefBackend

logger = logging.getLogger(__name__)
PACKAGES = ("vllm_flash_attn", "flash_attn")
_HALF = (torch.float16, torch.bfloat16)


def paged_block_sizes(package: str, version: str) -> list[int] | None:
    """Block sizes `package` at `version` accepts for a paged KV cache (smallest first), or
    None when this backend does not know its rule (it then falls back to ref)."""
    if package == "vllm_flash_attn":
        return [16, 32, 64, 128, 256]
    if package == "flash_attn" and version.split(".")[0] == "2":
        return [256, 512]
    return None


def accepts_seqused_k(varlen: Callable) -> bool:
    """Whether flash_attn_varlen_func takes per-request KV lengths (seqused_k) rather than
    cumulative ones (cu_seqlens_k)."""
    try:
        return "seqused_k" in inspect.signature(varlen).parameters
    except (TypeError, ValueError):
        return False


@dataclass(frozen=True)
class FlashAttn:
    """One installed flash-attn build."""

    package: str
    varlen: Callable
    block_sizes: tuple[int, ...]
    seqused_k: bool


def find_flash_attn() -> FlashAttn | None:
    """The first usable package of PACKAGES, imported here; None when none is."""
    for package in PACKAGES:
        if importlib.util.find_spec(package) is None:
            continue
        try:
            module = importlib.import_module(package)
        except ImportError as exc:
            logger.warning("%s is installed but cannot be imported: %s", package, exc)
            continue
        varlen = getattr(module, "flash_attn_varlen_func", None)
        sizes = paged_block_sizes(package, str(getattr(module, "__version__", "")))
        if varlen is None or sizes is None:
            logger.warning("%s %s has no known paged varlen API; skipped", package,
                           getattr(module, "__version__", "?"))
            continue
        return FlashAttn(package, varlen, tuple(sizes), accepts_seqused_k(varlen))
    return None


FLASH_MAX_HEAD_DIM = 256      # flash-attn's (and vllm_flash_attn's) widest head


class CudaBackend(RefBackend):
    """Paged attention with flash-attn on CUDA; ref kernels for everything else (norm,
    rotary, and attention when flash-attn is missing or the dtype is float32).
    `flash="detect"` finds an installed build; tests may pass a FlashAttn or None."""

    name = "cuda"

    def __init__(self, device: torch.device | str | None = None,
                 flash: FlashAttn | None | str = "detect") -> None:
        super().__init__(device)
        self.flash = find_flash_attn() if flash == "detect" else flash
        self._slots_cache: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)

    def supported_block_sizes(self) -> list[int] | None:
        return None if self.flash is None else list(self.flash.block_sizes)

    def _valid_rows(self, slot_mapping: torch.Tensor) -> torch.Tensor | None:
        """Rows whose slot is not -1 (None: all), computed once per slot_mapping object so a
        step pays one host sync, not one a layer; swapped atomically (thread-safe)."""
        cached_key, cached_rows = self._slots_cache
        if cached_key is slot_mapping:
            return cached_rows
        keep = slot_mapping >= 0
        rows = None if bool(keep.all()) else keep.nonzero().squeeze(1)
        self._slots_cache = (slot_mapping, rows)
        return rows

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        rows = self._valid_rows(slot_mapping)
        if rows is not None:
            key, value, slot_mapping = key[rows], value[rows], slot_mapping[rows]
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value)

    def write_latent(self, c_kv, k_pe, planes, slot_mapping) -> None:
        """One latent plane (latent_planes() is 1 here), with one host sync a step."""
        rows = self._valid_rows(slot_mapping)
        if rows is not None:
            c_kv, k_pe, slot_mapping = c_kv[rows], k_pe[rows], slot_mapping[rows]
        cache = planes[0]
        latent = torch.cat([c_kv, k_pe], dim=-1).unsqueeze(1)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, latent.to(cache.dtype))

    def mla_decode(self, query, planes, meta: DecodeMetadata, scale: float, kv_lora_rank: int) -> torch.Tensor:
        """flash-attn takes head_dim <= 256 and a latent row is wider (DeepSeek's 576):
        ref's tiled paged decode over it then (a FlashMLA kernel is what would be fast)."""
        if query.shape[-1] > FLASH_MAX_HEAD_DIM:
            return RefBackend.decode(self, query, planes[0], planes[0], meta, scale)[..., :kv_lora_rank]
        return super().mla_decode(query, planes, meta, scale, kv_lora_rank)

    def _use_flash(self, query: torch.Tensor, k_cache: torch.Tensor) -> bool:
        if self.flash is None or query.dtype not in _HALF:
            return False
        if k_cache.shape[1] not in self.flash.block_sizes:
            raise ValueError(f"{self.flash.package} paged attention needs block_size in "
                             f"{list(self.flash.block_sizes)}, got {k_cache.shape[1]}")
        return True

    def _flash(self, query, k_cache, v_cache, cu_seqlens_q, max_seqlen_q: int,
               seq_lens: torch.Tensor, max_seqlen_k: int, block_tables, scale: float):
        kwargs = dict(q=query, k=k_cache, v=v_cache, cu_seqlens_q=cu_seqlens_q,
                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                      softmax_scale=scale, causal=True,
                      block_table=block_tables.to(torch.int32))
        if self.flash.seqused_k:
            kwargs["seqused_k"] = seq_lens.to(torch.int32)
        else:
            kwargs["cu_seqlens_k"] = F.pad(seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
        return self.flash.varlen(**kwargs)

    def prefill(self, query, key, value, k_cache, v_cache, meta: PrefillMetadata,
                scale: float, kv_scales=None) -> torch.Tensor:
        if kv_scales is not None or not self._use_flash(query, k_cache):   # flash-attn reads no int8 cache
            return super().prefill(query, key, value, k_cache, v_cache, meta, scale, kv_scales)
        return self._flash(query, k_cache, v_cache, meta.query_start_loc.to(torch.int32),
                           max(meta.query_lens_list), meta.seq_lens, meta.max_seq_len,
                           meta.block_tables, scale)

    def decode(self, query, k_cache, v_cache, meta: DecodeMetadata, scale: float,
               kv_scales=None) -> torch.Tensor:
        if kv_scales is not None or meta.num_seqs == 0 or not self._use_flash(query, k_cache):
            return super().decode(query, k_cache, v_cache, meta, scale, kv_scales)
        cu_seqlens_q = torch.arange(meta.num_seqs + 1, dtype=torch.int32, device=query.device)
        return self._flash(query, k_cache, v_cache, cu_seqlens_q, 1, meta.seq_lens,
                           meta.max_seq_len, meta.block_tables, scale)

    # ---- W8A8 -------------------------------------------------------------------------------
    # torch._int_mm on CUDA (cuBLASLt) wants more than 16 rows and inputs and outputs that are
    # multiples of 8: fewer rows are padded with zero rows (a decode batch of one costs the
    # GEMM of 17); a shape with another multiple runs ref's exact float64 product instead.
    int8_path = "torch._int_mm on cuBLASLt (rows padded to 17; float64 where a dimension is no multiple of 8)"
    INT8_MIN_ROWS = 17

    def prepare_int8_weight(self, weight: torch.Tensor):
        return weight.t()    # [in, out], column-major: cuBLASLt's int8 operand order

    def int8_matmul(self, x_q: torch.Tensor, weight) -> torch.Tensor:
        rows, k = x_q.shape
        if x_q.device.type != "cuda" or k % 8 or weight.shape[1] % 8:
            return (x_q.double() @ weight.double()).to(torch.int32)
        if rows < self.INT8_MIN_ROWS:
            return torch._int_mm(F.pad(x_q, (0, 0, 0, self.INT8_MIN_ROWS - rows)), weight)[:rows]
        return torch._int_mm(x_q.contiguous(), weight)
