"""Fixtures of the kernel tests."""
from __future__ import annotations

import os

import pytest

from kernels.cpu import CpuBackend


@pytest.fixture(scope="session")
def cpu_extension_backend() -> CpuBackend:
    """The cpu backend with its C++ kernels (make builds them; skipped only when
    PDMESH_CPU_EXTENSION=0 turned them off)."""
    backend = CpuBackend("cpu")
    if os.environ.get("PDMESH_CPU_EXTENSION") == "0":
        pytest.skip("the C++ kernels are off")
    assert backend.extension is not None, "kernels/cpu_extension.py could not build the C++ kernels"
    return backend
