"""Tiny GGUF files for tests, written with gguf.GGUFWriter the way llama.cpp's converter
writes a Llama: Q/K rows reordered for its rope (`llama_cpp_permute`), a byte-level BPE
vocabulary with ChatML control tokens, and whatever tensor type is asked for.

`tiny_llama(path, ...)` returns the transformers model whose weights went in, so a test
compares what pdmesh reads back (or generates) with it.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from common.model.tokenizer import _UNICODE_TO_BYTE

CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BYTE_TOKENS = sorted(_UNICODE_TO_BYTE, key=_UNICODE_TO_BYTE.get)     # byte 0..255 in GPT-2's spelling
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ Ġ", "ĠĠ ĠĠ", "1 2", "12 3", "Ġ 1",
          "Ċ Ċ", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "Ã ©", "ä ½"]
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
                 " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
                 "{{ '<|im_start|>assistant\n' }}{% endif %}")
ROPE_THETA = 50000.0
TOKENS = CONTROL_TOKENS + BYTE_TOKENS + [m.replace(" ", "") for m in MERGES]


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's reordering of attn_q/attn_k rows: per head, HF's two halves
    [half, i] interleaved to [i, half]."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_name(hf_name: str) -> str:
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in names:
        return names[hf_name]
    layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    _, _, index, rest = hf_name.split(".", 3)
    return f"blk.{index}.{layer[rest.removesuffix('.weight')]}.weight"


def hf_tiny_llama(seed: int = 0, tie: bool = False):
    """A random transformers Llama (fp32): 2 layers, hidden 64, 4 heads / 2 KV heads."""
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=len(TOKENS), hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512, rms_norm_eps=1e-5,
                                   rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
                                   tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():   # norms away from 1, so a mixed-up tensor shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return model


def write_tiny_llama(path: str | Path, model, tensor_type=GGMLQuantizationType.F32,
                     arch: str = "llama", pre: str = "gpt-2", tokenizer: bool = True,
                     extra_tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None) -> Path:
    """Write `model` as llama.cpp would; 2-D weights in tensor_type, norms in F32.
    extra_tensors: GGUF name -> (array, type), added or replacing the model's (a quantized
    type's array is taken as its raw bytes, [rows, row_bytes] uint8)."""
    cfg = model.config
    w = GGUFWriter(str(path), arch=arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(ROPE_THETA)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(TOKENS)
        w.add_token_types([3] * len(CONTROL_TOKENS) + [1] * (len(TOKENS) - len(CONTROL_TOKENS)))
        w.add_token_merges(MERGES)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_pad_token_id(2)
        w.add_add_bos_token(False)
        w.add_chat_template(CHAT_TEMPLATE)
    extra = dict(extra_tensors or {})
    for name, p in model.state_dict().items():
        if (name == "lm_head.weight" and cfg.tie_word_embeddings) or gguf_name(name) in extra:
            continue
        array = p.detach().float().numpy()
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            array = llama_cpp_permute(array, heads)
        kind = tensor_type if array.ndim == 2 else GGMLQuantizationType.F32
        _add(w, gguf_name(name), array, kind)
    for name, (array, kind) in extra.items():
        if array.dtype == np.uint8 and kind not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            w.add_tensor(name, array, raw_dtype=kind)
        else:
            _add(w, name, array, kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def _add(w: GGUFWriter, name: str, array: np.ndarray, kind: GGMLQuantizationType) -> None:
    if kind == GGMLQuantizationType.F32:
        w.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    elif kind == GGMLQuantizationType.F16:
        w.add_tensor(name, array.astype(np.float16))
    else:
        w.add_tensor(name, quantize(array.astype(np.float32), kind), raw_dtype=kind)


def expected_weight(array: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    """What a reader must return for `array` stored as kind (the quantization round trip;
    row reorders commute with it: ggml quantizes each row on its own)."""
    from gguf.quants import dequantize
    if kind == GGMLQuantizationType.F32:
        return array.astype(np.float32)
    if kind == GGMLQuantizationType.F16:
        return array.astype(np.float16).astype(np.float32)
    return dequantize(quantize(array.astype(np.float32), kind), kind).reshape(array.shape)


# Text a tokenizer must split exactly as the reference does.
CORPUS = [
    "Hello world", "hello  world", " leading space", "trailing space ", "\ttab\tseparated", "a\nb\n\nc\r\nd",
    "    four spaces then\n        eight", "  1. indented list\n\n2. after a blank line\n   10 spaces",
    "12 123 1234 12345 3.14159 1,000,000 -42 0x1F", "The year 2024, in 3 parts.",
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber",
    "\u4f60\u597d\uff0c\u4e16\u754c\u3002 \u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8",
    "emoji \U0001F600\U0001F680 \U0001F468\u200d\U0001F469\u200d\U0001F467 done",
    "I'm sure they're here; we'll see, you'd've known.",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "x<|endoftext|>y <|im_end|> z",
    "<|im_start|><|im_start|>", "def f(x):\n    return x ** 2  # square\n",
    "\u00a0non-breaking\u2009thin\u3000ideographic", "!!!??? ... --- ___", "", "   ", "\n\n\n",
    "\u00dcn\u00efc\u00f6d\u00e9 \u00c0\u00c9\u00ce\u00d5\u00dc \u00df \u00f8 \u00e5",
    "\u0645\u0631\u062d\u0628\u0627 \u05e9\u05dc\u05d5\u05dd \u043f\u0440\u0438\u0432\u0435\u0442",
]
