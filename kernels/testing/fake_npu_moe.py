"""The Mixture-of-Experts ops of the torch_npu emulator (fake_torch_npu.install() adds them).
Contracts from the torch_npu op documentation (Ascend/op-plugin docs/zh/custom_APIs/torch_npu/
torch_npu-<op>.md; Atlas A2); each violation raises ContractError naming the rule, an
unmodeled option NotImplementedError. The math is float32, the result in the input's dtype.

  npu_moe_gating_top_k_softmax(x, finished=None, k=1) -> (y, expert_idx, row_idx)
      x 2-D/3-D float16/bfloat16/float32; 0 < k <= min(x.size(-1), 1024); y = top-k of
      softmax(x) in x's dtype (descending), expert_idx int32, row_idx int32 =
      arange(N * k).reshape(k, N).T (column-major pair numbers). finished: not emulated.
  npu_moe_gating_top_k(x, k, *, bias=None, k_group=1, group_count=1, group_select_mode=0, renorm=0,
                       norm_type=0, out_flag=False, routed_scaling_factor=1.0, eps=1e-20)
      -> (y, expert_idx, norm_out)
      s = softmax(x) (norm_type 0) or sigmoid(x) (1); the choice uses s + bias; the experts
      in group_count groups, each scored by its max (group_select_mode 0) or the sum of its
      top 2 (1), the best k_group kept (ties: the lower group), top-k of those (descending,
      ties: the lower expert); y = the chosen s (unbiased), / (sum + eps) for a sigmoid,
      * routed_scaling_factor, in x's dtype; expert_idx int32; norm_out = s float32 when
      out_flag. x 2-D float16/bfloat16/float32 [N, E], E <= 2048; bias [E] of x's dtype;
      group_count > 0 dividing E into groups of more than 2 experts, ceil32(E / group_count) *
      group_count <= 2048; 1 <= k_group <= group_count; 1 <= k <= E / group_count * k_group;
      renorm 0 only. Hash routing (input_ids, tid2eid): not emulated.
  npu_moe_init_routing(x, row_idx, expert_idx, active_num) -> (expanded_x, expanded_row_idx,
                                                              expanded_expert_idx)      (v1)
      pairs sorted stably by expert, keyed by row_idx (column-major: j * N + t);
      expanded_row_idx[row] = position; expanded_x[i] = x[sorted_row[i] % N], min(N,
      active_num) * K rows; x float16/bfloat16/float32, row_idx and expert_idx int32 [N, K].
  npu_moe_init_routing_v2(x, expert_idx, *, active_num, expert_num, expert_tokens_num_type,
                          expert_tokens_num_flag, quant_mode=-1, active_expert_range,
                          row_idx_type, ...) -> (expanded_x, expanded_row_idx, counts, scale)
      Unquantized dropless only (quant_mode -1, drop_pad_mode 0, no scale/offset). Pairs
      numbered token-major (t * K + j); those with an expert in active_expert_range
      [start, end) (default [0, expert_num)) are stably sorted by expert and come first:

          expert_idx [[3, 1], [0, 3]]  range [1, 4)   pairs 0:3 1:1 2:0 3:3
          sorted pairs 1 0 3 | 2 (outside)            available = 3
          row_idx_type 0 (gather): expanded_row_idx[pair] = position, -1 outside: [1, 0, -1, 2]
          row_idx_type 1 (scatter): expanded_row_idx[position] = pair (rest undefined)
          expanded_x[position] = x[pair // K]; rows past available undefined (NaN here)
          counts (int64, expert_tokens_num_flag): type 1 per expert of the range [1, 0, 2];
              type 0 their cumsum; type 2 [expert_num, 2] (id, count) of non-empty experts

      x float16/bfloat16/float32 [N, H]; expert_idx int32 [N, K], every id in [0,
      expert_num); expert_num in [0, 10240] ([0, 5120] for type 2); active_num >= 0 (0:
      all rows, else min(active_num, N * K) rows of expanded_x).
  npu_grouped_matmul(x, weight, *, group_list, split_item, group_type, group_list_type, ...)
      -> [y]. Modeled: unquantized, one x [M, K] (contiguous), one weight [E, K, N]
      (contiguous, or "transposed": the last two dims' strides swapped, i.e. a
      [E, N, K] tensor's .transpose(1, 2)), one y [M, N]: split_item 2 or 3, group_type 0
      (groups along M), group_list int64 [E], <= 1024 groups: type 0 cumulative
      (non-decreasing, last == M), type 1 counts (>= 0, sum == M). x and weight of one
      dtype (float16/bfloat16/float32); output_dtype None or that dtype; last dims < 65536.
      y[rows of group e] = x[rows] @ weight[e].
  npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales,
                           expanded_src_to_dst_row, expert_for_source_row, drop_pad_mode=0, k=1)
      out[i] = skip1[i] + skip2[i] + sum_k scales[i, k] * (rows[src[idx(i, k)]] + bias[e_ik])
      with idx(i, k) = k * N + i (drop_pad_mode 0, column-major) or i * K + k (2, row-major);
      dropless only: rows [N * K, H], src int32 [N * K] in [0, N * K - 1]; skip1/skip2 None or
      [N, H] (skip2 only with skip1), bias None or [E, H], scales None (then K = k) or
      [N, K], all of rows' dtype; expert_for_source_row int32 [N, K] in [0, E) (needed with bias).
  npu_swiglu(input, dim=-1) -> silu(A) * B, A/B the first/second half along dim; 1-8 dims,
      that dim even, contiguous, non-empty, float16/bfloat16/float32.

Relaxation, as for attention: none needed; float32 is documented for every op here.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.testing.fake_torch_npu import _require

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
MAX_EXPERT_NUM = 10240
MAX_GATING_EXPERTS = 2048
MAX_GROUPS = 1024
INNER_LIMIT = 65536


def _float(op: str, name: str, t: torch.Tensor) -> None:
    _require(t.dtype in _FLOATS, op, f"{name} dtype must be float16, bfloat16 or float32, got {t.dtype}")


def _int32(op: str, name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    _require(t.dtype == torch.int32, op, f"{name} dtype must be int32, got {t.dtype}")
    _require(tuple(t.shape) == shape, op, f"{name} must be {list(shape)}, got {list(t.shape)}")


def npu_moe_gating_top_k_softmax(x, finished=None, k=1):
    op = "npu_moe_gating_top_k_softmax"
    if finished is not None:
        raise NotImplementedError(f"{op}: the emulator does not model finished")
    _require(x.dim() in (2, 3), op, f"x must be 2-D or 3-D, got {x.dim()}-D")
    _float(op, "x", x)
    _require(isinstance(k, int) and 0 < k <= x.shape[-1] and k <= 1024, op,
             f"k must be an int in (0, min(x.size(-1) = {x.shape[-1]}, 1024)], got {k!r}")
    rows = x.reshape(-1, x.shape[-1])
    y, idx = torch.softmax(rows.float(), dim=-1).topk(k, dim=-1)
    n = rows.shape[0]
    row_idx = torch.arange(n * k, dtype=torch.int32, device=x.device).view(k, n).t().contiguous()
    shape = (*x.shape[:-1], k)
    return y.to(x.dtype).view(shape), idx.to(torch.int32).view(shape), row_idx.view(shape)


def npu_moe_gating_top_k(x, k, *, bias=None, input_ids=None, tid2eid=None, k_group=1, group_count=1,
                         group_select_mode=0, renorm=0, norm_type=0, out_flag=False, routed_scaling_factor=1.0,
                         eps=1e-20):
    op = "npu_moe_gating_top_k"
    if input_ids is not None or tid2eid is not None:
        raise NotImplementedError(f"{op}: the emulator does not model hash routing (input_ids, tid2eid)")
    _require(x.dim() == 2, op, f"x must be 2-D [N, E], got {x.dim()}-D")
    _float(op, "x", x)
    experts = x.shape[1]
    _require(experts <= MAX_GATING_EXPERTS, op, f"x's last dim (experts) must be <= {MAX_GATING_EXPERTS}, got {experts}")
    _require(isinstance(group_count, int) and group_count > 0 and experts % group_count == 0
             and experts // group_count > 2, op,
             f"group_count must divide the {experts} experts into groups of more than 2, got {group_count!r}")
    per_group = experts // group_count
    _require(-(-per_group // 32) * 32 * group_count <= MAX_GATING_EXPERTS, op,
             f"each group padded to 32 experts times group_count must be <= {MAX_GATING_EXPERTS}, got "
             f"{-(-per_group // 32) * 32} * {group_count}")
    _require(isinstance(k_group, int) and 1 <= k_group <= group_count, op,
             f"k_group must be in [1, group_count = {group_count}], got {k_group!r}")
    _require(isinstance(k, int) and 1 <= k <= per_group * k_group, op,
             f"k must be in [1, E / group_count * k_group = {per_group * k_group}], got {k!r}")
    _require(group_select_mode in (0, 1), op, f"group_select_mode must be 0 (max) or 1 (top-2 sum), got "
                                              f"{group_select_mode!r}")
    _require(renorm == 0, op, f"renorm must be 0 (norm before top-k), got {renorm!r}")
    _require(norm_type in (0, 1), op, f"norm_type must be 0 (softmax) or 1 (sigmoid), got {norm_type!r}")
    if bias is not None:
        _require(bias.dtype == x.dtype and tuple(bias.shape) == (experts,), op,
                 f"bias must be [{experts}] of x's dtype ({x.dtype}), got {list(bias.shape)} {bias.dtype}")
    norm = torch.softmax(x.float(), dim=-1) if norm_type == 0 else x.float().sigmoid()
    choice = norm if bias is None else norm + bias.float()
    grouped = choice.view(x.shape[0], group_count, per_group)
    scores = grouped.amax(-1) if group_select_mode == 0 else grouped.topk(2, dim=-1).values.sum(-1)
    best = scores.argsort(dim=-1, descending=True, stable=True)[:, :k_group]
    keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, best, True)
    choice = choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
    ids = choice.argsort(dim=-1, descending=True, stable=True)[:, :k]
    y = norm.gather(1, ids)
    if norm_type == 1:
        y = y / (y.sum(dim=-1, keepdim=True) + eps)
    y = y * routed_scaling_factor
    norm_out = norm if out_flag else torch.empty(0, device=x.device)
    return y.to(x.dtype), ids.to(torch.int32), norm_out


def _routing_inputs(op: str, x, expert_idx) -> tuple[int, int]:
    """(NUM_ROWS, K) of an init_routing op's x [NUM_ROWS, H] float and expert_idx int32 [NUM_ROWS, K]."""
    _require(x.dim() == 2, op, f"x must be 2-D [NUM_ROWS, H], got {x.dim()}-D")
    _float(op, "x", x)
    n = x.shape[0]
    _require(expert_idx.dim() == 2 and expert_idx.shape[0] == n, op,
             f"expert_idx must be [NUM_ROWS = {n}, K], got {list(expert_idx.shape)}")
    k = expert_idx.shape[1]
    _int32(op, "expert_idx", expert_idx, (n, k))
    return n, k


