"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, and the MoE ones, Qwen3-MoE and
Mixtral; DeepSeek-V2/V3 in models/deepseek.py): an attention variant and an MLP variant per
layer, pre-norm residuals, over a paged KV cache. Attention: GQA (layers/attention.py), or
MLA over a latent cache (layers/mla.py) when the config has a kv_lora_rank; MLP: gated
dense, or a sparse MoE (layers/moe.py) on the config's MoE layers.

    h = embed(ids)
    for each layer:  h += attn(rms(h));  h += mlp(rms(h))
    hidden = rms(h);  logits = lm_head(hidden rows that sample)

(each `h += sublayer` is folded into the norm after it: backend.add_rms_norm)

The families differ only in config (biases, Qwen3's q/k norms, tied head, routers),
resolved in common/model/config.py. KV cache: one tensor [num_layers, kv_planes,
num_blocks, block_size, num_kv_heads, head_dim]; layer l's attention gets kv_cache[l]: GQA
reads [0] (keys) and [1] (values), MLA its one latent plane [0].
Layers, linear methods and tensor-parallel sharding live in common/model/layers/.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from common.model.config import ModelConfig
from common.model.layers.attention import GQAAttention
from common.model.layers.embedding import LMHead, VocabEmbedding
from common.model.layers.linear import Linear
from common.model.layers.mla import MLAAttention
from common.model.layers.mlp import GatedMLP
from common.model.layers.moe import SparseMoE
from common.model.layers.moe_router import router_config
from common.model.layers.norm import RMSNorm
from common.model.layers.quant_config import FloatConfig, QuantizationConfig
from common.model.layers.weight_slots import Slot
from common.model.loading import load_weights
from common.model.step_batch import StepBatch
from common.parallel.shard import TPShard, whole_model
from kernels import Backend, rope_attention_factor, rope_cos_sin, rope_inv_freq

if TYPE_CHECKING:
    from common.parallel.group import TPGroup


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: TPShard, quant: QuantizationConfig, index: int,
                 dtype: torch.dtype):
        super().__init__()
        prefix = f"model.layers.{index}."
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        attention = MLAAttention if cfg.uses_mla else GQAAttention
        self.self_attn = attention(cfg, shard, quant, prefix + "self_attn.", dtype)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if index in cfg.moe_layers:
            mixtral = cfg.model_type == "mixtral"
            self.mlp = SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, router_config(cfg), prefix, dtype,
                                 shard, quant, naming="mixtral" if mixtral else "qwen3_moe",
                                 shared_intermediate_size=cfg.moe_intermediate_size * cfg.n_shared_experts)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, shard, quant, prefix + "mlp.", dtype,
                                bias=cfg.mlp_bias)

    def weight_slots(self, prefix: str) -> dict[str, Slot]:
        return {**self.input_norm.weight_slots(prefix + "input_layernorm"),
                **self.self_attn.weight_slots(prefix + "self_attn."),
                **self.post_attn_norm.weight_slots(prefix + "post_attention_layernorm"),
                **self.mlp.weight_slots(prefix + "mlp.")}


