"""Rotary embedding tables, bit-exact with transformers' ROPE_INIT_FUNCTIONS in float32.

Every supported rope type has attention scaling 1.0, so cos/sin need no extra factor.
"""
from __future__ import annotations

import math

import torch

ROPE_TYPES = ("default", "linear", "llama3")
_LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor",
                  "original_max_position_embeddings")


def rope_inv_freq(head_dim: int, theta: float, rope_scaling: dict | None = None) -> torch.Tensor:
    """float32 [head_dim // 2] inverse frequencies on the CPU.

    rope_scaling: None, or a config dict with "rope_type" (or legacy "type") in ROPE_TYPES;
    "linear" needs "factor", "llama3" needs the _LLAMA3_FIELDS. Raises ValueError otherwise.
    """
    rope_type = "default"
    if rope_scaling is not None:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_scaling.rope_type={rope_type!r} is not supported; "
                         f"allowed: {', '.join(ROPE_TYPES)}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64)
                                .to(dtype=torch.float) / head_dim))
    if rope_type == "linear":
        inv_freq /= _field(rope_scaling, "factor", rope_type)
    elif rope_type == "llama3":
        inv_freq = _llama3(inv_freq, *(_field(rope_scaling, f, rope_type) for f in _LLAMA3_FIELDS))
    return inv_freq


def rope_cos_sin(inv_freq: torch.Tensor, max_positions: int,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [max_positions, head_dim // 2] on inv_freq's device, computed in
    float32 as transformers does (position * inv_freq, then cos/sin), cast to dtype."""
    positions = torch.arange(max_positions, device=inv_freq.device, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq.float()[None, :]
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


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
