"""DeepSeek-V2 / V3 (and R1, V3's architecture): the Llama-family decoder of models/llama.py
composed of MLA attention over a latent cache (layers/mla.py) and, from layer
first_k_dense_replace on, a MoE MLP with DeepSeek's router and shared experts
(layers/moe.py, layers/moe_router.py); the layers below are dense.

DeepSeek-V3 checkpoints carry a multi-token-prediction layer after the last decoder layer
(`model.layers.{num_hidden_layers + i}.*`, i < num_nextn_predict_layers, 1 when the config
does not say); transformers does not run it and neither do we: it is skipped by name, none
of its bytes read, and said in the log. Any other tensor
the model does not take is an error (common/model/loading.py).
"""
from __future__ import annotations

from common.model.models.llama import LlamaForCausalLM


class DeepseekForCausalLM(LlamaForCausalLM):
    def ignored_prefixes(self) -> dict[str, str]:
        if self.cfg.model_type != "deepseek_v3":
            return {}
        mtp = "DeepSeek-V3's multi-token-prediction layer (not run, as in transformers)"
        return {f"model.layers.{self.cfg.num_layers + i}.": mtp for i in range(self.cfg.num_nextn_predict_layers)}
