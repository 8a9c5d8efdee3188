"""Ascend NPU backend (torch_npu), following vllm-ascend on Atlas A2 (910B).

Per layer and step:
    write_kv  -> torch_npu.npu_scatter_pa_kv_cache(cache_mode="Norm")
                 (torch_npu._npu_reshape_and_cache on torch_npu without it)
    prefill   -> one npu_fused_infer_attention_score, TND, sparse_mode=3 + cached mask
    decode    -> one npu_fused_infer_attention_score, TND, sparse_mode=0, no mask
    int8 (C8) KV cache: K/V quantized by the model (torch ops), decode -> FIA in BSH with
                 key/value antiquant scales; prefill dequantizes the blocks it reads first
    rms_norm  -> torch_npu.npu_rms_norm(...)[0]
    MoE       -> npu_moe_gating_top_k_softmax (softmax router) or npu_moe_gating_top_k
                 (DeepSeek-V3's grouped sigmoid), then per layer
                 npu_moe_init_routing_v2 -> npu_grouped_matmul (w13) -> npu_swiglu ->
                 npu_grouped_matmul (w2) -> npu_moe_finalize_routing (routed_experts below)
    rotary    -> torch_npu.npu_rotary_mul(x, cos, sin) (rotate-half) on q and k
    MLA       -> a split latent cache (c_kv and k_pe planes); latent norm + rope + cache
                 write: npu_kv_rmsnorm_rope_cache; the absorbed decode: FIA's MLA mode
                 (kernels/npu_mla.py)

Attention call, both phases (page attention over the layer's caches):
    query [T, N, D] ("TND"), key/value = caches viewed as [num_blocks, 128, KV_N * D]
    actual_seq_lengths    = cumulative query ends  [q0, q0+q1, ...]   (host ints, len B)
    actual_seq_lengths_kv = per-request KV lengths [kv0, kv1, ...]     (host ints, len B)
    block_table int32 [B, max_blocks], block_size=128, num_heads / num_key_value_heads,
    inner_precise=0 (high precision: float32 softmax accumulation for float16 inputs).
Prefill's mask is the (2048, 2048) int8 upper-triangular matrix sparse_mode=3 (causal,
bottom-right aligned) requires, built once per device.

torch_npu is imported when NpuBackend is constructed, never at module import; without it
construction raises a RuntimeError that says how to get it (or emulate it on CPU with
kernels.testing.fake_torch_npu.install()).
"""
from __future__ import annotations

import inspect
import logging
import re
from itertools import accumulate

import torch

from kernels.api import Backend, DecodeMetadata, PrefillMetadata
from kernels.kv_int8 import KVCacheScales, dequantize_kv
from kernels.npu_mla import NpuMLA, cos_sin

log = logging.getLogger("pdmesh.kernels")
BLOCK_SIZE = 128
MASK_SIZE = 2048
QUANT_MATMUL_MAX_DIM = 65535    # npu_quant_matmul's last dims
MOE_GATING_MAX_EXPERTS = 2048   # npu_moe_gating_top_k's experts (each group padded to 32)
_REQUIRED_OPS = ("npu_fused_infer_attention_score", "npu_rms_norm", "npu_rotary_mul")
# a MoE model's: without them (an older torch_npu) its routers and experts run the torch path
MOE_OPS = ("npu_moe_gating_top_k_softmax", "npu_moe_gating_top_k", "npu_moe_init_routing_v2",
           "npu_grouped_matmul", "npu_swiglu", "npu_moe_finalize_routing")
MLA_OPS = ("npu_kv_rmsnorm_rope_cache",)   # without it: MLA's latent write runs torch's ops


