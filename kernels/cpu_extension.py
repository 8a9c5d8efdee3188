"""The cpu backend's C++ kernels (kernels/csrc/: paged decode attention, the norms,
rotary, SiLU-and-multiply and KV write around a layer's matmuls, the quantization
around a W8A8 layer's int8 GEMM, and a MoE layer's experts over a decode step's few rows), one library built with
torch's extension builder (ninja + the host's C++ compiler) into torch's extension folder
($TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions), once per source, torch
version and CPU instruction set.

    python -m kernels.cpu_extension      # build it (`make` runs this at install time)

An engine never builds: `cpu_kernels()` imports the library that build left, or returns
None (the reason logged once; PDMESH_CPU_EXTENSION=0 also turns it off) and the backend
runs ref's torch ops instead (decode with gathered tiles). A build inside engine start-up would take
minutes, and torch's build lock, left behind by a builder that was killed, would hang
every later start.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = tuple(CSRC / name for name in ("paged_decode_cpu.cpp", "layer_ops_cpu.cpp", "quant_ops_cpu.cpp",
                                         "int8_gemv_cpu.cpp", "moe_cpu.cpp", "bindings.cpp"))
HEADERS = (CSRC / "cpu_kernels.h",)
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
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
                            + torch.__version__.encode()).hexdigest()[:10]
    return f"pdmesh_cpu_kernels_{capability.lower()}_{digest}"


def library_path() -> Path:
    """Where the build leaves the library for this source, torch and CPU."""
    from torch.utils.cpp_extension import _get_build_directory
    name = module_name()
    return Path(_get_build_directory(name, verbose=False)) / f"{name}.so"


def build(verbose: bool = False) -> ModuleType:
    """Compile (or find up to date) and import the extension; raises when it cannot."""
    from torch.utils.cpp_extension import load
    flags = ["-O3", "-fopenmp", *_ISA_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])]
    return load(name=module_name(), sources=[str(p) for p in SOURCES], extra_cflags=flags,
                extra_ldflags=["-fopenmp"], verbose=verbose)


def cpu_kernels() -> ModuleType | None:
    """The built extension module, or None where it is not built or turned off."""
    with _LOCK:
        if not _LOADED:
            _LOADED.append(_import_built())
        return _LOADED[0]


def _import_built() -> ModuleType | None:
    if os.environ.get(DISABLE_ENV) == "0":
        log.info("cpu kernel backend: C++ kernels off (%s=0)", DISABLE_ENV)
        return None
    try:
        path = library_path()
        if not path.is_file():
            log.warning("cpu kernel backend: C++ kernels not built for this source, torch and "
                        "CPU (run `python -m kernels.cpu_extension`); running ref's torch ops")
            return None
        spec = importlib.util.spec_from_file_location(module_name(), path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except Exception as exc:   # a broken library: the torch path still works
        log.warning("cpu kernel backend: C++ kernels unusable, running ref's torch ops (%s: %s)",
                    type(exc).__name__, exc)
        return None


def main() -> int:
    print(f"building {', '.join(p.name for p in SOURCES)} for {torch.backends.cpu.get_cpu_capability()} "
          f"(torch {torch.__version__}) ...", flush=True)
    try:
        module = build(verbose="-v" in sys.argv)
    except Exception as exc:   # optional: installing must not fail where no compiler is
        print(f"not built ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
              "the cpu backend runs ref's torch ops")
        return 0
    print(f"built: {module.__file__}")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(main())
