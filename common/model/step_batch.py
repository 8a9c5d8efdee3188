"""What one forward pass attends with: the model's input besides the token ids."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import DecodeMetadata, PrefillMetadata


@dataclass
class StepBatch:
    """Tokens of a step arrive packed as [decode tokens | prefill chunks]; the
    `num_decode_tokens` leading tokens are decodes (kernels/api.py)."""

    positions: torch.Tensor          # int64 [num_tokens]
    slot_mapping: torch.Tensor       # int64 [num_tokens]
    num_decode_tokens: int
    decode: DecodeMetadata | None
    prefill: PrefillMetadata | None
