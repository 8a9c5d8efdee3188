"""Copy a checkpoint into a model's parameters, by the model's weight slots.

Every checkpoint tensor is taken by exactly one slot or is named in the model's ignore
list; anything else is an error naming it, and so is a slot no tensor filled (a loader
that drops a tensor ships garbage). A tensor-parallel rank reads only its part of each
tensor (the slot's `source`)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

import torch

from common.model.formats.checkpoint import iter_checkpoint
from common.model.layers.weight_slots import Slot

log = logging.getLogger(__name__)


class Loadable(Protocol):
    def weight_slots(self) -> dict[str, Slot]: ...

    def ignored_tensors(self) -> tuple[set[str], tuple[str, ...]]:
        """(names, name suffixes) of checkpoint tensors the model does not read."""
        ...


def ignored_prefixes(model: Loadable) -> dict[str, str]:
    """Name prefix -> why: whole modules a checkpoint carries that the model does not
    run (DeepSeek-V3's multi-token-prediction layer); a model may define
    `ignored_prefixes()`, said in the log when such tensors were skipped."""
    method = getattr(model, "ignored_prefixes", None)
    return method() if method is not None else {}


def checkpoint_names_under(model_dir: str | Path, prefixes: tuple[str, ...]) -> set[str]:
    """The safetensors checkpoint's tensor names under any of prefixes (from the files'
    headers; none for a GGUF file or no prefixes)."""
    if not prefixes:
        return set()
    from common.model.formats import is_gguf
    if is_gguf(model_dir):
        return set()
    from safetensors import safe_open
    names = set()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names.update(n for n in f.keys() if n.startswith(prefixes))
    return names


@torch.inference_mode()
def load_weights(model: Loadable, model_dir: str | Path, dtype: torch.dtype, what: str) -> set[str]:
    """The names of the tensors read. ValueError naming the file and the tensor on an
    unexpected tensor, a shape mismatch or an integer tensor where a float one belongs (or
    the reverse: a cast would be garbage); naming the tensors when any is missing (an
    optional slot's: the model checks those, e.g. layers/moe.py's two layouts). what: the
    model, for the errors."""
    slots = model.weight_slots()
    ignored_names, ignored_suffixes = model.ignored_tensors()
    prefixes = ignored_prefixes(model)
    skipped = dict.fromkeys(prefixes, 0)
    sources = {name: slot.source for name, slot in slots.items() if slot.source is not None}
    for name in ignored_names | checkpoint_names_under(model_dir, tuple(prefixes)):
        sources[name] = (slice(0, 0),)   # read none of it
    loaded: set[str] = set()
    for name, tensor, path, shape in iter_checkpoint(model_dir, slices=sources, with_shape=True, dtype=dtype):
        slot = slots.get(name)
        if slot is None:
            if name in ignored_names or name.endswith(ignored_suffixes):
                continue
            prefix = next((p for p in prefixes if name.startswith(p)), None)
            if prefix is not None:
                skipped[prefix] += 1
                continue
            raise ValueError(f"{path}: unexpected tensor {name!r} for {what}")
        if shape != slot.full_shape:
            raise ValueError(f"{path}: tensor {name!r} has shape {shape}, expected {slot.full_shape} "
                             f"from config.json")
        if slot.convert is not None:
            tensor = slot.convert(tensor)
        elif tensor.dtype.is_floating_point != slot.param.dtype.is_floating_point:
            raise ValueError(f"{path}: tensor {name!r} is {str(tensor.dtype).removeprefix('torch.')}, expected "
                             f"{'a float' if slot.param.dtype.is_floating_point else 'an integer'} tensor "
                             f"({str(slot.param.dtype).removeprefix('torch.')}) for {what}'s quantization")
        slot.param.data[slot.start:slot.end].copy_(tensor)
        loaded.add(name)
    for prefix, count in skipped.items():
        if count:
            log.info("skipped %d tensor(s) under %s*: %s", count, prefix, prefixes[prefix])
    missing = sorted(name for name in set(slots) - loaded if not slots[name].optional)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"{model_dir}: checkpoint is missing {len(missing)} tensor(s): {shown}")
    return loaded
