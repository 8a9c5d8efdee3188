"""A GGUF model as the HF loaders see one: a config.json dict and HF-named tensors.

`config_dict(file)` maps the `<arch>.*` metadata onto transformers' config keys;
`iter_gguf_tensors(path, ...)` yields every tensor under its HF name, dequantized (gguf's
`quants.dequantize`, float32) and cast to the dtype asked for, with the same contract as
formats/checkpoint.py's iter_checkpoint (slices are applied after dequantizing).

Q/K rows: llama.cpp's converter reorders each head's rows of attn_q / attn_k from HF's
rotate-half layout (first half of the rotary pairs, then the second) to the interleaved
one its rope kernel wants (pairs adjacent):

    HF row of head h      [h, half, i]   (half in 0..1, i in 0..head_dim/2)
    GGUF row of head h    [h, i, half]

`_unpermute` swaps the two inner axes back (attn_q over num_heads, attn_k over
num_kv_heads), which is the inverse of convert_hf_to_gguf.py's `permute` and the same
reordering transformers applies when it loads a GGUF.

Supported: general.architecture in GGUF_ARCHITECTURES, tensor types in SUPPORTED_TYPES. Any
other value is a ValueError naming the file, the key or tensor, and the allowed values.
"""
from __future__ import annotations

import re
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize
from tqdm import tqdm

from common.model.formats.gguf_reader import GGUFFile, TensorInfo, read_gguf
from common.model.formats.gguf_tokenizer import eog_token_ids

GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM"}
SUPPORTED_TYPES = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1,
                   T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)
ROPE_SCALING_TYPES = ("none", "linear")

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
                "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def hf_name(name: str) -> str | None:
    """The HF parameter name of a GGUF tensor name (llama family), None if unknown."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_RE.fullmatch(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"
    return None


def config_dict(file: GGUFFile) -> dict[str, Any]:
    """The HF config.json of the model in `file`; ValueError naming the key, the tensor or
    the tensor type that is missing or not supported."""
    path, meta = file.path, file.metadata
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: general.architecture={arch!r} is not supported; allowed: {sorted(GGUF_ARCHITECTURES)}")

    def need(key: str) -> Any:
        key = f"{arch}.{key}"
        if key not in meta:
            raise ValueError(f"{path}: metadata key {key!r} is missing")
        return meta[key]

    hidden, num_heads = int(need("embedding_length")), int(need("attention.head_count"))
    num_kv_heads = meta.get(f"{arch}.attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):      # per layer in some files
        if len(set(num_kv_heads)) != 1:
            raise ValueError(f"{path}: {arch}.attention.head_count_kv differs between layers "
                             f"({sorted(set(num_kv_heads))}); only one value is supported")
        num_kv_heads = num_kv_heads[0]
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // num_heads))
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"{path}: {arch}.rope.dimension_count={rope_dim} (partial rotary) is not "
                         f"supported; allowed: the head dim {head_dim}")
    _check_tensors(file)
    if "token_embd.weight" not in file.tensors:
        raise ValueError(f"{path}: tensor 'token_embd.weight' (the embedding) is missing")
    vocab = meta.get(f"{arch}.vocab_size") or file.tensors["token_embd.weight"].shape[0]
    cfg = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(num_kv_heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 4096)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in file.tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eog_token_ids(meta),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ROPE_SCALING_TYPES:
        raise ValueError(f"{path}: {arch}.rope.scaling.type={scaling!r} is not supported; "
                         f"allowed: {list(ROPE_SCALING_TYPES)}")
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(need("rope.scaling.factor"))}
    return cfg


def _check_tensors(file: GGUFFile) -> None:
    allowed = [t.name for t in SUPPORTED_TYPES]
    for info in file.tensors.values():
        if info.name == "rope_freqs.weight":
            raise ValueError(f"{file.path}: tensor 'rope_freqs.weight' (llama3-style rope frequency "
                             f"factors) is not supported")
        if hf_name(info.name) is None:
            raise ValueError(f"{file.path}: tensor {info.name!r} is not a llama tensor; allowed: "
                             f"{sorted(_GLOBAL_NAMES)} and blk.N.{{{','.join(_LAYER_NAMES)}}}.weight")
        if info.ggml_type not in SUPPORTED_TYPES:
            raise ValueError(f"{file.path}: tensor {info.name!r} has type {info.ggml_type.name}, "
                             f"which is not supported; allowed: {allowed}")


def dequantized(file: GGUFFile, info: TensorInfo) -> torch.Tensor:
    """The tensor in float32, in torch's shape (a fresh tensor, not a view of the file)."""
    array = dequantize(file.tensor_bytes(info), info.ggml_type)
    if not array.flags.writeable or array.dtype != np.float32:   # F32 is a view of the mapped file
        array = array.astype(np.float32, copy=True)
    return torch.from_numpy(array.reshape(info.shape))


def _unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, -1).transpose(1, 2).reshape(weight.shape)


def iter_gguf_tensors(path: str | Path, progress: TextIO | None = None,
                      slices: Mapping[str, tuple[slice, ...]] | None = None, with_shape: bool = False,
                      dtype: torch.dtype = torch.float32) -> Iterator[tuple]:
    """(hf name, tensor, path) or, with_shape, (hf name, tensor, path, full shape), one
    tensor at a time: dequantized, Q/K rows put back in HF order, sliced by slices[name],
    then cast to dtype (contiguous; never a view of the file). A tqdm bar of the file's
    tensor bytes goes to progress (None: stderr, shown only when it is a terminal)."""
    file = read_gguf(path)
    cfg = config_dict(file)     # validates the architecture and every tensor's type
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    slices = slices or {}
    total = sum(info.num_bytes for info in file.tensors.values())
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="dequantizing weights",
               file=progress if progress is not None else sys.stderr,
               disable=None if progress is None else False, mininterval=0.5)
    with bar:
        for i, info in enumerate(file.tensors.values(), 1):
            name = hf_name(info.name)
            tensor = dequantized(file, info)
            kind = info.name.split(".")[-2]
            if kind in heads:
                tensor = _unpermute(tensor, heads[kind])
            full_shape = tuple(tensor.shape)
            if name in slices:
                try:
                    tensor = tensor[slices[name]]
                except IndexError as e:
                    raise ValueError(f"{file.path}: tensor {name!r} of shape {full_shape} cannot be "
                                     f"read as {slices[name]} ({e})") from None
            tensor = tensor.to(dtype).contiguous()
            if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
                tensor = tensor.clone()     # a slice: not the whole tensor's storage
            bar.set_postfix_str(f"tensors {i}/{len(file.tensors)}", refresh=False)
            bar.update(info.num_bytes)
            yield (name, tensor, file.path, full_shape) if with_shape else (name, tensor, file.path)
