"""Model registry: the `architectures` name of a config.json -> the family's class,
imported lazily (so reading a config never imports torch or a model file).

A new family is one file under models/ and one row here."""
from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from common.model.config import ModelConfig
    from common.model.layers.quant_config import QuantizationConfig
    from common.parallel.shard import TPShard
    from kernels import Backend


@dataclass(frozen=True)
class Family:
    model_type: str     # the config-level variant (biases, q/k norms) common/model/config.py resolves
    module: str
    class_name: str


_LLAMA = "common.model.models.llama"
ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": Family("llama", _LLAMA, "LlamaForCausalLM"),
    "MistralForCausalLM": Family("mistral", _LLAMA, "LlamaForCausalLM"),
    "Qwen2ForCausalLM": Family("qwen2", _LLAMA, "LlamaForCausalLM"),
    "Qwen3ForCausalLM": Family("qwen3", _LLAMA, "LlamaForCausalLM"),
    "Qwen3MoeForCausalLM": Family("qwen3_moe", _LLAMA, "LlamaForCausalLM"),
    "MixtralForCausalLM": Family("mixtral", _LLAMA, "LlamaForCausalLM"),
    "DeepseekV2ForCausalLM": Family("deepseek_v2", "common.model.models.deepseek", "DeepseekForCausalLM"),
    "DeepseekV3ForCausalLM": Family("deepseek_v3", "common.model.models.deepseek", "DeepseekForCausalLM"),
}


def model_class(architecture: str) -> type:
    """ValueError naming the allowed architectures for an unknown one."""
    family = ARCHITECTURES.get(architecture)
    if family is None:
        raise ValueError(f"architecture {architecture!r} is not supported; allowed: {sorted(ARCHITECTURES)}")
    return getattr(import_module(family.module), family.class_name)


def build_model(cfg: ModelConfig, backend: Backend, dtype: torch.dtype, max_positions: int | None = None,
                shard: TPShard | None = None, quant: QuantizationConfig | None = None):
    """An empty model of cfg's family (load_weights, .to(device), prepare_linears next)."""
    return model_class(cfg.architecture)(cfg, backend, dtype, max_positions=max_positions, shard=shard,
                                         quant=quant)
