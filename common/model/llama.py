"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

Weights are fused at load time: q/k/v into one `qkv` matrix, gate/up into one `gate_up`,
so a layer runs four matmuls, each through the kernel backend's `linear` on the weight as
its `prepare_linear` returned it (`prepare_linears`, once, after loading and moving). Tokens of a step arrive packed as
[decode tokens | prefill chunks]; attention is split accordingly (kernels/api.py).

KV cache: one tensor [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim];
layer l reads kv_cache[l, 0] (keys) and kv_cache[l, 1] (values).

Tensor parallelism (a `shard`, common/parallel/shard.py, and a group attached with
`attach_group`): qkv and gate_up are column-parallel (the rank's heads / MLP columns),
o and down row-parallel (one all-reduce each, their biases added after it), the
embedding vocab-parallel (masked lookup + all-reduce) and the LM head too (its logits
gathered to rank 0). Each rank reads only its slices of the checkpoint. Without a group
(tensor_parallel_size 1) the forward pass runs no collective and no extra op.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import nn

from common.model.config import ModelConfig
from common.model.weights import iter_checkpoint
from common.parallel.shard import TPShard, whole_model
from kernels import Backend, DecodeMetadata, PrefillMetadata, rope_cos_sin, rope_inv_freq

if TYPE_CHECKING:
    from common.parallel.group import TPGroup

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class StepBatch:
    """What one forward pass attends with. `num_decode_tokens` leading tokens are decodes."""

    positions: torch.Tensor          # int64 [num_tokens]
    slot_mapping: torch.Tensor       # int64 [num_tokens]
    num_decode_tokens: int
    decode: DecodeMetadata | None
    prefill: PrefillMetadata | None


def _param(*shape: int, dtype: torch.dtype, zeros: bool = False) -> nn.Parameter:
    make = torch.zeros if zeros else torch.empty
    return nn.Parameter(make(*shape, dtype=dtype), requires_grad=False)


@dataclass(frozen=True)
class Slot:
    """Where one checkpoint tensor goes: rows [start, end) of param, from the part
    `source` of the checkpoint tensor (None = all of it), whose full shape must be
    full_shape."""

    param: nn.Parameter
    start: int
    end: int
    full_shape: tuple[int, ...]
    source: tuple[slice, ...] | None = None


def _rows(param: nn.Parameter, start: int, end: int, full_rows: int, src_start: int) -> Slot:
    """param rows [start, end) from the checkpoint rows [src_start, ...) of a tensor of
    full_rows rows (its other dims: param's)."""
    full = (full_rows, *param.shape[1:])
    if src_start == 0 and end - start == full_rows:
        return Slot(param, start, end, full)
    return Slot(param, start, end, full, (slice(src_start, src_start + end - start),))


def _cols(param: nn.Parameter, full_cols: int, src_start: int) -> Slot:
    """All of param from the checkpoint columns [src_start, ...) of a [rows, full_cols] tensor."""
    full = (param.shape[0], full_cols)
    if src_start == 0 and param.shape[1] == full_cols:
        return Slot(param, 0, param.shape[0], full)
    return Slot(param, 0, param.shape[0], full, (slice(None), slice(src_start, src_start + param.shape[1])))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, shard: TPShard | None = None):
        super().__init__()
        self.cfg = cfg
        self.shard = shard or whole_model(cfg)
        self.num_heads, self.num_kv_heads = self.shard.num_heads, self.shard.num_kv_heads
        inter = self.shard.intermediate_size
        q_size, kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.q_size, self.kv_size = q_size, kv_size
        self.qkv = _param(q_size + 2 * kv_size, cfg.hidden_size, dtype=dtype)
        self.qkv_bias = _param(q_size + 2 * kv_size, dtype=dtype) if cfg.qkv_bias else None
        self.o = _param(cfg.hidden_size, q_size, dtype=dtype)
        self.o_bias = _param(cfg.hidden_size, dtype=dtype) if cfg.o_bias else None
        self.gate_up = _param(2 * inter, cfg.hidden_size, dtype=dtype)
        self.gate_up_bias = _param(2 * inter, dtype=dtype) if cfg.mlp_bias else None
        self.down = _param(cfg.hidden_size, inter, dtype=dtype)
        self.down_bias = _param(cfg.hidden_size, dtype=dtype) if cfg.mlp_bias else None
        self.input_norm = _param(cfg.hidden_size, dtype=dtype)
        self.post_attn_norm = _param(cfg.hidden_size, dtype=dtype)
        self.q_norm = _param(cfg.head_dim, dtype=dtype) if cfg.qk_norm else None
        self.k_norm = _param(cfg.head_dim, dtype=dtype) if cfg.qk_norm else None
        self.scale = cfg.head_dim ** -0.5
        self.linears: dict[str, object] = {}   # name -> prepared weight (prepare_linears)
        self.group: TPGroup | None = None       # set by CausalLM.attach_group

    LINEAR_NAMES = ("qkv", "o", "gate_up", "down")

    def prepare_linears(self, backend: Backend) -> None:
        """Hand each matmul weight to backend.prepare_linear; where it returns another
        object, the dense parameter's storage is released (no second copy is kept)."""
        for name in self.LINEAR_NAMES:
            param = getattr(self, name)
            dense = param.data      # one tensor object: .data makes a new one at each access
            prepared = backend.prepare_linear(dense)
            self.linears[name] = prepared
            if prepared is not dense:
                param.data = dense.new_empty(0)

    def weight_slots(self, prefix: str) -> dict[str, Slot]:
        """HF tensor name -> Slot: this rank's rows of the fused parameter and the part
        of the checkpoint tensor it reads."""
        cfg, sh, hd = self.cfg, self.shard, self.cfg.head_dim
        q, kv, inter = self.q_size, self.kv_size, sh.intermediate_size
        full_q, full_kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
        q0, kv0, i0 = sh.head_start * hd, sh.kv_head_start * hd, sh.rank * inter
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        hidden = cfg.hidden_size
        slots = {
            attn + "q_proj.weight": _rows(self.qkv, 0, q, full_q, q0),
            attn + "k_proj.weight": _rows(self.qkv, q, q + kv, full_kv, kv0),
            attn + "v_proj.weight": _rows(self.qkv, q + kv, q + 2 * kv, full_kv, kv0),
            attn + "o_proj.weight": _cols(self.o, full_q, q0),
            mlp + "gate_proj.weight": _rows(self.gate_up, 0, inter, cfg.intermediate_size, i0),
            mlp + "up_proj.weight": _rows(self.gate_up, inter, 2 * inter, cfg.intermediate_size, i0),
            mlp + "down_proj.weight": _cols(self.down, cfg.intermediate_size, i0),
            prefix + "input_layernorm.weight": _rows(self.input_norm, 0, hidden, hidden, 0),
            prefix + "post_attention_layernorm.weight": _rows(self.post_attn_norm, 0, hidden, hidden, 0),
        }
        if self.qkv_bias is not None:
            slots[attn + "q_proj.bias"] = _rows(self.qkv_bias, 0, q, full_q, q0)
            slots[attn + "k_proj.bias"] = _rows(self.qkv_bias, q, q + kv, full_kv, kv0)
            slots[attn + "v_proj.bias"] = _rows(self.qkv_bias, q + kv, q + 2 * kv, full_kv, kv0)
        if self.o_bias is not None:
            slots[attn + "o_proj.bias"] = _rows(self.o_bias, 0, hidden, hidden, 0)
        if self.gate_up_bias is not None:
            slots[mlp + "gate_proj.bias"] = _rows(self.gate_up_bias, 0, inter, cfg.intermediate_size, i0)
            slots[mlp + "up_proj.bias"] = _rows(self.gate_up_bias, inter, 2 * inter, cfg.intermediate_size, i0)
            slots[mlp + "down_proj.bias"] = _rows(self.down_bias, 0, hidden, hidden, 0)
        if self.q_norm is not None:
            slots[attn + "q_norm.weight"] = _rows(self.q_norm, 0, hd, hd, 0)
            slots[attn + "k_norm.weight"] = _rows(self.k_norm, 0, hd, hd, 0)
        return slots

    def attention(self, x: torch.Tensor, batch: StepBatch, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, backend: Backend, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
        cfg, n = self.cfg, x.shape[0]
        linears = self.linears
        qkv = backend.linear(x, linears["qkv"], self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, cfg.head_dim)
        k = k.view(n, self.num_kv_heads, cfg.head_dim)
        v = v.reshape(n, self.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q = backend.rms_norm(q, self.q_norm, cfg.rms_norm_eps)
            k = backend.rms_norm(k, self.k_norm, cfg.rms_norm_eps)
        q, k = backend.rotary(batch.positions, q, k, cos, sin)
        backend.write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        nd = batch.num_decode_tokens
        if batch.prefill is None:
            out = backend.decode(q, k_cache, v_cache, batch.decode, self.scale)
        elif batch.decode is None:
            out = backend.prefill(q, k, v, k_cache, v_cache, batch.prefill, self.scale)
        else:
            out = torch.cat([
                backend.decode(q[:nd], k_cache, v_cache, batch.decode, self.scale),
                backend.prefill(q[nd:], k[nd:], v[nd:], k_cache, v_cache, batch.prefill, self.scale),
            ])
        if self.group is None:
            return backend.linear(out.reshape(n, self.q_size), linears["o"], self.o_bias)
        return self._reduced(backend.linear(out.reshape(n, self.q_size), linears["o"], None), self.o_bias)

    def mlp(self, x: torch.Tensor, backend: Backend) -> torch.Tensor:
        linears = self.linears
        gate, up = backend.linear(x, linears["gate_up"], self.gate_up_bias).chunk(2, dim=-1)
        if self.group is None:
            return backend.linear(F.silu(gate) * up, linears["down"], self.down_bias)
        return self._reduced(backend.linear(F.silu(gate) * up, linears["down"], None), self.down_bias)

    def _reduced(self, partial: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """A row-parallel output: the ranks' partial sums added, then the bias once."""
        out = self.group.all_reduce(partial.contiguous())
        return out if bias is None else out + bias


class CausalLM(nn.Module):
    """Inference-only decoder. `forward` returns final hidden states; `logits` projects the
    rows that need sampling."""

    def __init__(self, cfg: ModelConfig, backend: Backend, dtype: torch.dtype = torch.float32,
                 max_positions: int | None = None, shard: TPShard | None = None):
        super().__init__()
        self.cfg, self.backend, self.dtype = cfg, backend, dtype
        self.shard = sh = shard or whole_model(cfg)
        padded = sh.vocab_end - sh.vocab_start < sh.vocab_per_rank   # the last rank's spare rows
        self.embed = _param(sh.vocab_per_rank, cfg.hidden_size, dtype=dtype, zeros=padded)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, sh) for _ in range(cfg.num_layers))
        self.norm = _param(cfg.hidden_size, dtype=dtype)
        self.lm_head = self.embed if cfg.tie_word_embeddings else _param(
            sh.vocab_per_rank, cfg.hidden_size, dtype=dtype, zeros=padded)
        self.group: TPGroup | None = None
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        cos, sin = rope_cos_sin(inv_freq, max_positions or cfg.max_position_embeddings)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.lm_linear = None    # lm_head as the backend multiplies it (prepare_linears)
        self.dense_bytes: dict[str, int] = {}   # parameter name -> bytes before prepare_linears

    def attach_group(self, group: TPGroup) -> None:
        """The rank's tensor-parallel group (tensor_parallel_size > 1), before the first
        forward; the collectives run in the same order on every rank."""
        self.group = group
        for layer in self.layers:
            layer.group = group

    def weight_slots(self) -> dict[str, Slot]:
        cfg, sh = self.cfg, self.shard
        vocab_rows = sh.vocab_end - sh.vocab_start
        slots = {"model.embed_tokens.weight": _rows(self.embed, 0, vocab_rows, cfg.vocab_size, sh.vocab_start),
                 "model.norm.weight": _rows(self.norm, 0, cfg.hidden_size, cfg.hidden_size, 0)}
        if not cfg.tie_word_embeddings:
            slots["lm_head.weight"] = _rows(self.lm_head, 0, vocab_rows, cfg.vocab_size, sh.vocab_start)
        for i, layer in enumerate(self.layers):
            slots.update(layer.weight_slots(f"model.layers.{i}."))
        return slots

    @torch.inference_mode()
    def load_weights(self, model_dir: str | Path) -> None:
        """Copy a checkpoint into the fused parameters; a shard reads only its slices
        (safetensors get_slice). ValueError naming the file and the tensor on a shape
        mismatch; naming the tensors when any is missing."""
        slots = self.weight_slots()
        sources = {name: slot.source for name, slot in slots.items() if slot.source is not None}
        if self.cfg.tie_word_embeddings:
            sources["lm_head.weight"] = (slice(0, 0),)   # a copy some tied checkpoints carry: read none of it
        loaded: set[str] = set()
        for name, tensor, path, shape in iter_checkpoint(model_dir, slices=sources, with_shape=True,
                                                        dtype=self.dtype):
            slot = slots.get(name)
            if slot is None:
                if name == "lm_head.weight" or name.endswith(IGNORED_SUFFIXES):
                    continue  # tied checkpoints may still carry lm_head
                raise ValueError(f"{path}: unexpected tensor {name!r} for {self.cfg.architecture}")
            if shape != slot.full_shape:
                raise ValueError(f"{path}: tensor {name!r} has shape {shape}, "
                                 f"expected {slot.full_shape} from config.json")
            slot.param.data[slot.start:slot.end].copy_(tensor)
            loaded.add(name)
        missing = sorted(set(slots) - loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"{model_dir}: checkpoint is missing {len(missing)} tensor(s): {shown}")

    def forward(self, input_ids: torch.Tensor, batch: StepBatch, kv_cache: torch.Tensor,
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """on_layer(i), when given, is called on this thread right after layer i's attention
        wrote the step's KV into kv_cache[i] (before its MLP and the layers above): a hook
        for pushing KV layer by layer. On a device the kernels may still be queued then."""
        if self.lm_linear is None:
            raise RuntimeError("CausalLM.prepare_linears() must run after loading, before forward")
        backend, eps = self.backend, self.cfg.rms_norm_eps
        cos, sin = self.rope_cos, self.rope_sin
        h = F.embedding(input_ids, self.embed) if self.group is None else self._embed_parallel(input_ids)
        for i, layer in enumerate(self.layers):
            attn = layer.attention(backend.rms_norm(h, layer.input_norm, eps), batch,
                                   kv_cache[i, 0], kv_cache[i, 1], backend, cos, sin)
            if on_layer is not None:
                on_layer(i)
            h = h + attn
            h = h + layer.mlp(backend.rms_norm(h, layer.post_attn_norm, eps), backend)
        return backend.rms_norm(h, self.norm, eps)

    def prepare_linears(self) -> None:
        """After load_weights and .to(device), before the first forward: every layer's
        matmul weights (and an untied lm_head) in the backend's prepared form. Once only:
        a packed parameter's dense storage is gone."""
        if self.lm_linear is not None:
            raise RuntimeError("prepare_linears() was already called")
        self.dense_bytes = {name: p.numel() * p.element_size() for name, p in self.named_parameters()}
        for layer in self.layers:
            layer.prepare_linears(self.backend)
        if self.cfg.tie_word_embeddings:
            # the embedding lookup needs the dense matrix: the head gets a prepared copy of
            # its own (SmolLM2's is a fifth of the weights; through F.linear's MKL path it
            # took 27 of a decode step's 67 ms on an EPYC, prepared it reads at the layers' rate)
            self.lm_linear = self.backend.prepare_linear(self.lm_head.data)
        else:
            dense = self.lm_head.data
            self.lm_linear = self.backend.prepare_linear(dense)
            if self.lm_linear is not dense:
                self.lm_head.data = dense.new_empty(0)

    def _embed_parallel(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: each rank embeds the ids in its rows, zeros elsewhere;
        the all-reduce adds them up (exactly one rank contributes each row)."""
        sh = self.shard
        local = input_ids - sh.vocab_start
        outside = (local < 0) | (local >= sh.vocab_end - sh.vocab_start)
        h = F.embedding(local.masked_fill(outside, 0), self.embed)
        return self.group.all_reduce(h.masked_fill_(outside.unsqueeze(-1), 0))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 [rows, vocab]; at tensor parallelism every rank computes its vocab
        columns and rank 0 gets them all (None on the other ranks)."""
        if self.group is None:
            return self.backend.linear(hidden, self.lm_linear, None).float()
        parts = self.group.gather(self.backend.linear(hidden, self.lm_linear, None))
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[:, :self.cfg.vocab_size].float()