class LlamaForCausalLM(nn.Module):
    """Inference-only. `forward` returns final hidden states; `logits` projects the rows
    that need sampling. Build, `load_weights`, `.to(device)`, `prepare_linears`, then run;
    at tensor parallelism `attach_group` before the first forward."""

    def __init__(self, cfg: ModelConfig, backend: Backend, dtype: torch.dtype = torch.float32,
                 max_positions: int | None = None, shard: TPShard | None = None,
                 quant: QuantizationConfig | None = None):
        super().__init__()
        self.cfg, self.backend, self.dtype = cfg, backend, dtype
        self.shard = sh = shard or whole_model(cfg)
        self.quant = quant = quant or FloatConfig()
        if cfg.uses_mla and quant.kv_cache_int8:
            raise ValueError("kv_cache_type C8 (an int8 KV cache) is not supported for MLA models: their cache holds "
                             "the latent, not per-head K and V; use a checkpoint without it")
        self.embed = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, sh, dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, sh, quant, i, dtype) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, sh, dtype,
                              tied_to=self.embed if cfg.tie_word_embeddings else None)
        self.group: TPGroup | None = None
        inv_freq = rope_inv_freq(cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling)
        cos, sin = rope_cos_sin(inv_freq, max_positions or cfg.max_position_embeddings,
                                attention_factor=rope_attention_factor(cfg.rope_scaling))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.dense_bytes: dict[str, int] = {}   # parameter name -> bytes as loaded (an int8 head's: its codes and scales)
        self.kv_cache_dtype = torch.int8 if quant.kv_cache_int8 else dtype
        self.kv_scales_id = ""      # a C8 model's, set by whoever loads it (common/runner/model_runner.py)

    def weight_slots(self) -> dict[str, Slot]:
        slots = {**self.embed.weight_slots("model.embed_tokens"), **self.norm.weight_slots("model.norm"),
                 **self.lm_head.weight_slots("lm_head")}
        for i, layer in enumerate(self.layers):
            slots.update(layer.weight_slots(f"model.layers.{i}."))
        return slots

    def ignored_tensors(self) -> tuple[set[str], tuple[str, ...]]:
        # a tied checkpoint may still carry a copy of the head; older ones their rotary tables;
        # under expert parallelism the other ranks' experts are theirs to read
        names = {"lm_head.weight"} if self.cfg.tie_word_embeddings else set()
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoE):
                names |= layer.mlp.other_ranks_tensors()
        return names, ("rotary_emb.inv_freq",)

    def load_weights(self, model_dir: str | Path) -> None:
        """The checkpoint (a HF folder or a .gguf file) into the parameters; a shard reads
        only its slices. ValueError naming the file and the tensor on a shape mismatch or
        an unexpected tensor; naming the tensors when any is missing."""
        loaded = load_weights(self, model_dir, self.dtype, self.cfg.architecture)
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.check_layout(loaded)

    def linears(self) -> Iterator[tuple[str, Linear]]:
        return ((name, m) for name, m in self.named_modules() if isinstance(m, Linear))

    def attach_group(self, group: TPGroup, moe_dispatch: str = "all_reduce") -> None:
        """The rank's tensor-parallel group (tensor_parallel_size > 1), before the first
        forward; the collectives run in the same order on every rank. moe_dispatch: the
        MoE layers' (layers/moe_dispatch.py)."""
        self.group = self.embed.group = self.lm_head.group = group
        for _, linear in self.linears():
            linear.attach_group(group)
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.attach_group(group, moe_dispatch)

    def prepare_linears(self, lm_head_int8: bool = False) -> None:
        """After load_weights and .to(device), before the first forward: every linear's
        method processes its weights, and the LM head gets the backend's prepared form
        (lm_head_int8: its int8 form, layers/int8_vocab.py). Once only: a packed
        parameter's dense storage is gone."""
        if self.lm_head.prepared is not None:
            raise RuntimeError("prepare_linears() was already called")
        self.dense_bytes = {name: p.numel() * p.element_size() for name, p in self.named_parameters()}
        for layer in self.layers:
            if isinstance(layer.self_attn, MLAAttention):
                layer.self_attn.absorb()       # needs kv_b_proj's dense weight, before it is packed
        for _, linear in self.linears():
            linear.prepare(self.backend)
        for layer in self.layers:
            if getattr(layer.self_attn, "kv_int8", None) is not None:
                layer.self_attn.kv_int8.prepare()
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.prepare(self.backend)
        self.lm_head.prepare(self.backend, int8=lm_head_int8)
        if lm_head_int8:
            name = "embed.weight" if self.cfg.tie_word_embeddings else "lm_head.weight"
            self.dense_bytes[name] = self.lm_head.int8.nbytes

    def forward(self, input_ids: torch.Tensor, batch: StepBatch, kv_cache: torch.Tensor,
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """on_layer(i), when given, is called on this thread right after layer i's attention
        wrote the step's KV into kv_cache[i] (before its MLP and the layers above): a hook
        for pushing KV layer by layer. On a device the kernels may still be queued then."""
        if self.lm_head.prepared is None:
            raise RuntimeError("prepare_linears() must run after loading, before forward")
        backend, cos, sin = self.backend, self.rope_cos, self.rope_sin
        # the residual stream: the embedding (a tensor of this pass's own); each sublayer's
        # output is added into it in place by the norm that follows (backend.add_rms_norm)
        residual = self.embed(input_ids)
        x = self.layers[0].input_norm(residual, backend)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn(x, batch, kv_cache[i], backend, cos, sin)
            if on_layer is not None:
                on_layer(i)
            mlp = layer.mlp(layer.post_attn_norm(attn, backend, residual), backend)
            next_norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            x = next_norm(mlp, backend, residual)
        return x

    def expert_tokens(self) -> dict[int, torch.Tensor]:
        """Layer index -> tokens routed to each expert [num_experts] since the last call
        (on the CPU, in one copy from the device; the counters restart at zero): expert
        load, for the metrics."""
        moe = [(i, layer.mlp) for i, layer in enumerate(self.layers) if isinstance(layer.mlp, SparseMoE)]
        if not moe:
            return {}
        counts = torch.stack([m.expert_tokens for _, m in moe]).to("cpu")
        for _, m in moe:
            m.expert_tokens.zero_()
        return {i: row for (i, _), row in zip(moe, counts)}

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 [rows, vocab]; at tensor parallelism every rank computes its vocab
        columns and rank 0 gets them all (None on the other ranks)."""
        return self.lm_head(hidden, self.backend)