def npu_moe_init_routing(x, row_idx, expert_idx, active_num):
    op = "npu_moe_init_routing"
    n, k = _routing_inputs(op, x, expert_idx)
    _int32(op, "row_idx", row_idx, (n, k))
    _require(isinstance(active_num, int) and active_num >= 0, op, f"active_num must be an int >= 0, got {active_num!r}")
    _require(x.numel() < 2 ** 24, op, f"x must hold fewer than 2^24 elements, got {x.numel()}")
    flat_rows = row_idx.reshape(-1).long()
    _require(torch.equal(flat_rows.sort().values, torch.arange(n * k, device=x.device)), op,
             f"row_idx must number the NUM_ROWS * K = {n * k} pairs, each of 0..{n * k - 1} once")
    order = expert_idx.reshape(-1).long().argsort(stable=True)
    sorted_rows = flat_rows[order]
    expanded_row_idx = torch.empty(n * k, dtype=torch.int32, device=x.device)
    expanded_row_idx[sorted_rows] = torch.arange(n * k, dtype=torch.int32, device=x.device)
    rows = min(n, active_num) * k
    return x[sorted_rows[:rows] % n], expanded_row_idx, expert_idx.reshape(-1)[order]


def _expert_range(op: str, active_expert_range, expert_num: int) -> tuple[int, int]:
    if not active_expert_range:
        return 0, expert_num
    _require(len(active_expert_range) == 2 and all(isinstance(v, int) for v in active_expert_range), op,
             f"active_expert_range must be [expert_start, expert_end], got {active_expert_range!r}")
    start, end = active_expert_range
    _require(0 <= start < end <= expert_num, op,
             f"active_expert_range must satisfy 0 <= expert_start < expert_end <= expert_num ({expert_num}), "
             f"got {list(active_expert_range)}")
    return start, end


