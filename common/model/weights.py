"""Safetensors checkpoint reading: one file or HF shards with `model.safetensors.index.json`.

`iter_checkpoint` yields (tensor name, tensor, file) one tensor at a time so a loader can
copy each straight into its destination and never holds two copies of the model. A
progress line per file goes to the `pdmesh.model` logger.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

log = logging.getLogger("pdmesh.model")

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a model folder, in load order. FileNotFoundError if none."""
    root = Path(model_dir)
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index}: not a safetensors index ({e!r})") from None
        files = [root / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index}: lists shard files that do not exist: {missing}")
        return files
    single = root / SINGLE_FILE
    if single.is_file():
        return [single]
    found = sorted(root.glob("*.safetensors"))
    if found:
        return found
    raise FileNotFoundError(f"{root}: no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors file")


def iter_checkpoint(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor, Path]]:
    files = checkpoint_files(model_dir)
    for i, path in enumerate(files, 1):
        start = time.perf_counter()
        size_mb = path.stat().st_size / 2**20
        log.info("loading weights %s [%d/%d] %.1f MB", path.name, i, len(files), size_mb)
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name), path
        log.info("loaded %s in %.2fs", path.name, time.perf_counter() - start)
