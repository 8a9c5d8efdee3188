"""Backend selection: auto by device, the env override, errors, plug-ins, lazy imports."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import registry
from kernels.ref import RefBackend

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def clean_registry(monkeypatch):
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_INSTANCES", {})


def test_auto_on_cpu_is_ref_and_cached():
    backend = registry.get_backend("auto", "cpu")
    assert isinstance(backend, RefBackend) and backend.name == "ref"
    assert registry.get_backend() is backend
    assert registry.get_backend("ref", "cpu") is backend


def test_env_overrides_the_argument(monkeypatch):
    monkeypatch.setenv(registry.ENV_VAR, "ref")
    assert registry.get_backend("npu", "npu:0").name == "ref"


@pytest.mark.parametrize("via_env", [False, True])
def test_unknown_name_lists_allowed(monkeypatch, via_env):
    if via_env:
        monkeypatch.setenv(registry.ENV_VAR, "tpu")
    with pytest.raises(ValueError, match="'tpu'.*auto, ref, npu, cuda"):
        registry.get_backend("ref" if via_env else "tpu")


def test_forced_npu_without_torch_npu_is_a_runtime_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    with pytest.raises(RuntimeError, match="npu"):
        registry.get_backend("npu", "cpu")


def test_auto_falls_back_to_ref_when_the_device_backend_cannot_load():
    registry.register_backend("npu", "kernels.no_such_module", "NpuBackend")
    assert registry.get_backend("auto", "npu:0").name == "ref"


def test_plugin_registration():
    registry.register_backend("mine", "kernels.ref", "RefBackend")
    assert isinstance(registry.get_backend("mine"), RefBackend)
    registry.register_backend("broken", "kernels.no_such_module", "Backend")
    with pytest.raises(RuntimeError, match="'broken'.*kernels.no_such_module"):
        registry.get_backend("broken")
    registry.register_backend("not_backend", "kernels.rope", "rope_inv_freq")
    with pytest.raises(RuntimeError, match="not a Backend"):
        registry.get_backend("not_backend")
    with pytest.raises(ValueError, match="reserved"):
        registry.register_backend("auto", "kernels.ref", "RefBackend")


def test_import_is_lazy():
    code = ("import sys, kernels; kernels.get_backend('auto', 'cpu'); "
            "bad = [m for m in ('torch_npu', 'flash_attn', 'kernels.npu', 'kernels.cuda') "
            "if m in sys.modules]; assert not bad, bad")
    env = {k: v for k, v in os.environ.items() if k != registry.ENV_VAR}
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=60)