def _import_torch_npu():
    try:
        import torch_npu
    except ImportError as exc:
        raise RuntimeError(
            "the npu kernel backend needs torch_npu (pip install torch-npu matching your torch "
            "and CANN versions); on a machine without an NPU, "
            "kernels.testing.fake_torch_npu.install() emulates it on CPU") from exc
    missing = [op for op in _REQUIRED_OPS if not hasattr(torch_npu, op)]
    if not hasattr(torch_npu, "npu_scatter_pa_kv_cache") and not hasattr(torch_npu, "_npu_reshape_and_cache"):
        missing.append("npu_scatter_pa_kv_cache or _npu_reshape_and_cache")
    if missing:
        raise RuntimeError(f"torch_npu {getattr(torch_npu, '__version__', '?')} lacks {missing}; "
                           "the npu kernel backend needs torch_npu >= 2.1 with CANN >= 8.0")
    return torch_npu


def _op_keywords(op) -> set[str]:
    """Keyword names an op accepts: its Python signature, else its torch schema, else the
    names its docstring shows as `name=`."""
    try:
        names = set(inspect.signature(op).parameters)
    except (TypeError, ValueError):
        names = set()
    if not names & {"scale", "scale_value"} and hasattr(op, "overloads"):
        for overload in op.overloads():
            names |= {arg.name for arg in getattr(op, overload)._schema.arguments}
    if not names & {"scale", "scale_value"}:
        names |= set(re.findall(r"\b(scale(?:_value)?)\s*=", op.__doc__ or ""))
    return names


def scale_keyword(op) -> str:
    """'scale' (torch_npu >= 2.5) or 'scale_value' (older): the softmax-scale keyword of
    npu_fused_infer_attention_score."""
    names = _op_keywords(op)
    return "scale_value" if "scale_value" in names and "scale" not in names else "scale"


