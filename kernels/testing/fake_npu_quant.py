"""The quantized-linear ops of the torch_npu emulator (fake_torch_npu.install() adds them).
Contracts from the torch_npu op documentation (Ascend/op-plugin docs/context, CANN's
aclnn pages; Atlas A2); each violation raises ContractError naming the rule. The math is
float32, rounding half to even (the kernels' CAST_RINT).

  npu_dynamic_quant(input, *, smooth_scales=None, ...) -> (int8 like input, float32 [rows])
      input float16/bfloat16, >= 2-D; inv = 127 / rowmax|x * smooth|, y = rint(x * inv),
      scale = 1 / inv. An all-zero row has no defined result (refused here).
  npu_quantize(input, scales, zero_points, dtype, axis=1, div_mode=True) -> int8
      div_mode False: y = rint(x * scales + zero_points), dtype torch.qint8, scales and
      zero_points of x's dtype, shape [x.size(-1)] or [1]; div_mode True:
      y = rint(x / scales + zero_points), scales 1-D of len x.size(axis). Saturates to int8.
  npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None,
                   output_dtype=None) -> [M, N]
      x1 int8 [M, K], x2 int8 [K, N], last dims <= 65535; scale [1] or [N] float32 /
      bfloat16 / int64; pertoken_scale float32 [M]; bias [N] int32 (added to the int32
      accumulator before scaling) or float16 / bfloat16 / float32 (added after);
      output_dtype float16 or bfloat16 (None = int8: not emulated); an fp32 scale with an
      fp16 output and no pertoken_scale keeps only its top 19 bits (the op packs it as
      npu_trans_quant_param does).
  npu_convert_weight_to_int4pack(weight) -> int32 [K, N / 8]
      weight int32 [K, N] of values in [-8, 7], N % 8 == 0 (nibble j of word j // 8; the
      real op's order is its own: only its own output feeds the matmul below).
  npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset=None, ...,
                               bias=None, antiquant_group_size=0) -> like x
      x float16/bfloat16 [M, K]; weight int8 [K, N] or int4-packed int32 [K, N / 8];
      antiquant_scale of x's dtype: [N] / [1, N] per channel or [ceil(K / G), N] per group,
      G a multiple of 32 in [32, K - 1]; K, N <= 65535; y = x @ ((w + offset) * scale) + bias.

Relaxation, as for attention: float32 activations and outputs on emulated CPU tensors.
"""
from __future__ import annotations

import torch

from kernels.testing.fake_torch_npu import _HALF, _require

MAX_DIM = 65535


def _half(op: str, name: str, t: torch.Tensor) -> None:
    ok = t.dtype in _HALF or (t.dtype == torch.float32 and t.device.type == "cpu")
    _require(ok, op, f"{name} dtype must be float16 or bfloat16 (float32 only on emulated CPU tensors), "
                     f"got {t.dtype}")


def _saturate(y: torch.Tensor) -> torch.Tensor:
    return torch.round(y).clamp_(-128, 127).to(torch.int8)


def npu_dynamic_quant(input, *, smooth_scales=None, group_index=None, dst_type=None,  # noqa: A002
                      quant_mode="pertoken", dst_type_max=0.0):
    op = "npu_dynamic_quant"
    _half(op, "input", input)
    _require(input.dim() >= 2, op, f"input must be at least 2-D, got {input.dim()}-D")
    _require(group_index is None, op, "group_index (MoE groups) is not emulated")
    _require(dst_type in (None, torch.int8), op, f"dst_type {dst_type} is not emulated; int8 only")
    _require(quant_mode == "pertoken", op, f"quant_mode must be 'pertoken', got {quant_mode!r}")
    x = input.float()
    if smooth_scales is not None:
        _require(smooth_scales.dtype == input.dtype and tuple(smooth_scales.shape) == (input.shape[-1],), op,
                 f"smooth_scales must be {input.dtype} [{input.shape[-1]}]")
        x = x * smooth_scales.float()
    rowmax = x.abs().amax(dim=-1)
    _require(bool((rowmax > 0).all()), op, "a row of all zeros has no defined scale")
    inv = 127.0 / rowmax
    return _saturate(x * inv.unsqueeze(-1)), (1.0 / inv)


