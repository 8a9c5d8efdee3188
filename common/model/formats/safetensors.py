"""Safetensors checkpoints: one file or HF shards with `model.safetensors.index.json`.

`iter_safetensors` yields one tensor at a time so a loader can copy each straight into
its destination and never holds two copies of the model. With `slices` (name -> index
tuple), those tensors are read in part (safetensors get_slice): a tensor-parallel rank
reads only its shard, so it never holds the whole model either. A progress line per file
goes to the `pdmesh.model` logger, and a progress bar of bytes and tensors (tqdm) to the
terminal when stderr is one, or to the `progress` stream given.
"""
from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TextIO

import torch
from safetensors import safe_open
from tqdm import tqdm

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


def iter_safetensors(model_dir: str | Path, progress: TextIO | None = None,
                     slices: Mapping[str, tuple[slice, ...]] | None = None,
                     with_shape: bool = False) -> Iterator[tuple]:
    """(name, tensor, file), or (name, tensor, file, full shape) with with_shape; tensor
    is tensor[slices[name]] for a name in slices (only that part is read), as stored.
    progress: where the bar goes; None = stderr, shown only when it is a terminal. The
    bar counts the checkpoint's bytes, read or skipped."""
    slices = slices or {}
    files = checkpoint_files(model_dir)
    headers = [_header(path) for path in files]
    num_tensors = sum(len(h) for h in headers)
    tensor_bytes = sum(end - begin for h in headers for begin, end in (t["data_offsets"] for t in h.values()))
    bar = tqdm(total=tensor_bytes, unit="B", unit_scale=True, unit_divisor=1024,
               desc="loading weights", file=progress if progress is not None else sys.stderr,
               disable=None if progress is None else False, mininterval=0.5)
    loaded = 0
    with bar:
        for i, path in enumerate(files, 1):
            start = time.perf_counter()
            size_mb = path.stat().st_size / 2**20
            log.info("loading weights %s [%d/%d] %.1f MB", path.name, i, len(files), size_mb)
            header = headers[i - 1]
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    if name in slices:
                        try:
                            tensor = f.get_slice(name)[slices[name]]
                        except Exception as e:   # a tensor of another rank than its slice
                            raise ValueError(f"{path}: tensor {name!r} of shape {header[name]['shape']} "
                                             f"cannot be read as {slices[name]} ({e})") from None
                    else:
                        tensor = f.get_tensor(name)
                    loaded += 1
                    bar.set_postfix_str(f"tensors {loaded}/{num_tensors}", refresh=False)
                    begin, end = header[name]["data_offsets"]
                    bar.update(end - begin)
                    if with_shape:
                        yield name, tensor, path, tuple(header[name]["shape"])
                    else:
                        yield name, tensor, path
            log.info("loaded %s in %.2fs", path.name, time.perf_counter() - start)


def _header(path: Path) -> dict:
    """The tensors of a safetensors file, from its JSON header (name -> dtype, shape,
    data_offsets), without "__metadata__"."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header
