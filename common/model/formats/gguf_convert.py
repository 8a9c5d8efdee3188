"""A GGUF file -> a standard Hugging Face model folder (what `pdmesh models pull` writes).

    config.json              architectures, sizes, bos/eos ids, torch_dtype
    model.safetensors        every tensor dequantized to the dtype asked for, HF names
                             (no lm_head.weight when the embeddings are tied)
    tokenizer.json           formats/gguf_tokenizer.py's tokenizer
    tokenizer_config.json    chat_template, bos/eos/pad/unk tokens, add_bos_token
    generation_config.json   bos id, the end-of-generation ids (e.g. eos and <|im_end|>)
    pdmesh-pull.json         MARKER, written last: source file, its sha256, dtype

Lifecycle of a conversion: validate the file (config + tokenizer) -> remove what killed
conversions left beside the target (`.NAME.tmp-*`, `.NAME.old-*`) -> write everything into
a temporary folder beside it (`.NAME.tmp-PID`) -> marker -> swap it in: an existing
target is renamed aside, the new folder renamed onto its name, the old one removed (a
reader sees the old folder or the new one, each whole). A folder without the marker is
therefore half-written (or not ours) and is rebuilt; one with it is finished.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, TextIO

MARKER = "pdmesh-pull.json"
DTYPES = ("float32", "bfloat16", "float16")     # torch dtype names


def sha256_of(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def read_marker(folder: str | Path) -> dict[str, Any] | None:
    """The marker of a finished conversion in folder, None if there is none (or it is not JSON)."""
    try:
        marker = json.loads((Path(folder) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: str = "float32",
                 progress: TextIO | None = None, extra_marker: dict[str, Any] | None = None) -> Path:
    """Write the HF folder of gguf_path at out_dir (replacing whatever is there) and return
    it. ValueError naming the file for an unsupported model or tokenizer, before anything
    is written; dtype one of DTYPES. progress: where the dequantizing bar goes (None:
    stderr when it is a terminal). Not safe to run twice at once on the same out_dir."""
    import torch   # here: read_marker (a finished pull) needs none of these
    from safetensors.torch import save_file

    from common.model.formats.gguf import config_dict, iter_gguf_tensors
    from common.model.formats.gguf_reader import read_gguf
    from common.model.formats.gguf_tokenizer import build_tokenizer, eog_token_ids, tokenizer_config

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    file = read_gguf(gguf_path)
    config = config_dict(file)
    tokenizer = build_tokenizer(file)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    for stale in (*out_dir.parent.glob(f".{out_dir.name}.tmp-*"), *out_dir.parent.glob(f".{out_dir.name}.old-*")):
        shutil.rmtree(stale, ignore_errors=True)    # a conversion killed midway
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    try:
        tensors = {name: tensor for name, tensor, _ in
                   iter_gguf_tensors(gguf_path, progress=progress, dtype=getattr(torch, dtype))}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        eos = file.get("tokenizer.ggml.eos_token_id")
        _write_json(tmp / "config.json", {**config, "eos_token_id": eos if eos is not None else config["eos_token_id"],
                                          "torch_dtype": dtype})
        tokenizer.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "tokenizer_config.json", tokenizer_config(file))
        generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": eog_token_ids(file.metadata)}
        if config["pad_token_id"] is not None:
            generation["pad_token_id"] = config["pad_token_id"]
        _write_json(tmp / "generation_config.json", generation)
        _write_json(tmp / MARKER, {"source": str(gguf_path.resolve()), "sha256": sha256_of(gguf_path),
                                   "dtype": dtype, **(extra_marker or {})})
        old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
        if out_dir.exists():
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
