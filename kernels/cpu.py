"""Fast CPU backend: decode attention in C++ straight over the block tables, the ops
around a layer's matmuls (norms, rotary, SiLU-and-multiply, KV writes) as one C++ pass
each (kernels/csrc/, built at install time by kernels/cpu_extension.py), and every linear
layer on oneDNN over weights packed once at load time (a tied lm_head is packed as a copy:
the embedding lookup keeps the dense matrix); prefill attention is `ref`'s.

Why: PyTorch's CPU F.linear calls MKL's sgemm, which on small row counts (a decode batch
of 2-32 tokens) reaches only a fraction of the machine (MKL picks slow paths on AMD CPUs,
and re-packs the weight on every call). oneDNN with a pre-packed weight runs those shapes
1.3-2x faster at one thread (bench/kernels.py --linear; docs/benchmarks.md), which is what
vLLM's CPU build runs too. Packing replaces the dense weight (no second copy is kept).

The C++ decode reads each key and value row once from the cache, where ref gathers the
blocks into a contiguous copy first (bench/kernels.py: 1.8-12x at one thread). The layer
ops replace 5-10 tiny torch ops each: at a decode batch of a few tokens their dispatch,
not their arithmetic, took about a third of SmolLM2's step. Where the extension cannot be
built (no compiler), all of these are ref's.

Weights oneDNN cannot pack here (a dtype without oneDNN support on this CPU) stay dense and
go through F.linear, as on `ref`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kernels.api import DecodeMetadata
from kernels.cpu_extension import cpu_kernels
from kernels.kv_int8 import KVCacheScales, over_codes
from kernels.mla_cpu_decode import consecutive, latent_gemm_decode
from kernels.moe import routed_by_expert
from kernels.ref import RefBackend

FEW_ROWS = 8     # rows an expert up to which its matmuls are GEMVs (csrc/moe_cpu.cpp), not a GEMM


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs and multiplies weights of this dtype on this CPU."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


INT4_GROUPS = (32, 64, 128, 256)


@dataclass(frozen=True)
class Int4Packed:
    """A 4-bit weight as torch's CPU int4 matmul takes it: the repacked codes and
    [in / group, out, 2] (scale, zero = 0) pairs; weight = (code - 8) * scale."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    group_size: int