def _token_counts(per_expert: torch.Tensor, start: int, kind: int, expert_num: int) -> torch.Tensor:
    if kind == 1:
        return per_expert
    if kind == 0:
        return per_expert.cumsum(0)
    pairs = torch.zeros(expert_num, 2, dtype=torch.int64, device=per_expert.device)
    busy = per_expert.nonzero().squeeze(1)
    pairs[:busy.numel(), 0] = busy + start
    pairs[:busy.numel(), 1] = per_expert[busy]
    return pairs


def npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1, expert_capacity=-1,
                            expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0, expert_tokens_num_flag=False,
                            quant_mode=-1, active_expert_range=(), row_idx_type=0):
    op = "npu_moe_init_routing_v2"
    if quant_mode != -1 or scale is not None or offset is not None:
        raise NotImplementedError(f"{op}: the emulator models the unquantized op only (quant_mode=-1, no scale, "
                                  f"no offset)")
    if drop_pad_mode != 0:
        raise NotImplementedError(f"{op}: the emulator models dropless routing only (drop_pad_mode=0)")
    n, k = _routing_inputs(op, x, expert_idx)
    _require(expert_tokens_num_type in (0, 1, 2), op,
             f"expert_tokens_num_type must be 0 (cumsum), 1 (count) or 2 (key_value), got {expert_tokens_num_type!r}")
    limit = MAX_EXPERT_NUM // 2 if expert_tokens_num_type == 2 else MAX_EXPERT_NUM
    _require(isinstance(expert_num, int) and 0 <= expert_num <= limit, op,
             f"expert_num must be in [0, {limit}], got {expert_num!r}")
    _require(isinstance(active_num, int) and active_num >= 0, op,
             f"active_num must be an int >= 0 (0: dropless), got {active_num!r}")
    _require(row_idx_type in (0, 1), op, f"row_idx_type must be 0 (gather) or 1 (scatter), got {row_idx_type!r}")
    start, end = _expert_range(op, active_expert_range, expert_num)
    ids = expert_idx.reshape(-1).long()
    _require(bool(((ids >= 0) & (ids < expert_num)).all()), op,
             f"every expert id must lie in [0, expert_num = {expert_num})")

    active = (ids >= start) & (ids < end)
    available = int(active.sum())
    order = torch.where(active, ids, expert_num).argsort(stable=True)         # in-range pairs first
    positions = torch.arange(n * k, dtype=torch.int32, device=x.device)
    if row_idx_type == 0:
        expanded_row_idx = torch.full((n * k,), -1, dtype=torch.int32, device=x.device)
        expanded_row_idx[order[:available]] = positions[:available]
    else:
        expanded_row_idx = torch.full((n * k,), torch.iinfo(torch.int32).min, dtype=torch.int32, device=x.device)
        expanded_row_idx[:available] = order[:available].to(torch.int32)
    rows = n * k if active_num == 0 else min(active_num, n * k)
    expanded_x = torch.full((rows, x.shape[1]), float("nan"), dtype=x.dtype, device=x.device)
    valid = min(rows, available)
    expanded_x[:valid] = x[order[:valid] // k]
    counts = torch.empty(0, dtype=torch.int64, device=x.device)
    if expert_tokens_num_flag:
        per_expert = torch.bincount(ids[active] - start, minlength=end - start)
        counts = _token_counts(per_expert, start, expert_tokens_num_type, expert_num)
    expanded_scale = torch.full((n * k,), float("nan"), dtype=torch.float32, device=x.device)   # no scale given
    return expanded_x, expanded_row_idx, counts, expanded_scale


def _group_sizes(op: str, group_list, group_list_type: int, num_groups: int, m: int) -> list[int]:
    _require(isinstance(group_list, torch.Tensor), op, "group_list must be a Tensor (List[int] is not emulated)")
    _require(group_list.dtype == torch.int64 and group_list.dim() == 1, op,
             f"group_list must be 1-D int64, got {group_list.dim()}-D {group_list.dtype}")
    _require(group_list.shape[0] == num_groups, op,
             f"group_list must hold one entry per group of weight (E = {num_groups}), got {group_list.shape[0]}")
    _require(num_groups <= MAX_GROUPS, op, f"at most {MAX_GROUPS} groups, got {num_groups}")
    values = group_list.tolist()
    if group_list_type == 0:
        _require(all(v >= 0 for v in values) and all(b >= a for a, b in zip(values, values[1:])), op,
                 f"group_list_type 0: group_list must be non-negative and non-decreasing, got {values}")
        _require(values[-1] == m, op, f"group_list_type 0: the last value must equal x's first dim ({m}), "
                                      f"got {values[-1]}")
        return [b - a for a, b in zip([0] + values, values)]
    _require(all(v >= 0 for v in values), op, f"group_list_type 1: group sizes must be non-negative, got {values}")
    _require(sum(values) == m, op, f"group_list_type 1: the sizes must sum to x's first dim ({m}), got {sum(values)}")
    return values


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                       antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None,
                       activation_quant_scale=None, activation_quant_offset=None, split_item=0, group_type=-1,
                       group_list_type=0, act_type=0, output_dtype=None, tuning_config=None, x_dtype=None,
                       weight_dtype=None, scale_dtype=None, per_token_scale_dtype=None):
    op = "npu_grouped_matmul"
    unmodeled = {"bias": bias, "scale": scale, "offset": offset, "antiquant_scale": antiquant_scale,
                 "antiquant_offset": antiquant_offset, "per_token_scale": per_token_scale,
                 "activation_input": activation_input, "activation_quant_scale": activation_quant_scale,
                 "activation_quant_offset": activation_quant_offset, "tuning_config": tuning_config,
                 "x_dtype": x_dtype, "weight_dtype": weight_dtype, "scale_dtype": scale_dtype,
                 "per_token_scale_dtype": per_token_scale_dtype}
    given = sorted(name for name, value in unmodeled.items() if value is not None)
    if given or act_type != 0:
        raise NotImplementedError(f"{op}: the emulator models the unquantized op without bias or activation; "
                                  f"got {given + (['act_type'] if act_type else [])}")
    _require(isinstance(x, (list, tuple)) and isinstance(weight, (list, tuple)), op,
             "x and weight must be lists of tensors")
    if len(x) != 1 or len(weight) != 1 or group_type != 0:
        raise NotImplementedError(f"{op}: the emulator models one x, one weight, group_type=0 only")
    _require(split_item in (2, 3), op, f"a single x, weight and y need split_item 2 or 3, got {split_item!r}")
    _require(group_list_type in (0, 1), op,
             f"group_list_type must be 0 (cumsum) or 1 (counts) (2 is for int8 only), got {group_list_type!r}")
    a, w = x[0], weight[0]
    _require(a.dim() == 2, op, f"x must be 2-D [M, K], got {a.dim()}-D")
    _require(w.dim() == 3, op, f"weight must be 3-D [E, K, N] with one x, got {w.dim()}-D")
    _float(op, "x", a)
    _require(w.dtype == a.dtype, op, f"weight dtype must equal x dtype ({a.dtype}), got {w.dtype}")
    _require(output_dtype in (None, a.dtype), op, f"output_dtype must be None or x's dtype ({a.dtype}), "
                                                  f"got {output_dtype}")
    _require(a.is_contiguous(), op, "x must be contiguous (a transposed x is not supported)")
    transposed = not w.is_contiguous()
    _require(not transposed or w.transpose(1, 2).is_contiguous(), op,
             "weight must be contiguous or transposed in its last two dims (a [E, N, K] tensor's .transpose(1, 2))")
    m, k = a.shape
    num_groups, wk, n = w.shape
    _require(wk == k, op, f"weight [E, K, N] must share K ({k}) with x, got {list(w.shape)}")
    inner = k if transposed else n
    _require(k < INNER_LIMIT and inner < INNER_LIMIT, op,
             f"the last dims of x and weight must be < {INNER_LIMIT}, got {k} and {inner}")
    sizes = _group_sizes(op, group_list, group_list_type, num_groups, m)
    y = torch.empty(m, n, dtype=a.dtype, device=a.device)
    start = 0
    for e, size in enumerate(sizes):
        y[start:start + size] = (a[start:start + size].float() @ w[e].float()).to(a.dtype)
        start += size
    return [y]


def npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                             expert_for_source_row, drop_pad_mode=0, k=1):
    op = "npu_moe_finalize_routing"
    if drop_pad_mode in (1, 3):
        raise NotImplementedError(f"{op}: the emulator models dropless routing only (drop_pad_mode 0 or 2)")
    _require(drop_pad_mode in (0, 2), op, f"drop_pad_mode must be in [0, 3], got {drop_pad_mode!r}")
    rows = expanded_permuted_rows
    _require(rows.dim() == 2, op, f"expanded_permuted_rows must be 2-D [NUM_ROWS * K, H], got {rows.dim()}-D")
    _float(op, "expanded_permuted_rows", rows)
    src = expanded_src_to_dst_row
    _require(src.dtype == torch.int32 and src.dim() == 1, op,
             f"expanded_src_to_dst_row must be 1-D int32, got {src.dim()}-D {src.dtype}")
    nk, h = src.shape[0], rows.shape[1]
    _require(rows.shape[0] == nk, op, f"expanded_permuted_rows must have NUM_ROWS * K = {nk} rows, got {rows.shape[0]}")
    if scales is None:
        _require(isinstance(k, int) and k >= 1, op, f"without scales, k must be given (an int >= 1), got {k!r}")
        top_k = k
    else:
        _require(scales.dim() == 2, op, f"scales must be 2-D [NUM_ROWS, K], got {scales.dim()}-D")
        top_k = scales.shape[1]
    _require(nk % top_k == 0, op, f"expanded_src_to_dst_row's length ({nk}) must be NUM_ROWS * K (K = {top_k})")
    n = nk // top_k
    for name, t, shape in (("skip1", skip1, (n, h)), ("skip2", skip2, (n, h)), ("scales", scales, (n, top_k))):
        if t is not None:
            _require(t.dtype == rows.dtype, op, f"{name} dtype must equal expanded_permuted_rows' ({rows.dtype}), "
                                                f"got {t.dtype}")
            _require(tuple(t.shape) == shape, op, f"{name} must be {list(shape)}, got {list(t.shape)}")
    _require(skip2 is None or skip1 is not None, op, "skip2 needs skip1 (skip1 None requires skip2 None)")
    _require(bool(((src >= 0) & (src < nk)).all()), op,
             f"expanded_src_to_dst_row values must lie in [0, NUM_ROWS * K - 1 = {nk - 1}] when dropless")
    if bias is not None:
        _require(bias.dtype == rows.dtype and bias.dim() == 2 and bias.shape[1] == h, op,
                 f"bias must be [E, H = {h}] of expanded_permuted_rows' dtype, got {list(bias.shape)} {bias.dtype}")
        _require(expert_for_source_row is not None, op, "bias needs expert_for_source_row")
    if expert_for_source_row is not None:
        _int32(op, "expert_for_source_row", expert_for_source_row, (n, top_k))
        if bias is not None:
            _require(bool(((expert_for_source_row >= 0) & (expert_for_source_row < bias.shape[0])).all()), op,
                     f"expert_for_source_row values must lie in [0, E = {bias.shape[0]})")
    index = src.long().view(top_k, n).t() if drop_pad_mode == 0 else src.long().view(n, top_k)   # [N, K]
    picked = rows.float()[index]                                                                 # [N, K, H]
    if bias is not None:
        picked = picked + bias.float()[expert_for_source_row.long()]
    weights = torch.ones(n, top_k, device=rows.device) if scales is None else scales.float()
    out = (picked * weights.unsqueeze(-1)).sum(1)
    for skip in (skip1, skip2):
        if skip is not None:
            out = out + skip.float()
    return out.to(rows.dtype)


