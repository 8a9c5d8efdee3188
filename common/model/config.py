"""Hugging Face `config.json` (or a .gguf file's metadata, formats/gguf.py) -> frozen ModelConfig.

Reads both the transformers 4.x spelling (`rope_theta`, `rope_scaling`) and the 5.x one
(`rope_parameters`). Everything the model code needs is resolved here, so the model never
looks at the raw dict.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.model.registry import ARCHITECTURES


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    sliding_window: int | None = None
    # Mixture of Experts (layers/moe.py): the layers whose MLP is sparse, and its router
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_routing: str = "softmax"           # layers/moe_router.py ROUTING
    n_group: int = 1                       # DeepSeek's grouped routers
    topk_group: int = 1
    topk_method: str = "greedy"            # DeepSeek-V2
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0              # DeepSeek: one dense MLP of n * moe_intermediate_size
    # Multi-head latent attention (DeepSeek-V2/V3, layers/mla.py) when kv_lora_rank > 0: the
    # cache holds one latent "head" (num_kv_heads 1, head_dim kv_lora_rank + qk_rope_head_dim)
    q_lora_rank: int = 0                   # 0: one q_proj, no low-rank query
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False          # rotary pairs (x0, x1), (x2, x3), ... (DeepSeek's layout)
    num_nextn_predict_layers: int = 0      # DeepSeek-V3's multi-token-prediction layers (not run)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def uses_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def kv_planes(self) -> int:
        """The KV cache's dim 1: K and V (2), or MLA's one latent (1; a backend that wants
        the latent in two planes gets a SplitLatentCache instead: common/runner/model_runner.py)."""
        return 1 if self.uses_mla else 2

    @property
    def rope_dim(self) -> int:
        """The width rotary embedding turns: a head's, or MLA's rope part."""
        return self.qk_rope_head_dim if self.uses_mla else self.head_dim


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = raw.get("rope_parameters") or {}
    theta = float(raw.get("rope_theta", params.get("rope_theta", 10000.0)))
    scaling = raw.get("rope_scaling")
    if scaling is None and params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        scaling = None if rope_type == "default" else {**scaling, "rope_type": rope_type}
    return theta, scaling or None


def model_config_from_dict(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Build a ModelConfig; ValueError names `source` and the offending field."""
    archs = raw.get("architectures") or []
    known = [a for a in archs if a in ARCHITECTURES]
    if not known:
        raise ValueError(f"{source}: architectures={archs} is not supported; "
                         f"allowed: {sorted(ARCHITECTURES)}")
    arch = known[0]
    kind = ARCHITECTURES[arch].model_type
    try:
        hidden = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        cfg_fields = dict(
            vocab_size=int(raw["vocab_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
        )
    except KeyError as e:
        raise ValueError(f"{source}: missing required field {e.args[0]!r}") from None
    num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
    mla = _mla(raw, kind, source)     # its num_key_value_heads means nothing: one latent is cached
    if not mla and num_heads % num_kv_heads:
        raise ValueError(f"{source}: num_attention_heads={num_heads} must be a multiple of "
                         f"num_key_value_heads={num_kv_heads}")
    head_dim = int(raw.get("head_dim") or hidden // num_heads)
    theta, scaling = _rope(raw)
    if kind == "qwen2":
        qkv_bias = True
    else:
        qkv_bias = bool(raw.get("attention_bias", False))
    sliding = raw.get("sliding_window") if raw.get("use_sliding_window", kind in ("mistral", "mixtral")) else None
    moe = _moe(raw, kind, cfg_fields["num_layers"], cfg_fields["intermediate_size"], source)
    if mla:
        num_kv_heads, head_dim = 1, mla["kv_lora_rank"] + mla["qk_rope_head_dim"]
        qkv_bias = False        # MLA's attention_bias is its down-projections' (layers/mla.py)
    return ModelConfig(
        architecture=arch,
        model_type=kind,
        hidden_size=hidden,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=bool(raw.get("attention_bias", False)) and kind != "qwen2",
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=kind in ("qwen3", "qwen3_moe"),
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw.get("eos_token_id")),
        sliding_window=int(sliding) if sliding else None,
        **moe,
        **mla,
        **cfg_fields,
    )


def _mla(raw: dict[str, Any], kind: str, source: str) -> dict[str, Any]:
    """The latent-attention fields of a DeepSeek-V2/V3 config ({} otherwise); a field the
    file leaves out takes transformers' default, one it sets to null is refused by name
    (q_lora_rank: null means one q_proj)."""
    if kind not in ("deepseek_v2", "deepseek_v3"):
        return {}
    defaults = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    mla = {name: _int_field(raw, name, default, source) for name, default in defaults.items()}
    mla.update(q_lora_rank=int(raw.get("q_lora_rank", 1536) or 0),
               # transformers' DeepSeek-V2 always turns interleaved pairs; V3 has the switch
               rope_interleave=kind == "deepseek_v2" or bool(raw.get("rope_interleave", True)),
               # hub configs' name, then transformers 5's
               num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers", raw.get("num_mtp_layers", 1)) or 0)
               if kind == "deepseek_v3" else 0)
    for name in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
        if mla[name] < 1:
            raise ValueError(f"{source}: {name} must be >= 1, got {mla[name]}")
    if mla["qk_rope_head_dim"] % 2:
        raise ValueError(f"{source}: qk_rope_head_dim must be even, got {mla['qk_rope_head_dim']}")
    return mla


def _int_field(raw: dict[str, Any], name: str, default: int, source: str) -> int:
    value = raw.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{source}: {name} must be an integer, got {value!r}")
    return value


def _moe(raw: dict[str, Any], kind: str, num_layers: int, intermediate: int, source: str) -> dict[str, Any]:
    """The MoE fields of a Qwen3-MoE or Mixtral config ({} for a dense family). Qwen3-MoE:
    layer i is sparse if i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0;
    Mixtral: every layer, its experts intermediate_size wide, always renormalised. Both
    spellings of the expert count (num_experts, num_local_experts) are read."""
    if kind in ("deepseek_v2", "deepseek_v3"):
        return _deepseek_moe(raw, kind, num_layers, source)
    if kind not in ("qwen3_moe", "mixtral"):
        return {}
    experts = raw.get("num_experts") or raw.get("num_local_experts")
    if not experts or not raw.get("num_experts_per_tok"):
        raise ValueError(f"{source}: a {kind} config needs num_experts (or num_local_experts) and num_experts_per_tok")
    if kind == "mixtral":
        return dict(moe_layers=tuple(range(num_layers)), num_experts=int(experts),
                    num_experts_per_tok=int(raw["num_experts_per_tok"]), moe_intermediate_size=intermediate,
                    norm_topk_prob=True)
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    dense = set(raw.get("mlp_only_layers") or ())
    return dict(moe_layers=tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0),
                num_experts=int(experts), num_experts_per_tok=int(raw["num_experts_per_tok"]),
                moe_intermediate_size=int(raw.get("moe_intermediate_size") or intermediate),
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)))


