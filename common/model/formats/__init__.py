"""Model file formats.

A model is a Hugging Face folder (config.json, safetensors, tokenizer) or a `.gguf` file
(llama.cpp: config, weights, tokenizer and chat template in one file). The loaders
(common/model/config.py, formats/checkpoint.py, tokenizer.py and the gateway's
chat_template.py) call `is_gguf(path)` first and hand such a path to formats/gguf.py
(config + tensors) or formats/gguf_tokenizer.py (tokenizer + template).

    checkpoint.py       any checkpoint's tensors, one at a time, under HF names
    safetensors.py      a HF folder's safetensors files (sharded or not, sliced reads)
    quantization.py     the checkpoint's quantization config -> layers/quant_config.py
    gguf_reader.py      the file's layout: metadata and tensor byte views (no math)
    gguf.py             metadata -> HF config dict; tensors -> HF names, dequantized
    gguf_tokenizer.py   tokenizer.ggml.* -> a `tokenizers` BPE; the chat template
    gguf_convert.py     a GGUF file -> a standard HF folder (`pdmesh models pull`)
"""
from __future__ import annotations

from pathlib import Path

GGUF_SUFFIX = ".gguf"


def is_gguf(path: str | Path) -> bool:
    """True for a path that names a GGUF file (by its suffix; it need not exist yet)."""
    return Path(path).suffix.lower() == GGUF_SUFFIX