def npu_swiglu(input, dim=-1):  # noqa: A002 (torch_npu name)
    op = "npu_swiglu"
    _require(1 <= input.dim() <= 8 and input.numel() > 0, op,
             f"input must be 1-8-D and non-empty, got {input.dim()}-D of {input.numel()} elements")
    _float(op, "input", input)
    _require(isinstance(dim, int) and -input.dim() <= dim < input.dim(), op,
             f"dim must be in [{-input.dim()}, {input.dim() - 1}], got {dim!r}")
    _require(input.shape[dim] % 2 == 0, op, f"input's size along dim {dim} must be even, got {input.shape[dim]}")
    _require(input.is_contiguous(), op, "input must be contiguous")
    a, b = input.float().chunk(2, dim=dim)
    return (F.silu(a) * b).to(input.dtype)


OPS = {"npu_moe_gating_top_k_softmax": npu_moe_gating_top_k_softmax, "npu_moe_gating_top_k": npu_moe_gating_top_k,
       "npu_moe_init_routing": npu_moe_init_routing, "npu_moe_init_routing_v2": npu_moe_init_routing_v2,
       "npu_grouped_matmul": npu_grouped_matmul, "npu_moe_finalize_routing": npu_moe_finalize_routing,
       "npu_swiglu": npu_swiglu}
