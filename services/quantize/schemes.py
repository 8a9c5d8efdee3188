"""Round-to-nearest quantization of one weight [out, in] (float64 math), in each
producer's convention:

    int8 per channel, symmetric:  s = max_k |w[n, k]| / divisor; q = clamp(round(w / s), -128, 127)
                                  divisor 127 (msModelSlim), 127.5 (compressed-tensors)
    int4 per group, symmetric:    s = max over the group |w| / 7.5 (compressed-tensors' range),
                                  shrunk to the clip ratio with the least squared error;
                                  q = clamp(round(w / s), -8, 7)
    static activations (msModelSlim W8A8): [min, max] (widened to hold 0) onto -128..127:
                                  s_x = (max - min) / 255, offset = round(-128 - min / s_x)
"""
from __future__ import annotations

import torch

TINY = 1e-12
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)    # int4 group scales tried (of max |w| / 7.5)


def stored(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The scale as the file will hold it (in dtype), back in float64: codes are rounded
    against the scale a reader multiplies by, not a more precise one."""
    return scale.to(dtype).double()


def int8_per_channel(weight: torch.Tensor, divisor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes [out, in], float64 scale [out, 1], exact in weight's dtype)."""
    w = weight.double()
    scale = stored((w.abs().amax(dim=1, keepdim=True) / divisor).clamp_min(TINY), weight.dtype)
    return torch.round(w / scale).clamp(-128, 127).to(torch.int8), scale


def int4_scale(groups: torch.Tensor, dtype: torch.dtype, clip: bool = True) -> torch.Tensor:
    """The scale of each group of weights [..., group] (float64 [...], exact in dtype):
    max |w| / 7.5, or with `clip` the one of CLIP_RATIOS * that whose codes reproduce the
    group with the least squared error (a few large weights otherwise stretch the grid of
    all the others; 16 levels leave little to waste)."""
    full = (groups.abs().amax(dim=-1) / 7.5).clamp_min(TINY)
    if not clip:
        return stored(full, dtype)
    best, best_err = None, None
    for ratio in CLIP_RATIOS:
        s = stored((full * ratio).clamp_min(TINY), dtype)
        err = (groups - torch.round(groups / s.unsqueeze(-1)).clamp(-8, 7) * s.unsqueeze(-1)).square().sum(-1)
        if best is None:
            best, best_err = s, err
        else:
            better = err < best_err
            best, best_err = torch.where(better, s, best), torch.where(better, err, best_err)
    return best


def int4_per_group(weight: torch.Tensor, group_size: int, clip: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes -8..7 [out, in], float64 scale [out, in / group_size], exact in weight's dtype)."""
    w = weight.double()
    groups = w.reshape(w.shape[0], -1, group_size)
    scale = int4_scale(groups, weight.dtype, clip)
    codes = torch.round(groups / scale.unsqueeze(-1)).clamp(-8, 7).reshape(w.shape)
    return codes.to(torch.int8), scale


def static_activation(lo: float, hi: float) -> tuple[float, float]:
    """(input_scale, input_offset) of a tensor seen in [lo, hi]."""
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    scale = max((hi - lo) / 255.0, TINY)
    return scale, float(max(-128.0, min(127.0, round(-128.0 - lo / scale))))


def int8_weight_as_float(w: torch.Tensor) -> torch.Tensor:
    """w [out, in] rounded to int8 per output channel (divisor 127) and back: what the
    quantized layer multiplies by, for measuring its error."""
    scale = (w.abs().amax(1, keepdim=True) / 127).clamp_min(TINY)
    return torch.round(w / scale).clamp(-128, 127) * scale


def static_input_as_float(x: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """x rounded to static int8 over [lo, hi] (static_activation's scale and offset) and back."""
    s_x, off = static_activation(lo, hi)
    return (torch.round(x / s_x + off).clamp(-128, 127) - off) * s_x


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes -8..7 [rows, cols] -> int32 [rows, cols / 8]: code j at bits 4 * (j % 8)
    of word j // 8, stored as q + 8 (compressed-tensors' pack-quantized)."""
    stored = (codes.to(torch.int64) + 8).reshape(codes.shape[0], -1, 8)
    words = (stored << torch.arange(0, 32, 4, dtype=torch.int64)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
