"""The wire form of one step's model inputs (common/runner/step_inputs.py) for the
tensor-parallel ranks: one int64 tensor that rank 0 broadcasts.

Wire form (int64; tables are padded to their width with block 0, as the runner pads):

    header (HEADER_LEN)                     payload
    [op n_tok n_dec w_dec n_pre w_pre n_smp len] [ids | pos | slots | dec_lens | dec_tables
                                                   | q_lens | kv_lens | pre_tables | sample_rows
                                                   | score_rows]
                                                   n_tok  n_tok n_tok  n_dec    n_dec*w_dec
                                                   n_pre  n_pre  n_pre*w_pre  n_smp
                                                   len - (all of the above)

score_rows (prompt positions whose logits a request wants: prompt_logprobs) are the
payload's tail, their count what `len` leaves after the parts the header sizes.

Between steps rank 0 may send a GatherKV instead (header [OP_GATHER_KV 0 0 0 0 0 0 len],
payload: block ids). A step is one broadcast of a fixed INLINE_LEN buffer (header + payload) when it fits;
a bigger one sends the header alone, then the payload as a second broadcast of `len`.
Why a tensor and not pickled objects: the collectives' own backend carries it, in step
with them, and gloo broadcasts only tensors (costs: common/parallel/executor.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from common.runner.step_inputs import StepInputs

HEADER_LEN = 8
INLINE_LEN = 4096          # 32 KiB: a step of ~1000 tokens or 64 decodes of 1000+ tokens
OP_STOP, OP_STEP, OP_GATHER_KV = 0, 1, 2


def _flat(rows: list[list[int]]) -> tuple[int, list[int]]:
    width = len(rows[0]) if rows else 0
    return width, [b for row in rows for b in row]


def _rows(flat: list[int], n: int, width: int) -> list[list[int]]:
    return [flat[i * width:(i + 1) * width] for i in range(n)]


def pack(inputs: StepInputs) -> torch.Tensor:
    """The wire tensor of a step: INLINE_LEN long when it fits, else header + payload."""
    w_dec, dec = _flat(inputs.decode_tables)
    w_pre, pre = _flat(inputs.prefill_tables)
    payload = (inputs.input_ids + inputs.positions + inputs.slots + inputs.decode_lens + dec
               + inputs.query_lens + inputs.kv_lens + pre + inputs.sample_rows + inputs.score_rows)
    header = [OP_STEP, len(inputs.input_ids), len(inputs.decode_lens), w_dec,
              len(inputs.query_lens), w_pre, len(inputs.sample_rows), len(payload)]
    return _wire(header + payload)


def _wire(values: list[int]) -> torch.Tensor:
    """header + payload as int64, padded to INLINE_LEN when shorter."""
    values = torch.tensor(values, dtype=torch.int64)
    if len(values) >= INLINE_LEN:
        return values
    wire = torch.zeros(INLINE_LEN, dtype=torch.int64)
    wire[:len(values)] = values
    return wire


@dataclass
class GatherKV:
    """Between steps: every rank gathers these blocks of its KV cache (all layers, K and V)
    to rank 0 (a prefill node staging head slices into whole blocks,
    services/prefill/kv_destination.py)."""

    block_ids: list[int]


def gather_message(block_ids: list[int]) -> torch.Tensor:
    """The wire tensor of a GatherKV: header [OP_GATHER_KV, 0 ... , len] + the ids."""
    return _wire([OP_GATHER_KV, 0, 0, 0, 0, 0, 0, len(block_ids), *block_ids])


def stop_message() -> torch.Tensor:
    message = torch.zeros(INLINE_LEN, dtype=torch.int64)
    message[0] = OP_STOP
    return message


def is_inline(wire: torch.Tensor) -> bool:
    return HEADER_LEN + int(wire[HEADER_LEN - 1]) <= INLINE_LEN


def unpack(header_and_inline: torch.Tensor, payload: torch.Tensor | None = None) -> StepInputs | GatherKV | None:
    """StepInputs (or a GatherKV) from a received INLINE_LEN buffer (and the second
    broadcast's payload when it did not fit); None for the stop message."""
    head = header_and_inline[:HEADER_LEN].tolist()
    op, n_tok, n_dec, w_dec, n_pre, w_pre, n_smp, length = head
    if op == OP_STOP:
        return None
    if payload is None:
        payload = header_and_inline[HEADER_LEN:HEADER_LEN + length]
    values = payload.tolist()
    if op == OP_GATHER_KV:
        return GatherKV(values)
    sizes = [n_tok, n_tok, n_tok, n_dec, n_dec * w_dec, n_pre, n_pre, n_pre * w_pre, n_smp]
    parts, at = [], 0
    for size in sizes:
        parts.append(values[at:at + size])
        at += size
    ids, pos, slots, dec_lens, dec, q_lens, kv_lens, pre, rows = parts
    return StepInputs(ids, pos, slots, dec_lens, _rows(dec, n_dec, w_dec), q_lens, kv_lens,
                      _rows(pre, n_pre, w_pre), rows, values[at:])