def npu_quantize(input, scales, zero_points, dtype, axis=1, div_mode=True):  # noqa: A002
    op = "npu_quantize"
    _require(dtype in (torch.qint8,), op, f"dtype {dtype} is not emulated; torch.qint8 only")
    if not div_mode:
        _half(op, "input", input)
        _require(scales.dtype == input.dtype, op, f"scales must be {input.dtype} (the input's dtype), "
                                                  f"got {scales.dtype}")
        _require(zero_points is None or zero_points.dtype == scales.dtype, op,
                 "zero_points must have the scales' dtype")
        width = input.shape[-1]
        for name, t in (("scales", scales), ("zero_points", zero_points)):
            _require(t is None or tuple(t.shape) in ((width,), (1,)), op,
                     f"{name} must be [{width}] or [1] (axis -1), got {None if t is None else tuple(t.shape)}")
        y = input.float() * scales.float() + (0.0 if zero_points is None else zero_points.float())
        return _saturate(y)
    width = input.shape[axis]
    _require(scales.dim() == 1 and scales.shape[0] == width, op,
             f"div_mode: scales must be 1-D of len input.size({axis}) = {width}, got {tuple(scales.shape)}")
    shape = [1] * input.dim()
    shape[axis] = width
    y = input.float() / scales.float().view(shape)
    if zero_points is not None:
        y = y + zero_points.float().view(shape)
    return _saturate(y)


def _top19_bits(scale: torch.Tensor) -> torch.Tensor:
    bits = scale.float().contiguous().view(torch.int32) & torch.tensor(-8192, dtype=torch.int32)   # 0xFFFFE000
    return bits.view(torch.float32)


def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None,
                     x1_dtype=None, x2_dtype=None, pertoken_scale_dtype=None, scale_dtype=None,
                     group_sizes=None, y_scale=None):
    op = "npu_quant_matmul"
    _require(x1.dtype == torch.int8 and x2.dtype == torch.int8, op,
             f"x1 and x2 must be int8 (int32: packed int4, not emulated), got {x1.dtype}, {x2.dtype}")
    _require(x1.dim() == 2 and x2.dim() == 2 and x1.shape[1] == x2.shape[0], op,
             f"x1 [M, K] and x2 [K, N] must share K, got {tuple(x1.shape)} and {tuple(x2.shape)}")
    m, n = x1.shape[0], x2.shape[1]
    _require(x1.shape[-1] <= MAX_DIM and x2.shape[-1] <= MAX_DIM, op,
             f"the last dims of x1 and x2 must be <= {MAX_DIM}, got {x1.shape[-1]} and {x2.shape[-1]}")
    _require(output_dtype is not None, op, "output_dtype None means int8 output, which is not emulated")
    on_cpu = x1.device.type == "cpu"
    _require(output_dtype in _HALF or (output_dtype == torch.float32 and on_cpu), op,
             f"output_dtype must be float16 or bfloat16 (float32 only on emulated CPU tensors), got {output_dtype}")
    _require(scale.dim() == 1 and scale.shape[0] in (1, n), op, f"scale must be [1] or [N = {n}], "
                                                                 f"got {tuple(scale.shape)}")
    _require(scale.dtype in (torch.float32, torch.bfloat16, torch.int64), op,
             f"scale dtype must be float32, bfloat16 or int64, got {scale.dtype}")
    _require(scale.dtype != torch.int64, op, "an int64 (npu_trans_quant_param) scale is not emulated")
    _require(offset is None, op, "offset applies to int8 output only")
    if pertoken_scale is not None:
        _require(pertoken_scale.dtype == torch.float32 and tuple(pertoken_scale.shape) == (m,), op,
                 f"pertoken_scale must be float32 [M = {m}], got {pertoken_scale.dtype} {tuple(pertoken_scale.shape)}")
    if output_dtype == torch.float16:
        _require(scale.dtype == torch.float32, op, "a float16 output takes a float32 (or int64) scale")
    if bias is not None:
        _require(bias.dim() == 1 and bias.shape[0] == n, op, f"bias must be [N = {n}], got {tuple(bias.shape)}")
        _require(bias.dtype in (torch.int32, torch.bfloat16, torch.float16, torch.float32), op,
                 f"bias dtype must be int32, bfloat16, float16 or float32, got {bias.dtype}")
    acc = x1.to(torch.int64) @ x2.to(torch.int64)         # exact int32 accumulation (K * 128^2 < 2^31)
    if bias is not None and bias.dtype == torch.int32:
        acc = acc + bias
    s = scale.float()
    if scale.dtype == torch.float32 and output_dtype == torch.float16 and pertoken_scale is None:
        s = _top19_bits(scale)
    out = acc.float() * s
    if pertoken_scale is not None:
        out = out * pertoken_scale.unsqueeze(-1)
    if bias is not None and bias.dtype != torch.int32:
        out = out + bias.float()
    return out.to(output_dtype)