class NpuBackend(NpuMLA, Backend):
    """Paged attention with torch_npu. Caches must be [num_blocks, 128, KV_N, D] and
    contiguous per layer; query/key/value float16 or bfloat16 on a real NPU. Safe to share
    across layers, engines and threads: its only state is per-device masks and the last
    slot filter."""

    name = "npu"

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = device
        self._npu = _import_torch_npu()
        self._scatter = getattr(self._npu, "npu_scatter_pa_kv_cache", None)
        self._scale_kw = scale_keyword(self._npu.npu_fused_infer_attention_score)
        self._fia_mla = {"query_rope", "key_rope"} <= _op_keywords(self._npu.npu_fused_infer_attention_score)
        self._masks: dict[torch.device, torch.Tensor] = {}
        self._moe_missing = [op for op in MOE_OPS if not hasattr(self._npu, op)]
        self._moe_told = False
        self._mla_missing = [op for op in MLA_OPS if not hasattr(self._npu, op)]
        self._told: set[str] = set()     # the one-time notes of MLA's torch paths
        self._slots_cache: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        self._static_inputs: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._antiquant_args: dict[tuple, tuple[KVCacheScales, dict]] = {}

    def supported_block_sizes(self) -> list[int] | None:
        return [BLOCK_SIZE]

    def _valid_rows(self, slot_mapping: torch.Tensor) -> torch.Tensor | None:
        """Row indices whose slot is not -1, or None when all are valid. Computed once per
        slot_mapping object (one host sync a step, not one a layer); the (key, rows) pair is
        swapped atomically, so threads sharing the backend at worst recompute it."""
        cached_key, cached_rows = self._slots_cache
        if cached_key is slot_mapping:
            return cached_rows
        keep = slot_mapping >= 0
        rows = None if bool(keep.all()) else keep.nonzero().squeeze(1)
        self._slots_cache = (slot_mapping, rows)
        return rows

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        num_tokens = slot_mapping.shape[0]
        key, value = key[:num_tokens], value[:num_tokens]
        rows = self._valid_rows(slot_mapping)
        if rows is not None:
            key, value, slot_mapping = key[rows], value[rows], slot_mapping[rows]
        if slot_mapping.numel() == 0:
            return
        key, value = key.contiguous(), value.contiguous()
        if self._scatter is not None:
            self._scatter(key, value, k_cache, v_cache, slot_mapping.contiguous(), cache_mode="Norm")
        else:
            self._npu._npu_reshape_and_cache(key=key, value=value, key_cache=k_cache,
                                             value_cache=v_cache,
                                             slot_indices=slot_mapping.to(torch.int32))

    def _mask(self, device: torch.device) -> torch.Tensor:
        mask = self._masks.get(device)
        if mask is None:
            mask = torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.int8).triu_(1).to(device)
            self._masks[device] = mask
        return mask

    def _attention(self, query, k_cache, v_cache, block_tables, q_ends: list[int],
                   kv_lens: list[int], scale: float, causal: bool) -> torch.Tensor:
        num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
        if block_size != BLOCK_SIZE:
            raise ValueError(f"npu attention needs caches of block_size {BLOCK_SIZE}, got {block_size}")
        kwargs = {self._scale_kw: float(scale)}
        if causal:
            kwargs.update(sparse_mode=3, atten_mask=self._mask(query.device))
        out, _ = self._npu.npu_fused_infer_attention_score(
            query.contiguous(),
            k_cache.view(num_blocks, block_size, num_kv_heads * head_dim),
            v_cache.view(num_blocks, block_size, num_kv_heads * head_dim),
            block_table=block_tables.to(torch.int32).contiguous(),
            input_layout="TND", block_size=block_size,
            actual_seq_lengths=q_ends, actual_seq_lengths_kv=kv_lens,
            num_heads=query.shape[1], num_key_value_heads=num_kv_heads,
            inner_precise=0, **kwargs)
        return out.view(query.shape[0], query.shape[1], v_cache.shape[-1])

    def prefill(self, query, key, value, k_cache, v_cache, meta: PrefillMetadata,
                scale: float, kv_scales: KVCacheScales | None = None) -> torch.Tensor:
        """Reads every token (cached prefix and new) from the caches; key/value unused. An
        int8 cache: FIA takes no int8 pages with queries longer than 1, so the blocks the
        chunks read are dequantized into a float copy first (as vLLM-Ascend's C8 prefill)."""
        tables = meta.block_tables
        if kv_scales is not None:
            k_cache, v_cache, tables = _dequantized_blocks(k_cache, v_cache, tables, kv_scales, query.dtype)
        return self._attention(query, k_cache, v_cache, tables,
                               list(accumulate(meta.query_lens_list)), list(meta.seq_lens_list),
                               scale, causal=True)

    def decode(self, query, k_cache, v_cache, meta: DecodeMetadata, scale: float,
               kv_scales: KVCacheScales | None = None) -> torch.Tensor:
        if meta.num_seqs == 0:
            return torch.empty_like(query)
        if kv_scales is not None:
            return self._antiquant_decode(query, k_cache, v_cache, meta, scale, kv_scales)
        return self._attention(query, k_cache, v_cache, meta.block_tables,
                               list(range(1, meta.num_seqs + 1)), list(meta.seq_lens_list),
                               scale, causal=False)

    def _antiquant_decode(self, query, k_cache, v_cache, meta: DecodeMetadata, scale: float,
                          kv_scales: KVCacheScales) -> torch.Tensor:
        """FIA over the int8 pages in layout BSH (TND takes no antiquant), per-channel key and
        value scales of query's dtype; the op dequantizes (code + offset) * scale, ours is
        (code - offset) * scale, so it gets the negated offset (none when all are zero)."""
        num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
        if block_size != BLOCK_SIZE:
            raise ValueError(f"npu attention needs caches of block_size {BLOCK_SIZE}, got {block_size}")
        seqs, heads = query.shape[0], query.shape[1]
        out, _ = self._npu.npu_fused_infer_attention_score(
            query.reshape(seqs, 1, heads * head_dim).contiguous(),
            k_cache.view(num_blocks, block_size, num_kv_heads * head_dim),
            v_cache.view(num_blocks, block_size, num_kv_heads * head_dim),
            block_table=meta.block_tables.to(torch.int32).contiguous(), input_layout="BSH", block_size=block_size,
            actual_seq_lengths_kv=list(meta.seq_lens_list), num_heads=heads, num_key_value_heads=num_kv_heads,
            key_antiquant_mode=0, value_antiquant_mode=0, inner_precise=0, **self._antiquant(kv_scales, query.dtype),
            **{self._scale_kw: float(scale)})
        return out.view(seqs, heads, head_dim)

    def _antiquant(self, kv_scales: KVCacheScales, dtype: torch.dtype) -> dict:
        """FIA's antiquant arguments for a layer's scales, made once per layer and dtype (no
        host sync or cast in the step after the first)."""
        key = (id(kv_scales), dtype)      # the entry holds kv_scales: its id stays its own
        cached = self._antiquant_args.get(key)
        if cached is None:
            def channels(t: torch.Tensor) -> torch.Tensor:
                return t.reshape(1, -1).to(dtype).contiguous()

            def offset(t: torch.Tensor) -> torch.Tensor | None:
                return channels(-t) if bool(t.any()) else None

            cached = (kv_scales, dict(
                key_antiquant_scale=channels(kv_scales.k_scale), key_antiquant_offset=offset(kv_scales.k_offset),
                value_antiquant_scale=channels(kv_scales.v_scale), value_antiquant_offset=offset(kv_scales.v_offset)))
            self._antiquant_args[key] = cached
        return cached[1]

    # quantized linears (vllm-ascend's calls): W8A8 dynamic npu_dynamic_quant + npu_quant_matmul
    # with pertoken_scale; W8A8 static npu_quantize (x * 1/scale + offset) + npu_quant_matmul
    # with the int32 bias; W4A16 npu_weight_quant_batchmatmul on npu_convert_weight_to_int4pack
    int8_path = "npu_dynamic_quant / npu_quantize + npu_quant_matmul"
    int4_path = "npu_weight_quant_batchmatmul on int4-packed weights"

    def quantize_per_token(self, x, divisor: float):
        if divisor != 127.0:         # npu_dynamic_quant's divisor is 127; another convention: torch ops
            return super().quantize_per_token(x, divisor)
        x_q, scale = self._npu.npu_dynamic_quant(x)
        return x_q, scale.reshape(-1, 1)

    def quantize_per_tensor(self, x, scale: float, offset: float):
        key = (scale, offset, x.shape[-1], x.dtype, x.device)
        pair = self._static_inputs.get(key)
        if pair is None:        # one (1 / scale, offset) pair of [K] tensors per layer input, made once
            width = x.shape[-1]
            pair = self._static_inputs[key] = (torch.full((width,), 1.0 / scale, dtype=x.dtype, device=x.device),
                                               torch.full((width,), offset, dtype=x.dtype, device=x.device))
        return self._npu.npu_quantize(x, pair[0], pair[1], torch.qint8, -1, False)

    def prepare_int8_weight(self, weight):
        # [in, out]: npu_quant_matmul's x2, whose dims stop at 65535: a wider matrix (a vocabulary:
        # Qwen's 151,936 rows) is kept as column slices multiplied one by one
        t = weight.t()
        if t.shape[1] <= QUANT_MATMUL_MAX_DIM:
            return t.contiguous()
        return [t[:, a:a + QUANT_MATMUL_MAX_DIM].contiguous() for a in range(0, t.shape[1], QUANT_MATMUL_MAX_DIM)]

    def int8_matmul(self, x_q, weight):
        raise NotImplementedError("the npu backend multiplies int8 through int8_scaled_matmul only")

    def int8_scaled_matmul(self, x_q, weight, scale, row_scale=None, int_bias=None, bias=None,
                           out_dtype=torch.float32):
        if isinstance(weight, list):
            outs, at = [], 0
            for part in weight:
                end = at + part.shape[1]
                outs.append(self.int8_scaled_matmul(
                    x_q, part, scale[..., at:end], row_scale, None if int_bias is None else int_bias[at:end],
                    None if bias is None else bias[at:end], out_dtype))
                at = end
            return torch.cat(outs, dim=-1)
        out = self._npu.npu_quant_matmul(
            x_q, weight, scale.reshape(-1), pertoken_scale=None if row_scale is None else row_scale.reshape(-1),
            bias=int_bias if int_bias is not None else bias, output_dtype=out_dtype)
        if int_bias is not None and bias is not None:     # one bias argument: the float one after
            out = out + bias.to(out_dtype)
        return out

    def prepare_int4_weight(self, codes, scale, group_size: int, dtype):
        k, n = codes.shape[1], codes.shape[0]
        if group_size % 32 or group_size > k - 1 or n % 8:   # the op's rules: the weight dequantized instead
            return super().prepare_int4_weight(codes, scale, group_size, dtype)
        packed = self._npu.npu_convert_weight_to_int4pack((codes - 8).t().contiguous())    # [in, out / 8]
        return packed, scale.t().contiguous().to(dtype), group_size

    def int4_linear(self, x, weight, bias):
        if isinstance(weight, torch.Tensor):
            return super().int4_linear(x, weight, bias)
        packed, scale, group_size = weight
        rows = x.reshape(-1, x.shape[-1])
        if bias is not None:
            bias = bias.float() if x.dtype == torch.bfloat16 else bias.to(x.dtype)
        out = self._npu.npu_weight_quant_batchmatmul(rows, packed, scale, bias=bias,
                                                     antiquant_group_size=group_size)
        return out.view(*x.shape[:-1], out.shape[-1])

    def rms_norm(self, x, weight, eps: float) -> torch.Tensor:
        return self._npu.npu_rms_norm(x, weight, epsilon=eps)[0]

    def _moe_ops(self) -> bool:
        """Whether this torch_npu has the MoE ops (a warning, once, when it has not)."""
        if self._moe_missing and not self._moe_told:
            self._moe_told = True
            log.warning("npu kernel backend: torch_npu %s lacks %s; Mixture-of-Experts layers run torch's ops",
                        getattr(self._npu, "__version__", "?"), self._moe_missing)
        return not self._moe_missing

    def softmax_top_k(self, logits, top_k: int, renormalize: bool):
        """npu_moe_gating_top_k_softmax on float32 logits (the reference's precision); the
        renormalisation in torch, as vllm-ascend does."""
        if not self._moe_ops():
            return super().softmax_top_k(logits, top_k, renormalize)
        weights, ids, _ = self._npu.npu_moe_gating_top_k_softmax(logits.float().contiguous(), None, k=top_k)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids.long()

    def sigmoid_grouped_top_k(self, logits, bias, top_k: int, n_group: int, topk_group: int, renormalize: bool,
                              scaling: float):
        """npu_moe_gating_top_k (sigmoid, groups scored by their top 2) on float32 logits where
        its rules allow: it always renormalises a sigmoid's top-k, and takes at most 2048
        experts in groups of more than 2 (each padded to 32, all within 2048); elsewhere the
        reference."""
        if not self._moe_ops():
            return super().sigmoid_grouped_top_k(logits, bias, top_k, n_group, topk_group, renormalize, scaling)
        experts = logits.shape[-1]
        per_group = experts // n_group
        if not renormalize or per_group <= 2 or -(-per_group // 32) * 32 * n_group > MOE_GATING_MAX_EXPERTS:
            return super().sigmoid_grouped_top_k(logits, bias, top_k, n_group, topk_group, renormalize, scaling)
        weights, ids, _ = self._npu.npu_moe_gating_top_k(
            logits.float().contiguous(), top_k, bias=None if bias is None else bias.float(), k_group=topk_group,
            group_count=n_group, group_select_mode=1, renorm=0, norm_type=1, out_flag=False,
            routed_scaling_factor=float(scaling), eps=1e-20)
        return weights, ids.long()

    def routed_experts(self, x, weights, ids, w13, w2, first_expert: int = 0):
        """This rank's experts' share through the MoE ops (vllm-ascend's all-gather path):

            local = ids - first_expert, every pair of another rank's expert -> num_local
            init_routing_v2(local, active_expert_range [0, num_local), row_idx_type 0, counts)
                expanded_x   [P = tokens * top_k, H]: this rank's n pairs sorted by expert, then
                             P - n rows the op leaves undefined
                row_idx      [P]: pair (token-major t * top_k + j) -> its row, -1 for the others
            grouped_matmul(expanded_x[:n], w13^T by expert)  -> swiglu -> grouped_matmul(w2^T)
            rows [P, H] = the n results, then zeros; the others' pairs point at row P - 1, a zero
            finalize_routing(rows, scales = weights, row-major index, drop_pad_mode 2)

        The grouped matmul's counts must sum to its rows, so n is read on the host (one
        sync a layer). The weights go to the op as transposed views ([E, K, N] with the
        strides of [E, N, K]), which it takes as they are: no copy at load or per call."""
        if not self._moe_ops():
            return super().routed_experts(x, weights, ids, w13, w2, first_expert)
        num_local, pairs = w13.shape[0], ids.numel()
        if pairs == 0:
            return torch.zeros_like(x)
        local = ids - first_expert
        local = torch.where((local >= 0) & (local < num_local), local, num_local).to(torch.int32)
        npu = self._npu
        expanded_x, row_idx, counts, _ = npu.npu_moe_init_routing_v2(
            x.contiguous(), local.contiguous(), active_num=pairs, expert_num=num_local + 1,
            expert_tokens_num_type=1, expert_tokens_num_flag=True, quant_mode=-1,
            active_expert_range=[0, num_local], row_idx_type=0)
        mine = int(counts.sum())
        if mine == 0:
            return torch.zeros_like(x)
        gate_up = npu.npu_grouped_matmul([expanded_x[:mine]], [w13.transpose(1, 2)], group_list=counts,
                                         split_item=2, group_type=0, group_list_type=1)[0]
        rows = npu.npu_grouped_matmul([npu.npu_swiglu(gate_up, dim=-1)], [w2.transpose(1, 2)], group_list=counts,
                                      split_item=2, group_type=0, group_list_type=1)[0]
        if mine < pairs:
            rows = torch.cat([rows, rows.new_zeros(pairs - mine, rows.shape[1])])
            row_idx = torch.where(row_idx < 0, pairs - 1, row_idx)
        return npu.npu_moe_finalize_routing(rows, None, None, None, weights.to(rows.dtype), row_idx, None,
                                            drop_pad_mode=2)

    def rotary(self, positions, query, key, cos, sin):
        """npu_rotary_mul in rotate-half mode on the TND query and key."""
        c, s = cos_sin(positions, cos, sin, query.dtype)
        rotary_mul = self._npu.npu_rotary_mul
        return rotary_mul(query.contiguous(), c, s), rotary_mul(key.contiguous(), c, s)


def _dequantized_blocks(k_cache, v_cache, block_tables, kv_scales: KVCacheScales, dtype: torch.dtype):
    """(float k, float v, table into them): the blocks the table names, dequantized, in dtype."""
    used, table = torch.unique(block_tables.long(), return_inverse=True)
    k = dequantize_kv(k_cache.index_select(0, used), kv_scales.k_scale, kv_scales.k_offset).to(dtype)
    v = dequantize_kv(v_cache.index_select(0, used), kv_scales.v_scale, kv_scales.v_offset).to(dtype)
    return k.contiguous(), v.contiguous(), table.to(torch.int32)
