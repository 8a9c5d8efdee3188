"""The cpu backend's C++ paged decode attention (kernels/csrc/paged_decode_cpu.cpp):
built with torch's extension builder (ninja + the host's C++ compiler) into torch's
extension folder ($TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions), once per
source, torch version and CPU instruction set; later loads take the built library.

    python -m kernels.cpu_extension      # build now (`make` runs it at install time)

`paged_decode()` returns the loaded module, or None when it cannot be built here (no
compiler, no ninja, PDMESH_CPU_EXTENSION=0); the reason is logged once and the backend
decodes with ref's gathered tiles instead.
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_decode_cpu.cpp"
DISABLE_ENV = "PDMESH_CPU_EXTENSION"     # "0": never build or load it
# Flags per CPU capability torch reports; the capability is part of the module's name, so
# a library built for one instruction set is never loaded on a CPU without it.
_ISA_FLAGS = {"AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma"],
              "AVX2": ["-mavx2", "-mfma"], "DEFAULT": []}

log = logging.getLogger("pdmesh.kernels")
_LOCK = threading.Lock()
_LOADED: list[ModuleType | None] = []     # one entry once tried


def module_name() -> str:
    capability = torch.backends.cpu.get_cpu_capability()
    digest = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:10]
    return f"pdmesh_paged_decode_{capability.lower()}_{digest}"


def _build(verbose: bool) -> ModuleType:
    from torch.utils.cpp_extension import load
    flags = ["-O3", "-fopenmp", *_ISA_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])]
    return load(name=module_name(), sources=[str(SOURCE)], extra_cflags=flags,
                extra_ldflags=["-fopenmp"], verbose=verbose)


def paged_decode(verbose: bool = False) -> ModuleType | None:
    """The extension module (built first if needed), or None where it cannot be had."""
    with _LOCK:
        if not _LOADED:
            _LOADED.append(_try_load(verbose))
        return _LOADED[0]


def _try_load(verbose: bool) -> ModuleType | None:
    if os.environ.get(DISABLE_ENV) == "0":
        log.info("cpu kernel backend: C++ decode attention off (%s=0)", DISABLE_ENV)
        return None
    try:
        return _build(verbose)
    except Exception as exc:   # no compiler / ninja / headers: the torch path still works
        log.warning("cpu kernel backend: C++ decode attention unavailable, decoding with "
                    "gathered tiles (%s: %s)", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None


def main() -> int:
    print(f"building {SOURCE.name} for {torch.backends.cpu.get_cpu_capability()} "
          f"(torch {torch.__version__}) ...", flush=True)
    module = paged_decode(verbose="-v" in sys.argv)
    if module is None:
        print("not built: the cpu backend decodes with gathered tiles (see the warning above)")
        return 0   # optional: installing must not fail where no compiler is
    print(f"built: {module.__file__}")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(main())
