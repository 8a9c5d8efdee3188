"""The token embedding and the LM head, vocab-parallel under tensor parallelism.

Rank r holds vocab rows [vocab_start, vocab_end) in a matrix of vocab_per_rank rows (the
last rank's spare rows are zero padding; common/parallel/shard.py). The lookup embeds
the ids in its rows, zeros elsewhere, and the all-reduce adds them up (exactly one rank
contributes each row). The head computes the rank's vocab columns and gathers them to
rank 0. Without a group neither runs a collective.

prepare(backend, int8=True) quantizes the head's matrix (layers/int8_vocab.py); a tied
embedding then looks up the same int8 codes and drops its float matrix.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from common.model.layers.int8_vocab import Int8Vocab
from common.model.layers.weight_slots import Slot, new_param, rows_slot
from common.parallel.shard import TPShard

if TYPE_CHECKING:
    from common.parallel.group import TPGroup
    from kernels import Backend

log = logging.getLogger("pdmesh.model")


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, shard: TPShard, dtype: torch.dtype):
        super().__init__()
        self.vocab_size, self.shard = vocab_size, shard
        padded = shard.vocab_end - shard.vocab_start < shard.vocab_per_rank
        self.weight = new_param(shard.vocab_per_rank, hidden_size, dtype=dtype, zeros=padded)
        self.int8: Int8Vocab | None = None     # set by a tied int8 head (LMHead.prepare); weight then empty
        self.group: TPGroup | None = None

    def weight_slots(self, name: str) -> dict[str, Slot]:
        sh = self.shard
        return {name + ".weight": rows_slot(self.weight, 0, sh.vocab_end - sh.vocab_start,
                                            self.vocab_size, sh.vocab_start)}

    def use_int8(self, int8: Int8Vocab) -> None:
        """Look rows up in int8's codes from now on; the float matrix is released."""
        self.int8 = int8
        self.weight.data = self.weight.data.new_empty(0)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None:
            return self.int8.lookup(ids, self.weight.dtype)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return self._rows(input_ids)
        sh = self.shard
        local = input_ids - sh.vocab_start
        outside = (local < 0) | (local >= sh.vocab_end - sh.vocab_start)
        h = self._rows(local.masked_fill(outside, 0))
        return self.group.all_reduce(h.masked_fill_(outside.unsqueeze(-1), 0))


class LMHead(nn.Module):
    """The output projection; `tied_to` an embedding, it reads that embedding's matrix
    and has no parameter of its own."""

    def __init__(self, vocab_size: int, hidden_size: int, shard: TPShard, dtype: torch.dtype,
                 tied_to: VocabEmbedding | None = None):
        super().__init__()
        self.vocab_size, self.shard = vocab_size, shard
        self.tied_to = tied_to
        if tied_to is None:
            padded = shard.vocab_end - shard.vocab_start < shard.vocab_per_rank
            self.weight = new_param(shard.vocab_per_rank, hidden_size, dtype=dtype, zeros=padded)
        self.prepared: Any = None    # the matrix as the backend multiplies it (prepare)
        self.int8: Int8Vocab | None = None
        self.group: TPGroup | None = None

    def weight_slots(self, name: str) -> dict[str, Slot]:
        if self.tied_to is not None:
            return {}
        sh = self.shard
        return {name + ".weight": rows_slot(self.weight, 0, sh.vocab_end - sh.vocab_start,
                                            self.vocab_size, sh.vocab_start)}

    def prepare(self, backend: Backend, int8: bool = False) -> None:
        """The backend's form of the matrix; int8: its W8A8-dynamic form (shared with a
        tied embedding, whose float matrix goes)."""
        if int8:
            source = self.tied_to.weight if self.tied_to is not None else self.weight
            float_bytes = source.numel() * source.element_size()
            self.int8 = self.prepared = Int8Vocab(source.data, backend)
            log.info("LM head in int8 per vocab row (%s): %.1f MB instead of %.1f MB, %s",
                     "tied: the embedding reads the same codes" if self.tied_to is not None else "untied",
                     self.int8.nbytes / 1e6, float_bytes / 1e6, backend.int8_path)
            if self.tied_to is not None:
                self.tied_to.use_int8(self.int8)
            else:
                self.weight.data = self.weight.data.new_empty(0)
            return
        if self.tied_to is not None:
            # the embedding lookup needs the dense matrix: the head gets a prepared copy of
            # its own (SmolLM2's is a fifth of the weights; through F.linear's MKL path it
            # took 27 of a decode step's 67 ms on an EPYC, prepared it reads at the layers' rate)
            self.prepared = backend.prepare_linear(self.tied_to.weight.data)
            return
        dense = self.weight.data
        self.prepared = backend.prepare_linear(dense)
        if self.prepared is not dense:
            self.weight.data = dense.new_empty(0)

    def forward(self, hidden: torch.Tensor, backend: Backend) -> torch.Tensor | None:
        """float32 [rows, vocab]; at tensor parallelism rank 0 gets every rank's columns
        (None on the other ranks)."""
        if self.group is None:
            return self._columns(hidden, backend).float()
        parts = self.group.gather(self._columns(hidden, backend))
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[:, :self.vocab_size].float()

    def _columns(self, hidden: torch.Tensor, backend: Backend) -> torch.Tensor:
        if self.int8 is not None:
            return self.int8.logits(hidden, backend)
        return backend.linear(hidden, self.prepared, None)