# transformers' defaults for a field a DeepSeek config leaves out (released configs set them all)
DEEPSEEK_MOE_DEFAULTS = {
    "deepseek_v3": dict(first_k_dense_replace=3, moe_intermediate_size=2048, n_shared_experts=1, n_group=8,
                        topk_group=4, topk_method="noaux_tc", norm_topk_prob=True, routed_scaling_factor=2.5),
    "deepseek_v2": dict(first_k_dense_replace=0, moe_intermediate_size=1407, n_shared_experts=2, n_group=1,
                        topk_group=1, topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0),
}


def _deepseek_moe(raw: dict[str, Any], kind: str, num_layers: int, source: str) -> dict[str, Any]:
    """DeepSeek-V2/V3: layer i is sparse if i >= first_k_dense_replace and i % moe_layer_freq
    == 0 (DeepSeek's own rule; transformers' omits the frequency, 1 in every released config);
    V3 routes by grouped sigmoid scores, V2 by softmax (greedy or group-limited)."""
    experts, top_k = raw.get("n_routed_experts"), raw.get("num_experts_per_tok")
    if not experts or not top_k:
        raise ValueError(f"{source}: a {kind} config needs n_routed_experts and num_experts_per_tok")
    d = DEEPSEEK_MOE_DEFAULTS[kind]

    def get(name: str):
        value = raw.get(name)
        return d[name] if value is None else value

    first_dense, freq = int(get("first_k_dense_replace")), int(raw.get("moe_layer_freq", 1) or 1)
    return dict(moe_layers=tuple(i for i in range(num_layers) if i >= first_dense and i % freq == 0),
                num_experts=int(experts), num_experts_per_tok=int(top_k),
                moe_intermediate_size=int(get("moe_intermediate_size")), norm_topk_prob=bool(get("norm_topk_prob")),
                moe_routing=kind, n_group=int(get("n_group")), topk_group=int(get("topk_group")),
                topk_method=str(get("topk_method")), routed_scaling_factor=float(get("routed_scaling_factor")),
                n_shared_experts=int(get("n_shared_experts")))


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """The config of a HF model folder (its config.json) or of a .gguf file (its metadata)."""
    from common.model.formats import is_gguf
    if is_gguf(model_dir):
        from common.model.formats.gguf import config_dict
        from common.model.formats.gguf_reader import read_gguf
        return model_config_from_dict(config_dict(read_gguf(model_dir)), source=str(model_dir))
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no config.json in the model folder")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from None
    return model_config_from_dict(raw, source=str(path))