def npu_convert_weight_to_int4pack(weight, inner_k_tiles=0):
    op = "npu_convert_weight_to_int4pack"
    _require(weight.dtype == torch.int32 and weight.dim() == 2, op, f"weight must be int32 [K, N], got "
                                                                    f"{weight.dtype} {weight.dim()}-D")
    _require(weight.shape[1] % 8 == 0, op, f"N must be a multiple of 8, got {weight.shape[1]}")
    _require(bool(((weight >= -8) & (weight <= 7)).all()), op, "values must be int4: in [-8, 7]")
    nibbles = (weight.to(torch.int64) & 0xF).reshape(weight.shape[0], -1, 8)
    words = (nibbles << torch.arange(0, 32, 4, dtype=torch.int64)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    nibbles = (packed.to(torch.int64).unsqueeze(-1) >> torch.arange(0, 32, 4)) & 0xF
    return torch.where(nibbles >= 8, nibbles - 16, nibbles).reshape(packed.shape[0], -1)


def npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset=None, quant_scale=None,
                                 quant_offset=None, bias=None, antiquant_group_size=0, inner_precise=0,
                                 weight_dtype=None):
    op = "npu_weight_quant_batchmatmul"
    _half(op, "x", x)
    _require(x.dim() == 2, op, f"x must be [M, K], got {x.dim()}-D")
    _require(quant_scale is None and quant_offset is None, op, "quant_scale (int8 output) is not emulated")
    _require(weight.dtype in (torch.int8, torch.int32), op, f"weight must be int8 or int4-packed int32, "
                                                            f"got {weight.dtype}")
    w = weight.to(torch.int64) if weight.dtype == torch.int8 else _unpack_int4(weight)
    k, n = w.shape
    _require(x.shape[1] == k, op, f"x [M, K] and weight [K, N] must share K, got {x.shape[1]} and {k}")
    _require(k <= MAX_DIM and n <= MAX_DIM, op, f"K and N must be <= {MAX_DIM}, got {k} and {n}")
    _require(antiquant_scale.dtype == x.dtype, op, f"antiquant_scale must have x's dtype {x.dtype}, "
                                                   f"got {antiquant_scale.dtype}")
    g = antiquant_group_size
    if g:
        _require(g % 32 == 0 and 32 <= g <= k - 1, op, f"antiquant_group_size must be a multiple of 32 in "
                                                         f"[32, K - 1 = {k - 1}], got {g}")
        groups = -(-k // g)
        _require(tuple(antiquant_scale.shape) == (groups, n), op,
                 f"a per-group antiquant_scale must be [ceil(K / G) = {groups}, N = {n}], "
                 f"got {tuple(antiquant_scale.shape)}")
        scale = antiquant_scale.float().repeat_interleave(g, dim=0)[:k]
    else:
        _require(tuple(antiquant_scale.shape) in ((n,), (1, n), (1,)), op,
                 f"antiquant_scale must be [N], [1, N] or [1] without a group size, got {tuple(antiquant_scale.shape)}")
        scale = antiquant_scale.float().reshape(-1, n) if antiquant_scale.numel() == n else antiquant_scale.float()
    wf = w.float()
    if antiquant_offset is not None:
        _require(antiquant_offset.shape == antiquant_scale.shape, op, "antiquant_offset must be shaped "
                                                                      "like antiquant_scale")
        off = antiquant_offset.float()
        wf = wf + (off.repeat_interleave(g, dim=0)[:k] if g else off.reshape(-1, n))
    y = x.float() @ (wf * scale)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


OPS = {"npu_dynamic_quant": npu_dynamic_quant, "npu_quantize": npu_quantize, "npu_quant_matmul": npu_quant_matmul,
       "npu_convert_weight_to_int4pack": npu_convert_weight_to_int4pack,
       "npu_weight_quant_batchmatmul": npu_weight_quant_batchmatmul}
