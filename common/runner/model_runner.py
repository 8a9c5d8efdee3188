"""One rank's model and KV cache, and the forward pass of a step's inputs on them.

    load_rank(...)            the rank's shard of the model (read, moved, linears
                              prepared) and its zeroed KV cache
    ModelRunner.forward(in)   StepInputs (plain ints, the same on every rank) -> tensors ->
                              model -> float32 logits of the sample rows (rank 0), and the
                              score rows' logits, SCORE_SLICE_ROWS at a time

Token packing of a step:
    [ d_0 d_1 ... d_{D-1} | p_0 chunk | p_1 chunk | ... ]
      one token per decode   consecutive tokens of each prefill chunk

At tensor parallelism every rank runs `forward` on the same inputs; the logits of each
slice (sample rows, then each slice of score rows) are one collective (the vocab-parallel
head's gather), so every rank computes the same rows in the same slices. What plans the
inputs from a scheduled step is the engine's (common/engine/step_runner.py).
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from common.model.formats.quantization import quantization_config
from common.model.registry import build_model
from common.model.step_batch import StepBatch
from common.runner.split_latent_cache import SplitLatentCache
from common.runner.step_inputs import StepInputs
from common.runner.weight_source import DiskWeights, WeightSource
from kernels import DecodeMetadata, PrefillMetadata

log = logging.getLogger("pdmesh.engine")


def load_rank(mcfg, backend, dtype: torch.dtype, device: torch.device, model_dir: str, shard,
              max_model_len: int, num_blocks: int, block_size: int,
              w8a8_mix_path: str = "dynamic", lm_head_int8: bool = False, weights: WeightSource | None = None,
              identity: str = "", keep_pool: bool = False) -> tuple[torch.nn.Module, torch.Tensor]:
    """One rank's model (its shard's weights, read from model_dir, on device, linears
    prepared) and its zeroed KV cache [num_layers, kv_planes, num_blocks, block_size, its KV
    heads, head_dim] (MLA: one plane of one latent head, or a SplitLatentCache where the
    backend wants two) (int8 for a C8 checkpoint): what rank 0 (LLMEngine) and every worker (common/parallel/worker.py)
    build alike. lm_head_int8: the vocabulary matrix in int8 (layers/int8_vocab.py). ValueError naming the problem for a checkpoint the engine cannot read.
    weights: where the parameters come from (default: model_dir on the disk); identity: the
    rank's weights identity (common/model/weight_identity.py); keep_pool: keep them as one
    buffer to serve as a weight seed. What was loaded: `model.loaded_weights` (its pool None
    when a backend's preparation wrote into the parameters: such bytes are not the
    checkpoint's, and a loader would prepare them twice)."""
    model = build_model(mcfg, backend, dtype, max_positions=max_model_len, shard=shard,
                        quant=quantization_config(model_dir, w8a8_mix_path))
    loaded = (weights or DiskWeights(model_dir)).fill(model, identity, keep_pool)
    model.loaded_weights = loaded
    if model.kv_cache_dtype == torch.int8:
        from common.model.formats.msmodelslim import kv_scales_id
        model.kv_scales_id = kv_scales_id(model_dir)
    model.to(device)
    model.prepare_linears(lm_head_int8)
    if loaded.pool is not None:
        changed = loaded.pool.changed_tensors()
        if changed:
            log.warning("this rank serves no weights to peers: preparing the model wrote into %d of its loaded "
                        "tensors (%s)", len(changed), ", ".join(changed[:3]))
            loaded.pool = None
    if mcfg.uses_mla and backend.latent_planes(mcfg.kv_lora_rank, mcfg.qk_rope_head_dim) == 2:
        return model, SplitLatentCache(mcfg.num_layers, num_blocks, block_size, mcfg.kv_lora_rank,
                                       mcfg.qk_rope_head_dim, model.kv_cache_dtype, device)
    kv_cache = torch.zeros(mcfg.num_layers, mcfg.kv_planes, num_blocks, block_size, shard.num_kv_heads, mcfg.head_dim,
                           dtype=model.kv_cache_dtype, device=device)
    return model, kv_cache


SCORE_SLICE_ROWS = 256    # score rows whose logits are computed at once


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, block_size: int):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = kv_cache.device

    def tensors(self, inputs: StepInputs) -> tuple[torch.Tensor, StepBatch]:
        """(input_ids, batch) on this runner's device."""
        dev = self.device
        decode = prefill = None
        if inputs.decode_lens:
            lens = inputs.decode_lens
            decode = DecodeMetadata(seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
                                    block_tables=torch.tensor(inputs.decode_tables, dtype=torch.int32, device=dev),
                                    seq_lens_list=lens)
        if inputs.query_lens:
            starts = [0]
            for n in inputs.query_lens:
                starts.append(starts[-1] + n)
            prefill = PrefillMetadata(
                query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
                seq_lens=torch.tensor(inputs.kv_lens, dtype=torch.int32, device=dev),
                block_tables=torch.tensor(inputs.prefill_tables, dtype=torch.int32, device=dev),
                query_lens_list=inputs.query_lens, seq_lens_list=inputs.kv_lens)
        batch = StepBatch(
            positions=torch.tensor(inputs.positions, dtype=torch.int64, device=dev),
            slot_mapping=torch.tensor(inputs.slots, dtype=torch.int64, device=dev),
            num_decode_tokens=len(inputs.decode_lens), decode=decode, prefill=prefill)
        return torch.tensor(inputs.input_ids, dtype=torch.int64, device=dev), batch

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, on_layer: Callable[[int], None] | None = None,
                before_logits: Callable[[int], None] | None = None,
                on_scores: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor | None:
        """The forward pass of a step's inputs on this rank: logits of the sample rows
        (None when none samples, and on ranks other than 0). before_logits(num_layers):
        called after the last layer. The score rows' logits, SCORE_SLICE_ROWS at a time
        on every rank: on_scores(offset into score_rows, float32 logits [k, vocab]) on
        rank 0 (each slice is dropped once it returns)."""
        input_ids, batch = self.tensors(inputs)
        hidden = self.model(input_ids, batch, self.kv_cache, on_layer)
        if before_logits is not None:
            before_logits(len(self.model.layers))
        rows = inputs.sample_rows
        logits = None
        if rows:
            picked = hidden if len(rows) == hidden.shape[0] else hidden[torch.tensor(rows, device=self.device)]
            logits = self.model.logits(picked)
        scored = inputs.score_rows
        failed: BaseException | None = None
        for offset in range(0, len(scored), SCORE_SLICE_ROWS):
            part = torch.tensor(scored[offset:offset + SCORE_SLICE_ROWS], device=self.device)
            part_logits = self.model.logits(hidden[part])
            if part_logits is not None and on_scores is not None and failed is None:
                try:
                    on_scores(offset, part_logits)
                except Exception as e:   # every slice still computed: the other ranks wait in its gather
                    failed = e
        if failed is not None:
            raise failed
        return logits