def cpu_flags() -> set[str]:
    """The instruction-set flags of this CPU (/proc/cpuinfo; empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def int8_gemm_path() -> str:
    """What torch._int_mm runs on this CPU (oneDNN's VNNI/AMX kernels, or ATen's exact loop)."""
    flags = cpu_flags()
    found = [name for flag, name in (("amx_int8", "AMX-INT8"), ("avx512_vnni", "AVX512-VNNI"),
                                     ("avx_vnni", "AVX-VNNI")) if flag in flags]
    if found:
        return f"torch._int_mm on oneDNN ({', '.join(found)})"
    return "torch._int_mm without VNNI (an exact but slow loop)"


class CpuBackend(RefBackend):
    """ref's kernels; linear layers on oneDNN-packed weights; int8 GEMMs of up to 4 rows on the
    C++ AVX512-VNNI GEMV where the CPU has it, the others on torch._int_mm."""

    name = "cpu"

    def __init__(self, device: torch.device | str | None = None) -> None:
        super().__init__(device)
        if device is not None and torch.device(device).type != "cpu":
            raise ImportError(f"the cpu kernel backend runs on device cpu only, not {device}")
        self.extension = cpu_kernels()
        self._gemv = self.extension is not None and self.extension.int8_gemv_supported()
        # (a step's DecodeMetadata, which of its sequences' blocks are consecutive): every
        # MLA layer of the step shares it, so it is computed once a step, not once a layer
        self._consecutive: tuple[DecodeMetadata | None, list[bool]] = (None, [])

    @property
    def int8_path(self) -> str:
        if self._gemv:
            return (f"up to {self.extension.int8_gemv_max_rows} rows (a decode step's) on pdmesh's AVX512-VNNI GEMV, "
                    f"more rows or over {self.extension.int8_gemv_max_in} inputs {int8_gemm_path()}")
        return int8_gemm_path()

    def prepare_int8_weight(self, weight: torch.Tensor) -> Any:
        # _int_mm's right-hand side [in, out] as a transposed view: oneDNN took it 1.6-3x faster
        # for one row than the same matrix made contiguous, and as fast for 2 to 512 rows
        # (timed by hand on a Zen 4 EPYC, SmolLM2's shapes)
        return weight.t()

    def int8_matmul(self, x_q: torch.Tensor, weight: Any) -> torch.Tensor:
        # a decode step's few rows: each weight row read once into every row, faster than
        # oneDNN's int8 GEMM there (bench/int8_gemv.py); exact either way
        ext = self.extension
        if (self._gemv and 0 < x_q.shape[0] <= ext.int8_gemv_max_rows and weight.shape[0] <= ext.int8_gemv_max_in
                and weight.t().is_contiguous()):
            return ext.int8_gemv(x_q.contiguous(), weight.t())
        return torch._int_mm(x_q.contiguous(), weight)

    def quantize_per_tensor(self, x, scale: float, offset: float):
        if self.extension is None or x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1:
            return super().quantize_per_tensor(x, scale, offset)
        return self.extension.quantize_per_tensor(x, scale, offset)

    def quantize_per_token(self, x, divisor: float):
        if self.extension is None or x.dim() != 2 or x.stride(1) != 1:
            return super().quantize_per_token(x, divisor)
        return tuple(self.extension.quantize_per_token(x, divisor))

    def int8_scaled_matmul(self, x_q, weight, scale, row_scale=None, int_bias=None, bias=None,
                           out_dtype=torch.float32):
        if self.extension is None or (bias is not None and bias.dtype != torch.float32):
            return super().int8_scaled_matmul(x_q, weight, scale, row_scale, int_bias, bias, out_dtype)
        return self.extension.dequant_rows(self.int8_matmul(x_q, weight), scale, row_scale, int_bias, bias, out_dtype)

    # torch's packed int4 CPU matmul ran 11-17x (1 row) to 88-95x (512 rows) slower than oneDNN on the
    # dequantized weight (bench/int4_cpu.py, bench/results/int4_cpu.json): W4A16 on a CPU is
    # dequantized once at load, and its 4-bit storage saves disk and transfer, not memory.
    # use_int4_kernel = True restores torch's kernel (for CPUs where it is fast).
    int4_path = "dequantized at load, oneDNN-packed (torch's int4 CPU matmul measured slower)"
    use_int4_kernel = False

    def prepare_int4_weight(self, codes: torch.Tensor, scale: torch.Tensor, group_size: int,
                            dtype: torch.dtype) -> Any:
        if not self.use_int4_kernel or dtype != torch.float32 or codes.shape[0] % 16 or group_size not in INT4_GROUPS:
            # torch's int4 matmul: 16 | out_features, groups of 32, 64, 128 or 256 inputs
            return self.prepare_linear(super().prepare_int4_weight(codes, scale, group_size, dtype))
        packed = torch._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
        scales_and_zeros = torch.stack([scale.t(), torch.zeros_like(scale.t())], dim=-1).contiguous()
        return Int4Packed(packed, scales_and_zeros, group_size)

    def int4_linear(self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None) -> torch.Tensor:
        if not isinstance(weight, Int4Packed):
            return self.linear(x, weight, bias)
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch._weight_int4pack_mm_for_cpu(rows, weight.packed, weight.group_size, weight.scales_and_zeros)
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], out.shape[-1])

    def decode(self, query, k_cache, v_cache, meta: DecodeMetadata, scale: float,
               kv_scales: KVCacheScales | None = None) -> torch.Tensor:
        if kv_scales is not None:
            return over_codes(self.decode, query, kv_scales, k_cache, v_cache, meta, scale)
        if self.extension is None or query.shape[0] == 0:
            return super().decode(query, k_cache, v_cache, meta, scale)
        out = self.extension.paged_decode(query.float(), k_cache, v_cache, meta.block_tables.contiguous(),
                                          meta.seq_lens.contiguous(), scale)
        return out.to(query.dtype)

    def mla_decode(self, query, planes, meta: DecodeMetadata, scale: float, kv_lora_rank: int) -> torch.Tensor:
        """The sequences whose blocks are consecutive as two GEMMs each over their rows in
        place (kernels/mla_cpu_decode.py, every head at once); the rest on the paged kernel."""
        if len(planes) != 1 or query.shape[0] == 0:
            return super().mla_decode(query, planes, meta, scale, kv_lora_rank)
        cached_meta, in_place = self._consecutive
        if cached_meta is not meta:
            in_place = consecutive(meta, planes[0].shape[1])
            self._consecutive = (meta, in_place)    # swapped whole: threads sharing it at worst recompute
        if not any(in_place):
            return super().mla_decode(query, planes, meta, scale, kv_lora_rank)
        if all(in_place):
            return latent_gemm_decode(query, planes[0], meta, scale, kv_lora_rank)
        out = query.new_empty(query.shape[0], query.shape[1], kv_lora_rank)
        for keep, path in ((True, lambda q, m: latent_gemm_decode(q, planes[0], m, scale, kv_lora_rank)),
                           (False, lambda q, m: super(CpuBackend, self).mla_decode(q, planes, m, scale, kv_lora_rank))):
            rows = [i for i, c in enumerate(in_place) if c == keep]
            index = torch.tensor(rows)
            part = DecodeMetadata(seq_lens=meta.seq_lens[index], block_tables=meta.block_tables[index],
                                  seq_lens_list=[meta.seq_lens_list[i] for i in rows])
            out[index] = path(query[index], part)
        return out

    def rms_norm(self, x, weight, eps: float) -> torch.Tensor:
        if self.extension is None or x.dtype != weight.dtype:
            return super().rms_norm(x, weight, eps)
        rows = x.reshape(-1, x.shape[-1])
        return self.extension.rms_norm(rows, weight, eps).view(x.shape)

    def add_rms_norm(self, x, residual, weight, eps: float) -> torch.Tensor:
        if self.extension is None or x.dtype != weight.dtype or x.dim() != 2 or not residual.is_contiguous():
            return super().add_rms_norm(x, residual, weight, eps)
        return self.extension.add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if self.extension is None or x.dim() != 2:
            return super().silu_and_mul(x)
        return self.extension.silu_and_mul(x)

    def rotary(self, positions, query, key, cos, sin):
        if self.extension is None or cos.dtype != torch.float32:
            return super().rotary(positions, query, key, cos, sin)
        self.extension.rotary(positions, query, key, cos, sin)
        return query, key

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        if self.extension is None or key.dtype != k_cache.dtype:
            return super().write_kv(key, value, k_cache, v_cache, slot_mapping)
        self.extension.write_kv(key, value, k_cache, v_cache, slot_mapping)

    def prepare_linear(self, weight: torch.Tensor) -> Any:
        if weight.device.type != "cpu" or not onednn_packs(weight.dtype):
            return weight
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)

    def prepare_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> tuple[Any, Any]:
        """With the C++ kernels: the experts as they are (contiguous), for the few-rows
        kernel (csrc/moe_cpu.cpp; more rows an expert go through a GEMM on them). Without:
        each expert's matrices oneDNN-packed, as a linear layer's (a decode step's one to a
        few rows an expert cost ~2x unpacked: bench/moe_step.py)."""
        if w13.device.type != "cpu":
            return w13, w2
        if self.extension is not None:
            return w13.contiguous(), w2.contiguous()
        if not onednn_packs(w13.dtype):
            return w13, w2
        return [self.prepare_linear(w) for w in w13], [self.prepare_linear(w) for w in w2]

    def routed_experts(self, x, weights, ids, w13, w2, first_expert: int = 0) -> torch.Tensor:
        if isinstance(w13, list):       # oneDNN-packed
            def packed(e: int, rows: torch.Tensor) -> torch.Tensor:
                return self.linear(self.silu_and_mul(self.linear(rows, w13[e], None)), w2[e], None)
            return routed_by_expert(x, weights, ids, len(w13), packed, first_expert)
        if self.extension is None or x.device.type != "cpu":
            return super().routed_experts(x, weights, ids, w13, w2, first_expert)

        def plain(e: int, rows: torch.Tensor) -> torch.Tensor:
            return F.linear(self.silu_and_mul(F.linear(rows, w13[e])), w2[e])

        def few_rows(rows: torch.Tensor, counts: list[int]) -> torch.Tensor | None:
            if max(counts) > FEW_ROWS:
                return None
            return self.extension.moe_experts_few_rows(rows.contiguous(), w13, w2, counts)
        return routed_by_expert(x, weights, ids, w13.shape[0], plain, first_expert, all_runs=few_rows)

    def linear(self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None) -> torch.Tensor:
        if not weight.is_mkldnn:
            return super().linear(x, weight, bias)
        rows = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")
        return out.view(*x.shape[:-1], out.shape[-1])
