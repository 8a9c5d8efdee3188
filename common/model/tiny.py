"""Tiny random Llama / Qwen2 / Qwen3 / Qwen3-MoE / DeepSeek-V3 checkpoints in Hugging Face
folder format (DeepSeek's MLA and MoE tensors: tiny_deepseek.py).

`make_tiny_model(arch, out_dir, seed)` writes, deterministically (same arguments -> the
same bytes in every file):

    config.json               architectures, model_type, sizes, rope_theta/rope_scaling,
                              bos/eos ids, torch_dtype + dtype "float32"
    model.safetensors         HF tensor names, float32 (or sharded, see shard_safetensors)
    tokenizer.json            byte-level BPE trained on tiny_corpus.CORPUS
    tokenizer_config.json     PreTrainedTokenizerFast, bos/eos/pad, add_bos_token, chat_template
    generation_config.json    bos_token_id, eos_token_id

Weights are drawn from one torch.Generator in a fixed order, with scales chosen so the
logits are not flat (see _INIT): logits std ~4, sharp attention, residual updates large
next to the embeddings (else a tied model just repeats its input token). Greedy decoding
then yields varied tokens and clear top-2 margins (median ~6e-2 relative), which
token-for-token comparisons against transformers need. Special tokens' output rows are
shrunk, so greedy decoding practically never emits eos: runs last max_tokens.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from common.model.tiny_deepseek import deepseek_fields, mla_tensors, moe_tensors
from common.model.tiny_tokenizer import tokenizer_config, train_tiny_tokenizer

ARCHS = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen"),
    "qwen3": ("Qwen3ForCausalLM", "qwen"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen"),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "llama"),
}
MOE_ARCHS = ("qwen3_moe", "deepseek_v3")
MOE_DEFAULTS = {"num_experts": 8, "num_experts_per_tok": 2}     # qwen3_moe: every layer sparse
# Standard deviations: linear layers use gain / sqrt(fan_in); embeddings and lm_head are
# scaled so that a unit-RMS hidden state gives logits with std ~= "logit_std".
_INIT = {
    "embed_std": 0.25,
    "logit_std": 4.0,
    "qk_gain": 2.0,
    "v_gain": 1.0,
    "mlp_gain": 1.0,
    "out_gain": 3.0,
    "bias_std": 0.2,
    "norm_jitter": 0.1,
    "special_logit_scale": 0.1,
    "qk_norm_mean": 2.0,  # qwen3: q.k/sqrt(d) std ~4, as qk_gain gives llama/qwen2
    "router_gain": 2.0,   # qwen3_moe: router logit std ~2, clear top-k margins
}


def make_tiny_model(
    arch: str,
    out_dir: str | Path,
    seed: int = 0,
    *,
    hidden_size: int = 256,
    num_layers: int = 4,
    num_heads: int = 8,
    num_kv_heads: int = 4,
    intermediate_size: int | None = None,
    vocab_size: int = 1024,
    max_position_embeddings: int = 4096,
    head_dim: int | None = None,
    tie_word_embeddings: bool | None = None,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    max_shard_bytes: int | None = None,
    num_experts: int | None = None,
    num_experts_per_tok: int | None = None,
) -> Path:
    """Write a tiny random HF checkpoint of `arch` into `out_dir` (created) and return it.

    intermediate_size defaults to 2.75 * hidden_size rounded to a multiple of 64;
    head_dim to hidden_size // num_heads (qwen2 allows no other value);
    tie_word_embeddings to True for qwen2 and False otherwise. qwen3_moe: every layer
    sparse, num_experts (8) experts of intermediate_size // 4 (rounded up to 16), top
    num_experts_per_tok (2), renormalised; per-expert tensor names. deepseek_v3: MLA
    attention (num_kv_heads unused), layer 0 dense, the others MoE as qwen3_moe's plus a
    shared expert and DeepSeek-V3's router (tiny_deepseek.py). With max_shard_bytes the
    weights are split by `shard_safetensors`. Existing files of the same names are
    overwritten; other files in out_dir are left alone.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
    default_head_dim = hidden_size // num_heads
    head_dim = head_dim or default_head_dim
    if arch == "qwen2" and head_dim * num_heads != hidden_size:
        raise ValueError(f"qwen2 needs head_dim == hidden_size // num_heads ({default_head_dim}), got {head_dim}")
    if intermediate_size is None:
        intermediate_size = max(64, round(hidden_size * 2.75 / 64) * 64)
    if tie_word_embeddings is None:
        tie_word_embeddings = arch == "qwen2"

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tiny = train_tiny_tokenizer(ARCHS[arch][1], vocab_size)
    bos_id, eos_id = tiny.token_id(tiny.bos_token), tiny.token_id(tiny.eos_token)
    config = _hf_config(
        arch, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads, intermediate_size=intermediate_size, vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings, head_dim=head_dim,
        tie_word_embeddings=tie_word_embeddings, rope_theta=rope_theta, rope_scaling=rope_scaling,
        bos_token_id=bos_id if bos_id is not None else eos_id, eos_token_id=eos_id,
    )
    if arch in MOE_ARCHS:
        experts = num_experts or MOE_DEFAULTS["num_experts"]
        top_k = num_experts_per_tok or MOE_DEFAULTS["num_experts_per_tok"]
        if not 1 <= top_k <= experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={experts}], got {top_k}")
        if arch == "deepseek_v3":
            if experts % 4 or experts < 8:
                raise ValueError(f"num_experts must be a multiple of 4 (the router's 4 groups), >= 8, got {experts}")
            config.update(deepseek_fields(hidden_size, intermediate_size, experts, top_k, rope_scaling),
                          num_key_value_heads=num_heads)      # as released: MLA has no KV heads of its own
        else:
            config.update(num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], moe_intermediate_size=-(-intermediate_size // 64) * 16)
    elif num_experts or num_experts_per_tok:
        raise ValueError(f"num_experts and num_experts_per_tok are for archs {', '.join(MOE_ARCHS)}, not {arch!r}")
    special_ids = sorted(tiny.tokenizer.get_added_tokens_decoder())
    tensors = _random_weights(arch, config, seed, special_ids)
    for stale in [out / "model.safetensors.index.json", *out.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if ARCHS[arch][1] == "llama":
        gen_eos: int | list[int] = eos_id
    else:  # like Qwen instruct checkpoints: <|im_end|> and <|endoftext|> both stop
        gen_eos = [tiny.token_id("<|im_end|>"), eos_id]
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {"bos_token_id": config["bos_token_id"], "eos_token_id": gen_eos})
    _write_json(out / "tokenizer_config.json", tokenizer_config(tiny, max_position_embeddings))
    (out / "tokenizer.json").write_text(tiny.tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    if max_shard_bytes is not None:
        shard_safetensors(out, max_shard_bytes)
    return out


def _hf_config(arch: str, **kw) -> dict:
    architecture, _ = ARCHS[arch]
    config = {
        "architectures": [architecture],
        "model_type": arch,
        "hidden_size": kw["hidden_size"],
        "intermediate_size": kw["intermediate_size"],
        "num_hidden_layers": kw["num_layers"],
        "num_attention_heads": kw["num_heads"],
        "num_key_value_heads": kw["num_kv_heads"],
        "head_dim": kw["head_dim"],
        "hidden_act": "silu",
        "max_position_embeddings": kw["max_position_embeddings"],
        "rms_norm_eps": 1e-5 if ARCHS[arch][1] == "llama" else 1e-6,
        "rope_theta": kw["rope_theta"],
        "rope_scaling": kw["rope_scaling"],
        "vocab_size": kw["vocab_size"],
        "tie_word_embeddings": kw["tie_word_embeddings"],
        "bos_token_id": kw["bos_token_id"],
        "eos_token_id": kw["eos_token_id"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    if ARCHS[arch][1] == "llama":
        config.update(mlp_bias=False, pretraining_tp=1)
    else:  # like released Qwen2.5 / Qwen3 configs: a window size that is switched off
        config.update(
            use_sliding_window=False,
            sliding_window=kw["max_position_embeddings"],
            max_window_layers=kw["num_layers"],
        )
    if arch == "qwen2":  # Qwen2 has no head_dim field and always biases q/k/v
        del config["head_dim"], config["attention_bias"]
    return config


def _random_weights(arch: str, config: dict, seed: int, special_ids: list[int]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    num_heads, num_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim", hidden // num_heads)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * std).to(torch.float32)

    def norm(n: int) -> torch.Tensor:
        return 1.0 + normal(n, std=_INIT["norm_jitter"])

    def linear(n_out: int, n_in: int, gain: float) -> torch.Tensor:
        return normal(n_out, n_in, std=gain / math.sqrt(n_in))

    t: dict[str, torch.Tensor] = {}
    t["model.embed_tokens.weight"] = normal(config["vocab_size"], hidden, std=_INIT["embed_std"])
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(hidden)
        if arch == "deepseek_v3":
            t.update(mla_tensors(p, config, linear, norm, _INIT))
            t[p + "post_attention_layernorm.weight"] = norm(hidden)
            if i >= config["first_k_dense_replace"]:
                t.update(moe_tensors(p, config, linear, normal, _INIT))
                continue
            t.update(_dense_mlp(p, hidden, inter, linear))
            continue
        t[p + "self_attn.q_proj.weight"] = linear(num_heads * head_dim, hidden, _INIT["qk_gain"])
        t[p + "self_attn.k_proj.weight"] = linear(num_kv_heads * head_dim, hidden, _INIT["qk_gain"])
        t[p + "self_attn.v_proj.weight"] = linear(num_kv_heads * head_dim, hidden, _INIT["v_gain"])
        if arch == "qwen2":
            t[p + "self_attn.q_proj.bias"] = normal(num_heads * head_dim, std=_INIT["bias_std"])
            t[p + "self_attn.k_proj.bias"] = normal(num_kv_heads * head_dim, std=_INIT["bias_std"])
            t[p + "self_attn.v_proj.bias"] = normal(num_kv_heads * head_dim, std=_INIT["bias_std"])
        if arch in ("qwen3", "qwen3_moe"):
            t[p + "self_attn.q_norm.weight"] = _INIT["qk_norm_mean"] * norm(head_dim)
            t[p + "self_attn.k_norm.weight"] = _INIT["qk_norm_mean"] * norm(head_dim)
        t[p + "self_attn.o_proj.weight"] = linear(hidden, num_heads * head_dim, _INIT["out_gain"])
        t[p + "post_attention_layernorm.weight"] = norm(hidden)
        if arch == "qwen3_moe":
            t.update(_random_experts(p + "mlp.", config, linear))
            continue
        t.update(_dense_mlp(p, hidden, inter, linear))
    t["model.norm.weight"] = norm(hidden)
    if config["tie_word_embeddings"]:  # logits = h @ E.T: rescale E to give logit_std
        t["model.embed_tokens.weight"] *= _INIT["logit_std"] / (_INIT["embed_std"] * math.sqrt(hidden))
        out_proj = t["model.embed_tokens.weight"]
    else:
        out_proj = t["lm_head.weight"] = linear(config["vocab_size"], hidden, _INIT["logit_std"])
    # Shrink special tokens' output rows (an input row keeps its direction, which is all
    # RMSNorm sees) so greedy decoding practically never emits eos.
    out_proj[special_ids] *= _INIT["special_logit_scale"]
    return t


def _dense_mlp(prefix: str, hidden: int, inter: int, linear) -> dict[str, torch.Tensor]:
    return {prefix + "mlp.gate_proj.weight": linear(inter, hidden, _INIT["mlp_gain"]),
            prefix + "mlp.up_proj.weight": linear(inter, hidden, _INIT["mlp_gain"]),
            prefix + "mlp.down_proj.weight": linear(hidden, inter, _INIT["out_gain"])}


def _random_experts(prefix: str, config: dict, linear) -> dict[str, torch.Tensor]:
    """A sparse MLP's gate and experts; the gate sharp enough (logit std ~2) that tokens
    spread over the experts with clear top-k margins."""
    hidden, inter = config["hidden_size"], config["moe_intermediate_size"]
    t = {prefix + "gate.weight": linear(config["num_experts"], hidden, _INIT["router_gain"])}
    for e in range(config["num_experts"]):
        p = f"{prefix}experts.{e}."
        t[p + "gate_proj.weight"] = linear(inter, hidden, _INIT["mlp_gain"])
        t[p + "up_proj.weight"] = linear(inter, hidden, _INIT["mlp_gain"])
        t[p + "down_proj.weight"] = linear(hidden, inter, _INIT["out_gain"])
    return t


def shard_safetensors(model_dir: str | Path, max_shard_bytes: int) -> list[Path]:
    """Split model_dir/model.safetensors into HF shards and write the index; return shards.

    Writes model-0000K-of-0000N.safetensors (tensors in their file order, a new shard
    whenever adding a tensor would pass max_shard_bytes; a tensor larger than that gets
    a shard of its own) and model.safetensors.index.json ({"metadata": {"total_size"},
    "weight_map"}), then deletes model.safetensors. Deterministic.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    src = Path(model_dir) / "model.safetensors"
    with safe_open(str(src), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in sorted(f.keys(), key=_tensor_order)}
    groups: list[list[str]] = [[]]
    group_bytes = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and group_bytes + nbytes > max_shard_bytes:
            groups.append([])
            group_bytes = 0
        groups[-1].append(name)
        group_bytes += nbytes
    paths, weight_map = [], {}
    for k, names in enumerate(groups, start=1):
        path = src.with_name(f"model-{k:05d}-of-{len(groups):05d}.safetensors")
        save_file({n: tensors[n] for n in names}, str(path), metadata={"format": "pt"})
        weight_map.update({n: path.name for n in names})
        paths.append(path)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(src.with_name("model.safetensors.index.json"), index)
    src.unlink()
    return paths


def _tensor_order(name: str) -> tuple:
    """embed_tokens, layers by number, norm, lm_head: the order HF writes shards in."""
    parts = name.split(".")
    if len(parts) > 2 and parts[1] == "layers":
        return (1, int(parts[2]), name)
    return (0 if "embed_tokens" in name else 2, 0, name)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
