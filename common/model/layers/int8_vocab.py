"""The vocabulary matrix in int8 (`EngineConfig.lm_head_quantization: int8`): the LM head
runs the W8A8-dynamic math, and a tied embedding looks its rows up in the same codes, so
the model holds one int8 matrix where it held a float one (SmolLM2-135M: 113 MB of fp32,
a fifth of its weights, read whole by every decode step's head).

    s_w[v]    = max_k |W[v, k]| / 127           (per vocab row; 1 for an all-zero row)
    W_q       = clamp(round(W / s_w), -128, 127)
    embed(id) = W_q[id] * s_w[id]               (in the model's dtype)
    logits    = (x_q @ W_q^T) * s_x * s_w       (x_q, s_x: per token, backend.quantize_per_token)

Vocab rows are independent, so a rank's rows under tensor parallelism quantize exactly as
at tensor_parallel_size 1. The quantization is the engine's, not the checkpoint's: no
format carries an int8 vocabulary that both readers of our checkpoints (vLLM, msModelSlim's
vLLM-Ascend) would load.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from kernels import Backend

DIVISOR = 127.0                      # msModelSlim's symmetric int8 (npu_dynamic_quant's)


class Int8Vocab:
    """codes int8 [rows, hidden] and scale float32 [rows, 1] of a vocabulary matrix, and
    the backend's prepared form of the codes for the head's matmul (it may share their
    storage: the CPU backend multiplies by a transposed view)."""

    def __init__(self, weight: torch.Tensor, backend: Backend):
        w = weight.detach().float()
        amax = w.abs().amax(dim=1, keepdim=True)
        self.scale = torch.where(amax > 0, amax / DIVISOR, torch.ones_like(amax))
        self.codes = torch.round(w / self.scale).clamp_(-128, 127).to(torch.int8)
        self.prepared: Any = backend.prepare_int8_weight(self.codes)
        self._scale_row = self.scale.reshape(1, -1).contiguous()   # [1, rows]: the matmul's per-channel scale

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scale.numel() * 4

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The rows of ids, dequantized: [*ids.shape, hidden] in dtype."""
        return (F.embedding(ids, self.codes).to(torch.float32) * F.embedding(ids, self.scale)).to(dtype)

    def logits(self, hidden: torch.Tensor, backend: Backend) -> torch.Tensor:
        """hidden [rows, hidden] -> [rows, vocab rows] in hidden's dtype (as a float head's:
        npu_quant_matmul returns no float32 for a bfloat16 model)."""
        x_q, x_scale = backend.quantize_per_token(hidden.contiguous(), DIVISOR)
        return backend.int8_scaled_matmul(x_q, self.prepared, self._scale_row, row_scale=x_scale,
                                          out_dtype=hidden.dtype)
