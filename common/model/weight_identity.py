"""The identity of a rank's loaded weights: two engines whose identities are equal hold the
same bytes in the same layout at the same tensor-parallel rank (what a weight seed and its
loader compare before one reads the other's memory; services/node/weight_seed.py).

    identity = blake2b(FORMAT, pdmesh's version, dtype, quantization scheme and W8A8_MIX
                       path, tensor_parallel_size, expert parallelism,
                       every small file of the checkpoint (config.json, quantization
                       descriptions: their bytes), every other file's name, size and
                       SAMPLE_PAGES pages of SAMPLE_BYTES spread over it)

Sampled pages, not the weights' bytes: hashing a checkpoint would read it from the disk,
what peer loading saves; a few pages tell apart two fine-tunes of one base (same config,
same file sizes) at the cost of a few small reads. Two checkpoints that differ only
outside the sampled pages are not told apart: the per-bucket checksums then only prove
the bytes arrived as the seed holds them. pdmesh's version is in it: during a rolling
upgrade, nodes of two versions never read each other's weights.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

FORMAT = "pdmesh-weights-1"     # bump when the pool's layout (common/model/weight_pool.py) changes
SMALL_FILE_BYTES = 1 << 20       # read whole: configs, descriptions, tokenizers
SAMPLE_PAGES = 8
SAMPLE_BYTES = 4096


def weights_identity(model: str | Path, dtype: str, quant_scheme: str, w8a8_mix_path: str,
                     tensor_parallel_size: int, expert_parallel: bool) -> str:
    """A hex digest (32 characters). model: the checkpoint folder or .gguf file."""
    h = hashlib.blake2b(digest_size=16)

    def add(*parts) -> None:
        for part in parts:
            data = part if isinstance(part, bytes) else str(part).encode()
            h.update(len(data).to_bytes(8, "little") + data)

    add(FORMAT, _version(), dtype, quant_scheme, w8a8_mix_path, tensor_parallel_size, expert_parallel)
    path = Path(model)
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    for f in files:
        size = f.stat().st_size
        add(f.name, size)
        if size <= SMALL_FILE_BYTES:
            add(f.read_bytes())
            continue
        with open(f, "rb") as fh:
            for k in range(SAMPLE_PAGES):
                fh.seek(k * (size - SAMPLE_BYTES) // (SAMPLE_PAGES - 1))
                add(fh.read(SAMPLE_BYTES))
    return h.hexdigest()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("pdmesh")
    except PackageNotFoundError:
        return "source"
