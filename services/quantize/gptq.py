"""GPTQ for int4 per-group weights (Frantar et al. 2022): quantize one input column at a
time and spread its rounding error over the columns not yet quantized, weighted by the
inverse Hessian of the layer's inputs, so that ||X W^T - X Q^T|| on the calibration
activations X stays small where round-to-nearest leaves it large.

    H = 2 X^T X / tokens + damp * mean(diag) * I          (dead inputs: H_jj = 1, W[:, j] = 0)
    (X^T X is float64 [in, in] per linear layer, kept for all layers during calibration:
    8 * in^2 bytes each, ~2 GB a layer for an 8B Llama: a 135M model needs ~100 MB)
    U = chol(H^-1, upper)
    for each column j (in blocks of 128 columns, lazy updates):
        at a group's first column: s from the updated weights (schemes.int4_scale: the clip
        of max|W[:, group]| / 7.5 with the least squared error)
        q_j = clamp(round(w_j / s), -8, 7);  e = (w_j - q_j s) / U_jj
        W[:, j+1:] -= e U_j,j+1:
"""
from __future__ import annotations

import torch

from services.quantize.schemes import int4_scale

DAMP = 0.01


def gptq_int4(weight: torch.Tensor, xtx: torch.Tensor, num_tokens: int, group_size: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes -8..7 [out, in], float64 scale [out, in / group_size])."""
    w = weight.double().clone()
    rows, cols = w.shape
    h = 2.0 * xtx.double() / max(num_tokens, 1)
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += DAMP * torch.mean(torch.diag(h)) * torch.eye(cols, dtype=torch.float64)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    codes = torch.zeros(rows, cols, dtype=torch.int8)
    scales = torch.zeros(rows, cols // group_size, dtype=torch.float64)
    block = group_size if group_size >= 128 else group_size * (128 // group_size)
    for b0 in range(0, cols, block):
        b1 = min(b0 + block, cols)
        wb = w[:, b0:b1].clone()
        errors = torch.zeros_like(wb)
        ub = u[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            if col % group_size == 0:
                s = int4_scale(wb[:, i:i + group_size], weight.dtype)
                scales[:, col // group_size] = s
            s = scales[:, col // group_size]
            q = torch.round(wb[:, i] / s).clamp(-8, 7)
            codes[:, col] = q.to(torch.int8)
            err = (wb[:, i] - q * s) / ub[i, i]
            wb[:, i:] -= err[:, None] * ub[i, i:][None, :]
            errors[:, i] = err
        w[:, b1:] -= errors @ u[b0:b1, b1:]
    return codes, scales
