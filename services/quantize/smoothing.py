"""SmoothQuant: per input channel j of a linear layer fed by an RMSNorm,

    s_j = max|x_j|^alpha / max_n |W[n, j]|^(1 - alpha)        (W: all fused projections)
    norm.weight_j /= s_j,   W[:, j] *= s_j                    (y unchanged in exact math)

so the activations' outliers (a few channels 100x the others) move into the weights,
which quantize per output channel and absorb them. Applied where 1/s folds exactly into
what comes before: q/k/v after input_layernorm, gate/up after post_attention_layernorm,
down after up_proj (down's input silu(gate) * up is linear in each row of up: row j of up
/ s_j). (o's input mixes each value row into several heads: not smoothed.) The layer's
input statistics are rescaled to match.
"""
from __future__ import annotations

import re

import torch

from services.quantize.calibration import InputStats
from services.quantize.schemes import TINY, int8_weight_as_float, static_input_as_float

SMOOTHED = {   # Linear module name pattern -> what 1/s folds into: a norm, or the rows of a producer
    re.compile(r"layers\.(\d+)\.self_attn\.qkv"): "model.layers.{}.input_layernorm.weight",
    re.compile(r"layers\.(\d+)\.mlp\.gate_up"): "model.layers.{}.post_attention_layernorm.weight",
    # down's input is silu(gate) * up, linear in each up row: row j of up (and its bias) / s_j
    re.compile(r"layers\.(\d+)\.mlp\.down"): "model.layers.{}.mlp.up_proj.weight",
}
S_RANGE = (1e-5, 1e5)


def smoothing_factors(x_absmax: torch.Tensor, w_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """float64 [in]; 1 where a channel never saw a nonzero input or weight."""
    s = x_absmax.pow(alpha) / w_absmax.pow(1 - alpha)
    s = torch.where((x_absmax > 0) & (w_absmax > 0), s, torch.ones_like(s))
    return s.clamp(*S_RANGE)


ALPHAS = tuple(round(0.3 + 0.05 * i, 2) for i in range(14))     # what "auto" tries: 0.3 .. 0.95
PATHS = ("static", "dynamic")      # W8A8's; "w4a16:G" is int4 weights in groups of G, float activations


def quantized_output_error(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, lo: float, hi: float, paths) -> float:
    """Relative error of the quantized output (W8A8: int8 weights per channel, divisor 127;
    activations static per tensor over [lo, hi] / dynamic per token; "w4a16:G": int4 weights
    per group of G, float activations) on the sample rows x, both in float32, with the
    smoothing factors s applied; summed over the paths."""
    exact = x @ w.t()
    xs, ws = x / s, w * s
    wq = int8_weight_as_float(ws)
    total = 0.0
    for path in paths:
        if path.startswith("w4a16:"):
            groups = ws.reshape(ws.shape[0], -1, int(path.split(":")[1]))
            g_scale = (groups.abs().amax(-1, keepdim=True) / 7.5).clamp_min(TINY)
            w4 = (torch.round(groups / g_scale).clamp(-8, 7) * g_scale).reshape(ws.shape)
            total += float(((xs @ w4.t() - exact).norm(dim=1) / exact.norm(dim=1).clamp_min(TINY)).mean())
            continue
        if path == "static":
            xq = static_input_as_float(xs, lo, hi)
        else:
            scale = (xs.abs().amax(1, keepdim=True) / 127).clamp_min(TINY)
            xq = torch.round(xs / scale).clamp(-128, 127) * scale
        # each token's own relative error, averaged: a few outlier tokens (whose outputs are
        # 100x the others') would otherwise decide alone
        total += float(((xq @ wq.t() - exact).norm(dim=1) / exact.norm(dim=1).clamp_min(TINY)).mean())
    return total


def choose_alpha(st: InputStats, w: torch.Tensor, w_absmax: torch.Tensor, paths) -> float | None:
    """The migration strength in ALPHAS whose quantized-output error on the calibration
    sample is least, or None when leaving the layer unsmoothed is better still."""
    x = st.samples.float()
    w = w.float()
    errors = {}
    for alpha in ALPHAS:
        s = smoothing_factors(st.absmax, w_absmax, alpha)
        errors[alpha] = quantized_output_error(x, w, s.float(), float((st.min / s).min()), float((st.max / s).max()), paths)
    ones = torch.ones_like(st.absmax)
    errors[None] = quantized_output_error(x, w, ones.float(), float(st.min.min()), float(st.max.max()), paths)   # not smoothed
    return min(errors, key=errors.get)


def smooth(tensors: dict[str, torch.Tensor], stats: dict[str, InputStats], alpha: float | str,
           paths: tuple[str, ...] = PATHS) -> dict[str, float | None]:
    """Rescale tensors (checkpoint name -> float tensor; replaced, not mutated) and stats in
    place. alpha: one strength for every layer, or "auto": per layer, the strength in ALPHAS
    with the least W8A8 output error over `paths` on the stats' samples (calibrate with
    samples, or none). Returns Linear name -> the strength used (None: left unsmoothed)."""
    done: dict[str, float | None] = {}
    for name, st in stats.items():
        into = next((template.format(m.group(1)) for pattern, template in SMOOTHED.items()
                     if (m := pattern.fullmatch(name))), None)
        if into is None:
            continue
        weights = [p + ".weight" for p in st.projections]
        w_absmax = torch.stack([tensors[w].double().abs().amax(0) for w in weights]).amax(0)
        if alpha == "auto":
            if st.samples is None:
                raise ValueError("smoothing alpha 'auto' needs calibration samples")
            fused = torch.cat([tensors[w].double() for w in weights])
            strength = choose_alpha(st, fused, w_absmax, paths)
        else:
            strength = float(alpha)
        if strength is None:
            done[name] = None
            continue
        s = smoothing_factors(st.absmax, w_absmax, strength)
        if into.endswith("layernorm.weight"):
            tensors[into] = (tensors[into].double() / s).to(tensors[into].dtype)
        else:   # a producer's output rows
            if into not in tensors:
                raise ValueError(f"smoothing {name} folds 1/s into {into}, which the checkpoint lacks")
            for tensor in (into, into.removesuffix("weight") + "bias"):
                if tensor in tensors:
                    shape = (-1,) + (1,) * (tensors[tensor].dim() - 1)
                    tensors[tensor] = (tensors[tensor].double() / s.view(shape)).to(tensors[tensor].dtype)
        for w in weights:
            tensors[w] = (tensors[w].double() * s).to(tensors[w].dtype)
        st.min, st.max = st.min / s, st.max / s
        if st.xtx is not None:
            st.xtx = st.xtx / s[:, None] / s[None, :]
        if st.samples is not None:
            st.samples = (st.samples.double() / s).float()
        done[name] = strength
    return done
