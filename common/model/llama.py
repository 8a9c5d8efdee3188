"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

Weights are fused at load time: q/k/v into one `qkv` matrix, gate/up into one `gate_up`,
so a layer runs four matmuls, each through the kernel backend's `linear` on the weight as
its `prepare_linear` returned it (`prepare_linears`, once, after loading and moving). Tokens of a step arrive packed as
[decode tokens | prefill chunks]; attention is split accordingly (kernels/api.py).

KV cache: one tensor [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim];
layer l reads kv_cache[l, 0] (keys) and kv_cache[l, 1] (values).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from common.model.config import ModelConfig
from common.model.weights import iter_checkpoint
from kernels import Backend, DecodeMetadata, PrefillMetadata, rope_cos_sin, rope_inv_freq

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class StepBatch:
    """What one forward pass attends with. `num_decode_tokens` leading tokens are decodes."""

    positions: torch.Tensor          # int64 [num_tokens]
    slot_mapping: torch.Tensor       # int64 [num_tokens]
    num_decode_tokens: int
    decode: DecodeMetadata | None
    prefill: PrefillMetadata | None


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_size, self.kv_size = q_size, kv_size
        self.qkv = _param(q_size + 2 * kv_size, cfg.hidden_size, dtype=dtype)
        self.qkv_bias = _param(q_size + 2 * kv_size, dtype=dtype) if cfg.qkv_bias else None
        self.o = _param(cfg.hidden_size, q_size, dtype=dtype)
        self.o_bias = _param(cfg.hidden_size, dtype=dtype) if cfg.o_bias else None
        self.gate_up = _param(2 * cfg.intermediate_size, cfg.hidden_size, dtype=dtype)
        self.gate_up_bias = _param(2 * cfg.intermediate_size, dtype=dtype) if cfg.mlp_bias else None
        self.down = _param(cfg.hidden_size, cfg.intermediate_size, dtype=dtype)
        self.down_bias = _param(cfg.hidden_size, dtype=dtype) if cfg.mlp_bias else None
        self.input_norm = _param(cfg.hidden_size, dtype=dtype)
        self.post_attn_norm = _param(cfg.hidden_size, dtype=dtype)
        self.q_norm = _param(cfg.head_dim, dtype=dtype) if cfg.qk_norm else None
        self.k_norm = _param(cfg.head_dim, dtype=dtype) if cfg.qk_norm else None
        self.scale = cfg.head_dim ** -0.5
        self.linears: dict[str, object] = {}   # name -> prepared weight (prepare_linears)

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

    def weight_slots(self, prefix: str) -> dict[str, tuple[nn.Parameter, int, int]]:
        """HF tensor name -> (our parameter, first row, end row)."""
        q, kv, inter = self.q_size, self.kv_size, self.cfg.intermediate_size
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        slots = {
            attn + "q_proj.weight": (self.qkv, 0, q),
            attn + "k_proj.weight": (self.qkv, q, q + kv),
            attn + "v_proj.weight": (self.qkv, q + kv, q + 2 * kv),
            attn + "o_proj.weight": (self.o, 0, self.o.shape[0]),
            mlp + "gate_proj.weight": (self.gate_up, 0, inter),
            mlp + "up_proj.weight": (self.gate_up, inter, 2 * inter),
            mlp + "down_proj.weight": (self.down, 0, self.down.shape[0]),
            prefix + "input_layernorm.weight": (self.input_norm, 0, self.cfg.hidden_size),
            prefix + "post_attention_layernorm.weight": (self.post_attn_norm, 0, self.cfg.hidden_size),
        }
        if self.qkv_bias is not None:
            slots[attn + "q_proj.bias"] = (self.qkv_bias, 0, q)
            slots[attn + "k_proj.bias"] = (self.qkv_bias, q, q + kv)
            slots[attn + "v_proj.bias"] = (self.qkv_bias, q + kv, q + 2 * kv)
        if self.o_bias is not None:
            slots[attn + "o_proj.bias"] = (self.o_bias, 0, self.o_bias.shape[0])
        if self.gate_up_bias is not None:
            slots[mlp + "gate_proj.bias"] = (self.gate_up_bias, 0, inter)
            slots[mlp + "up_proj.bias"] = (self.gate_up_bias, inter, 2 * inter)
            slots[mlp + "down_proj.bias"] = (self.down_bias, 0, self.down_bias.shape[0])
        if self.q_norm is not None:
            slots[attn + "q_norm.weight"] = (self.q_norm, 0, self.cfg.head_dim)
            slots[attn + "k_norm.weight"] = (self.k_norm, 0, self.cfg.head_dim)
        return slots

    def attention(self, x: torch.Tensor, batch: StepBatch, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, backend: Backend, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
        cfg, n = self.cfg, x.shape[0]
        linears = self.linears
        qkv = backend.linear(x, linears["qkv"], self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, cfg.num_heads, cfg.head_dim)
        k = k.view(n, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(n, cfg.num_kv_heads, cfg.head_dim)
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
        return backend.linear(out.reshape(n, self.q_size), linears["o"], self.o_bias)

    def mlp(self, x: torch.Tensor, backend: Backend) -> torch.Tensor:
        linears = self.linears
        gate, up = backend.linear(x, linears["gate_up"], self.gate_up_bias).chunk(2, dim=-1)
        return backend.linear(F.silu(gate) * up, linears["down"], self.down_bias)


class CausalLM(nn.Module):
    """Inference-only decoder. `forward` returns final hidden states; `logits` projects the
    rows that need sampling."""

    def __init__(self, cfg: ModelConfig, backend: Backend, dtype: torch.dtype = torch.float32,
                 max_positions: int | None = None):
        super().__init__()
        self.cfg, self.backend, self.dtype = cfg, backend, dtype
        self.embed = _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype) for _ in range(cfg.num_layers))
        self.norm = _param(cfg.hidden_size, dtype=dtype)
        self.lm_head = self.embed if cfg.tie_word_embeddings else _param(
            cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        cos, sin = rope_cos_sin(inv_freq, max_positions or cfg.max_position_embeddings)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.lm_linear = None    # lm_head as the backend multiplies it (prepare_linears)
        self.dense_bytes: dict[str, int] = {}   # parameter name -> bytes before prepare_linears

    def weight_slots(self) -> dict[str, tuple[nn.Parameter, int, int]]:
        slots = {"model.embed_tokens.weight": (self.embed, 0, self.cfg.vocab_size),
                 "model.norm.weight": (self.norm, 0, self.cfg.hidden_size)}
        if not self.cfg.tie_word_embeddings:
            slots["lm_head.weight"] = (self.lm_head, 0, self.cfg.vocab_size)
        for i, layer in enumerate(self.layers):
            slots.update(layer.weight_slots(f"model.layers.{i}."))
        return slots

    @torch.inference_mode()
    def load_weights(self, model_dir: str | Path) -> None:
        """Copy a checkpoint into the fused parameters. ValueError naming the file and the
        tensor on a shape mismatch; naming the tensors when any is missing."""
        slots = self.weight_slots()
        loaded: set[str] = set()
        for name, tensor, path in iter_checkpoint(model_dir):
            slot = slots.get(name)
            if slot is None:
                if name == "lm_head.weight" or name.endswith(IGNORED_SUFFIXES):
                    continue  # tied checkpoints may still carry lm_head
                raise ValueError(f"{path}: unexpected tensor {name!r} for {self.cfg.architecture}")
            param, start, end = slot
            want = (end - start, *param.shape[1:])
            if tuple(tensor.shape) != want:
                raise ValueError(f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {want} from config.json")
            param.data[start:end].copy_(tensor)
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
        h = F.embedding(input_ids, self.embed)
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
            self.lm_linear = self.lm_head     # the embedding lookup needs the dense matrix
        else:
            dense = self.lm_head.data
            self.lm_linear = self.backend.prepare_linear(dense)
            if self.lm_linear is not dense:
                self.lm_head.data = dense.new_empty(0)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.backend.linear(hidden, self.lm_linear, None).float()
