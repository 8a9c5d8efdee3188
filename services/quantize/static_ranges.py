"""Static activation ranges (msModelSlim W8A8): the [lo, hi] each layer's input is
quantized over, from the calibration.

min/max over every calibration token lets the extreme token of a layer stretch the grid
its 256 codes cover, so the typical token gets a handful of levels, each a coarse step.
Per layer, the range r * [min, max] for r in RANGE_RATIOS with the least quantized output
error on the calibration sample (r = 1: min/max, msModelSlim's default; the tokens beyond
a smaller range clamp), after smoothing, which changes the ranges. The error is the whole
sample's, ||X_q W_q^T - X W^T|| / ||X W^T||, not a mean over tokens: the extreme tokens are
few but carry the largest outputs (chosen by a per-token mean, the ranges clipped them hard
and SmolLM2's perplexity rose).

Finer steps also make the model's output depend less on float rounding: a code flips when
rounding moves its input across a step boundary, and the flip's effect grows with the step.
"""
from __future__ import annotations

import torch

from services.quantize.calibration import InputStats
from services.quantize.kept_float import stays_float
from services.quantize.schemes import TINY, int8_weight_as_float, static_input_as_float

RANGE_RATIOS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2)


def static_output_error(x: torch.Tensor, w: torch.Tensor, lo: float, hi: float) -> float:
    """||X_q W_q^T - X W^T|| / ||X W^T|| over the rows x [tokens, in] (float32), weights w
    [out, in] int8 per output channel (divisor 127), activations static over [lo, hi]."""
    return _errors(x, w, [(lo, hi)])[0]


def _errors(x: torch.Tensor, w: torch.Tensor, ranges: list[tuple[float, float]]) -> list[float]:
    exact = x @ w.t()
    wq_t = int8_weight_as_float(w).t()
    norm = exact.norm().clamp_min(TINY)
    return [float((static_input_as_float(x, lo, hi) @ wq_t - exact).norm() / norm) for lo, hi in ranges]


def choose_static_ranges(tensors: dict[str, torch.Tensor], stats: dict[str, InputStats]) -> dict[str, float]:
    """Set the static_range of every InputStats (calibrated with samples) whose layer is
    quantized (kept_float's layers are skipped); tensors: checkpoint name -> weight, after
    smoothing. Returns Linear name -> the ratio of [min, max] chosen."""
    chosen: dict[str, float] = {}
    for name, st in stats.items():
        if any(stays_float(p) for p in st.projections):
            continue
        if st.samples is None:
            raise ValueError("choosing static ranges needs calibration samples")
        w = torch.cat([tensors[p + ".weight"].float() for p in st.projections])
        lo, hi = float(st.min.min()), float(st.max.max())
        errors = dict(zip(RANGE_RATIOS, _errors(st.samples.float(), w, [(r * lo, r * hi) for r in RANGE_RATIOS])))
        ratio = min(errors, key=errors.get)
        st.static_range = (ratio * lo, ratio * hi)
        chosen[name] = ratio
    return chosen
