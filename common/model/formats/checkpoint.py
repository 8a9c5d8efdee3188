"""Any checkpoint, one tensor at a time under its Hugging Face name: a HF folder
(formats/safetensors.py) or a .gguf file (formats/gguf.py)."""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TextIO

import torch

from common.model.formats import is_gguf


def iter_checkpoint(model_dir: str | Path, progress: TextIO | None = None,
                    slices: Mapping[str, tuple[slice, ...]] | None = None,
                    with_shape: bool = False, dtype: torch.dtype | None = None) -> Iterator[tuple]:
    """(name, tensor, file), or (name, tensor, file, full shape) with with_shape; tensor
    is tensor[slices[name]] for a name in slices (only that part is read). progress:
    where the bar goes; None = stderr, shown only when it is a terminal. A GGUF file's
    tensors are dequantized to dtype (None: float32) before slicing; safetensors tensors
    come as stored, whatever dtype says."""
    if is_gguf(model_dir):
        from common.model.formats.gguf import iter_gguf_tensors
        yield from iter_gguf_tensors(model_dir, progress=progress, slices=slices, with_shape=with_shape,
                                     dtype=dtype or torch.float32)
        return
    from common.model.formats.safetensors import iter_safetensors
    yield from iter_safetensors(model_dir, progress=progress, slices=slices, with_shape=with_shape)
