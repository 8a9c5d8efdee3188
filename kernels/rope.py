"""Rotary embedding tables, bit-exact with transformers' ROPE_INIT_FUNCTIONS in float32.

"yarn" also has an attention factor (transformers multiplies cos and sin by it):
rope_attention_factor; every other supported type's is 1.0.
"""
from __future__ import annotations

import math

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor",
                  "original_max_position_embeddings")
_YARN_FIELDS = ("factor", "original_max_position_embeddings")


def rope_inv_freq(head_dim: int, theta: float, rope_scaling: dict | None = None) -> torch.Tensor:
    """float32 [head_dim // 2] inverse frequencies on the CPU.

    rope_scaling: None, or a config dict with "rope_type" (or legacy "type") in ROPE_TYPES;
    "linear" needs "factor", "llama3" needs the _LLAMA3_FIELDS. Raises ValueError otherwise.
    """
    rope_type = _rope_type(rope_scaling)
    if rope_type == "yarn":
        return _yarn(head_dim, theta, rope_scaling)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64)
                                .to(dtype=torch.float) / head_dim))
    if rope_type == "linear":
        inv_freq /= _field(rope_scaling, "factor", rope_type)
    elif rope_type == "llama3":
        inv_freq = _llama3(inv_freq, *(_field(rope_scaling, f, rope_type) for f in _LLAMA3_FIELDS))
    return inv_freq


def rope_attention_factor(rope_scaling: dict | None) -> float:
    """What cos and sin are multiplied by: yarn's `attention_factor`, else derived from
    `factor` (and DeepSeek's `mscale` / `mscale_all_dim` when both are set); 1.0 for the
    other types."""
    if _rope_type(rope_scaling) != "yarn":
        return 1.0
    if rope_scaling.get("attention_factor") is not None:
        return float(rope_scaling["attention_factor"])
    factor = _field(rope_scaling, "factor", "yarn")
    mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
    return yarn_mscale(factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """DeepSeek's (and YaRN's) magnitude correction for a context stretched `factor` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope_type(rope_scaling: dict | None) -> str:
    rope_type = "default"
    if rope_scaling is not None:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_scaling.rope_type={rope_type!r} is not supported; "
                         f"allowed: {', '.join(ROPE_TYPES)}")
    return rope_type


def _yarn(dim: int, base: float, rope_scaling: dict) -> torch.Tensor:
    """transformers' _compute_yarn_parameters: extrapolated frequencies above the
    correction range, interpolated (divided by factor) below it, a linear ramp between."""
    factor, original_max = (_field(rope_scaling, f, "yarn") for f in _YARN_FIELDS)
    beta_fast = rope_scaling.get("beta_fast") or 32
    beta_slow = rope_scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original_max / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope_scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001      # no zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_cos_sin(inv_freq: torch.Tensor, max_positions: int,
                 dtype: torch.dtype = torch.float32,
                 attention_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [max_positions, head_dim // 2] on inv_freq's device, computed in
    float32 as transformers does (position * inv_freq, then cos/sin, times
    attention_factor: rope_attention_factor), cast to dtype."""
    positions = torch.arange(max_positions, device=inv_freq.device, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq.float()[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype), sin.to(dtype)


def _field(rope_scaling: dict, name: str, rope_type: str):
    if name not in rope_scaling:
        raise ValueError(f"rope_scaling.{name} is required for rope_type={rope_type!r}")
    return rope_scaling[name]


def _llama3(inv_freq, factor, low_freq_factor, high_freq_factor, old_context_len):
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, inv_freq_llama)
