"""SmoothQuant: per input channel j of a linear layer fed by an RMSNorm,

    s_j = max|x_j|^alpha / max_n |W[n, j]|^(1 - alpha)        (W: all fused projections)
    norm.weight_j /= s_j,   W[:, j] *= s_j                    (y unchanged in exact math)

so the activations' outliers (a few channels 100x the others) move into the weights,
which quantize per output channel and absorb them. Applied where an RMSNorm feeds the
layer directly: q/k/v after input_layernorm, gate/up after post_attention_layernorm
(o and down have no per-channel op before them to fold 1/s into). The layer's input
statistics are rescaled to match.
"""
from __future__ import annotations

import re

import torch

from services.quantize.calibration import InputStats

SMOOTHED = {   # Linear module name pattern -> the norm before it (checkpoint name)
    re.compile(r"layers\.(\d+)\.self_attn\.qkv"): "model.layers.{}.input_layernorm.weight",
    re.compile(r"layers\.(\d+)\.mlp\.gate_up"): "model.layers.{}.post_attention_layernorm.weight",
}
S_RANGE = (1e-5, 1e5)


def smoothing_factors(x_absmax: torch.Tensor, w_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """float64 [in]; 1 where a channel never saw a nonzero input or weight."""
    s = x_absmax.pow(alpha) / w_absmax.pow(1 - alpha)
    s = torch.where((x_absmax > 0) & (w_absmax > 0), s, torch.ones_like(s))
    return s.clamp(*S_RANGE)


def smooth(tensors: dict[str, torch.Tensor], stats: dict[str, InputStats], alpha: float) -> list[str]:
    """Rescale tensors (checkpoint name -> float tensor; replaced, not mutated) and stats in
    place; returns the Linear names smoothed."""
    done = []
    for name, st in stats.items():
        norm = next((template.format(m.group(1)) for pattern, template in SMOOTHED.items()
                     if (m := pattern.fullmatch(name))), None)
        if norm is None:
            continue
        weights = [p + ".weight" for p in st.projections]
        w_absmax = torch.stack([tensors[w].double().abs().amax(0) for w in weights]).amax(0)
        s = smoothing_factors(st.absmax, w_absmax, alpha)
        tensors[norm] = (tensors[norm].double() / s).to(tensors[norm].dtype)
        for w in weights:
            tensors[w] = (tensors[w].double() * s).to(tensors[w].dtype)
        st.min, st.max = st.min / s, st.max / s
        if st.xtx is not None:
            st.xtx = st.xtx / s[:, None] / s[None, :]
        done.append(name)
    return done
