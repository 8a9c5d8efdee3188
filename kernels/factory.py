"""The kernel backend factory, with lazy imports: a backend's module (and torch_npu or
flash_attn behind it) is imported only when that backend is asked for.

A registered class is constructed as cls(device=str(device)); one instance is cached per
(name, device) and shared by every caller. get_backend is thread-safe.
"""
from __future__ import annotations

import importlib
import logging
import os
import threading

import torch

from kernels.api import Backend

ENV_VAR = "PDMESH_KERNEL_BACKEND"

logger = logging.getLogger(__name__)
_BACKENDS: dict[str, tuple[str, str]] = {
    "ref": ("kernels.ref", "RefBackend"),
    "cpu": ("kernels.cpu", "CpuBackend"),
    "npu": ("kernels.npu", "NpuBackend"),
    "cuda": ("kernels.cuda", "CudaBackend"),
}
_INSTANCES: dict[tuple[str, str], Backend] = {}
_LOCK = threading.Lock()


def register_backend(name: str, module_path: str, class_name: str) -> None:
    """Make `name` resolve to module_path.class_name (a Backend subclass); replaces an
    existing entry. Clears the instance cache, so later calls build fresh instances."""
    if name == "auto":
        raise ValueError("kernel backend name 'auto' is reserved; pick another name")
    with _LOCK:
        _BACKENDS[name] = (module_path, class_name)
        _INSTANCES.clear()


def available_backends() -> list[str]:
    """Names get_backend accepts, "auto" first."""
    return ["auto", *_BACKENDS]


def get_backend(name: str = "auto", device: torch.device | str = "cpu") -> Backend:
    """The backend for `device`. $PDMESH_KERNEL_BACKEND, when set, overrides `name`.

    "auto" picks npu, cuda or cpu by device type (ref on any other), and falls back to ref
    (with a warning) when that module cannot be loaded. A forced name that cannot be loaded raises
    RuntimeError; an unknown name raises ValueError.
    """
    name = os.environ.get(ENV_VAR) or name
    if name not in _BACKENDS and name != "auto":
        raise ValueError(f"kernel backend {name!r} is unknown; allowed: "
                         f"{', '.join(available_backends())} (argument or ${ENV_VAR})")
    device_str = str(device)
    with _LOCK:
        if name != "auto":
            return _instance(name, device_str)
        if ("auto", device_str) not in _INSTANCES:
            _INSTANCES["auto", device_str] = _auto(device_str)
        return _INSTANCES["auto", device_str]


def _auto(device_str: str) -> Backend:
    device_type = device_str.split(":")[0]
    if device_type not in ("npu", "cuda", "cpu"):
        return _instance("ref", device_str)
    try:
        return _instance(device_type, device_str)
    except RuntimeError as exc:
        logger.warning("kernel backend %r unavailable, using 'ref': %s", device_type, exc)
        return _instance("ref", device_str)


def _instance(name: str, device_str: str) -> Backend:
    key = (name, device_str)
    if key not in _INSTANCES:
        cls = _load(name)
        try:
            _INSTANCES[key] = cls(device=device_str)
        except ImportError as exc:
            raise RuntimeError(f"kernel backend {name!r} is unavailable: {exc}") from exc
    return _INSTANCES[key]


def _load(name: str) -> type[Backend]:
    module_path, class_name = _BACKENDS[name]
    try:
        cls = getattr(importlib.import_module(module_path), class_name)
    except Exception as exc:
        raise RuntimeError(f"kernel backend {name!r} is unavailable: cannot load "
                           f"{module_path}.{class_name}: {type(exc).__name__}: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise RuntimeError(f"kernel backend {name!r}: {module_path}.{class_name} "
                           f"is not a Backend subclass")
    return cls
