"""Backend selection: auto by device, the env override, errors, plug-ins, lazy imports."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import factory
from kernels.cpu import CpuBackend
from kernels.ref import RefBackend

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def clean_factory(monkeypatch):
    monkeypatch.delenv(factory.ENV_VAR, raising=False)
    monkeypatch.setattr(factory, "_BACKENDS", dict(factory._BACKENDS))
    monkeypatch.setattr(factory, "_INSTANCES", {})


def test_auto_on_cpu_is_the_cpu_backend_and_cached():
    backend = factory.get_backend("auto", "cpu")
    assert isinstance(backend, CpuBackend) and backend.name == "cpu"
    assert factory.get_backend() is backend
    assert factory.get_backend("cpu", "cpu") is backend
    assert type(factory.get_backend("ref", "cpu")) is RefBackend


def test_auto_falls_back_to_ref_when_the_cpu_backend_cannot_load():
    factory.register_backend("cpu", "kernels.no_such_module", "CpuBackend")
    assert factory.get_backend("auto", "cpu").name == "ref"


def test_env_overrides_the_argument(monkeypatch):
    monkeypatch.setenv(factory.ENV_VAR, "ref")
    assert factory.get_backend("npu", "npu:0").name == "ref"


@pytest.mark.parametrize("via_env", [False, True])
def test_unknown_name_lists_allowed(monkeypatch, via_env):
    if via_env:
        monkeypatch.setenv(factory.ENV_VAR, "tpu")
    with pytest.raises(ValueError, match="'tpu'.*auto, ref, cpu, npu, cuda"):
        factory.get_backend("ref" if via_env else "tpu")


def test_forced_npu_without_torch_npu_is_a_runtime_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    with pytest.raises(RuntimeError, match="npu"):
        factory.get_backend("npu", "cpu")


def test_auto_falls_back_to_ref_when_the_device_backend_cannot_load():
    factory.register_backend("npu", "kernels.no_such_module", "NpuBackend")
    assert factory.get_backend("auto", "npu:0").name == "ref"


def test_plugin_registration():
    factory.register_backend("mine", "kernels.ref", "RefBackend")
    assert isinstance(factory.get_backend("mine"), RefBackend)
    factory.register_backend("broken", "kernels.no_such_module", "Backend")
    with pytest.raises(RuntimeError, match="'broken'.*kernels.no_such_module"):
        factory.get_backend("broken")
    factory.register_backend("not_backend", "kernels.rope", "rope_inv_freq")
    with pytest.raises(RuntimeError, match="not a Backend"):
        factory.get_backend("not_backend")
    with pytest.raises(ValueError, match="reserved"):
        factory.register_backend("auto", "kernels.ref", "RefBackend")


def test_import_is_lazy():
    code = ("import sys, kernels; kernels.get_backend('auto', 'cpu'); "
            "bad = [m for m in ('torch_npu', 'flash_attn', 'kernels.npu', 'kernels.cuda') "
            "if m in sys.modules]; assert not bad, bad")
    env = {k: v for k, v in os.environ.items() if k != factory.ENV_VAR}
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=60)
