"""`pdmesh up` as a user runs it: a subprocess that makes the tiny model, starts the mesh,
prints `gateway ready at HOST:PORT`, serves, and on SIGTERM stops every service and exits
0 with no process left behind. `--demo` serves a few prompts itself and exits 0."""
from __future__ import annotations

import asyncio
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import yaml

from common.cpu_budget import parse_cpu_list
from services.cli.client import stream_generate
from services.node.grpc_util import free_port
from services.security.client_auth import client_channel
from tests.channels import operator_channel

ROOT = Path(__file__).resolve().parents[2]
READY = re.compile(r"^gateway ready at (\S+)$")
PID = re.compile(r"^(\S+)\s+\S+\s+healthy at \S+ \(pid (\d+), cores ([\d-]+(?:,[\d-]+)*)( \(not pinned\))?.*\)$")
# Bounds that only catch a hang (a loaded machine is slower, never this slow); the seconds
# taken are printed, not asserted.
START_GUARD_S = 240     # `up` making the model (when it must) and starting five services
HANG_GUARD_S = 60       # any other step: a status line, a restart, a stop


def write_config(tmp_path: Path, model: Path, *, bind_any: bool = False) -> Path:
    """deploy/local.yaml with free ports and `model`; bind_any: the compose layout (bind
    0.0.0.0, advertise a name, transfer hostname from the node) and, as off the loopback
    it must be (services/security/bind_policy.py), TLS: the certificates `pdmesh certs
    init --config` makes, no dashboard (plain HTTP)."""
    raw = yaml.safe_load((ROOT / "deploy" / "local.yaml").read_text())
    raw["model"] = str(model)
    raw.pop("pull", None)
    raw["tiny_arch"] = "llama"
    raw["engine"]["num_blocks"] = 256
    raw["gateway"]["http_port"] = free_port()   # 0 would turn the HTTP API off
    raw["meta_server"]["dashboard_port"] = free_port()
    for section in (raw["meta_server"], raw["gateway"], raw["kv_store"], *raw["nodes"]):
        section["port"] = 0
        if bind_any:
            section["host"] = "0.0.0.0"
            if section is not raw["gateway"]:
                section["advertise_host"] = "localhost"
    if bind_any:
        from common.config import mesh_config_from_dict
        from services.security.certs import hosts_of, init_certs, service_names
        raw["transfer"]["hostname"] = ""
        raw["meta_server"]["dashboard_port"] = 0
        mesh = mesh_config_from_dict(raw)
        init_certs(tmp_path / "certs", service_names(mesh), hosts_of(mesh), cluster=mesh.cluster)
        raw["security"]["tls_dir"] = str(tmp_path / "certs")
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


class Up:
    """`pdmesh up` in a subprocess; its output lines are collected by a reader thread."""

    def __init__(self, config: Path, log_dir: Path, *extra: str, env: dict[str, str] | None = None):
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "up", "--config", str(config),
             "--log-dir", str(log_dir), *extra],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, pattern: re.Pattern, timeout_s: float) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            if line is None:
                break
            self.lines.append(line)
            if m := pattern.match(line):
                return m
        raise AssertionError(f"no line matching {pattern.pattern!r}; output:\n" + "\n".join(self.lines))

    def finish(self, timeout_s: float) -> int:
        code = self.proc.wait(timeout=timeout_s)
        while (line := self._queue.get(timeout=HANG_GUARD_S)) is not None:
            self.lines.append(line)
        return code

    def pids(self) -> dict[str, int]:
        return {m[1]: int(m[2]) for line in self.lines if (m := PID.match(line))}

    def kill(self) -> None:
        """Cleanup after a failed test: the up process and the services it reported."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in self.pids().values():
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def assert_all_gone(up: Up, names: list[str]) -> None:
    pids = up.pids()
    assert sorted(pids) == sorted(names)
    for name, pid in pids.items():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        assert any(line.startswith(name) and line.endswith("stopped") for line in up.lines), name


SERVICES = ["meta-server", "kv-store", "prefill-0", "decode-0", "gateway"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """Not there yet: the first `up` makes it, later ones reuse it."""
    return tmp_path_factory.mktemp("up-models") / "tiny-llama"


def test_up_serves_then_stops_cleanly_on_sigterm(tmp_path):
    """As a user runs it: no model yet (a folder of its own, whatever ran before), so `up`
    makes it; no secret configured anywhere (the session's are withheld), so `pdmesh up`
    makes them, and `pdmesh generate` / `pdmesh admin` find them by themselves. SIGTERM
    stops every service (each says "stopped", none is killed) and `up` exits 0."""
    model = tmp_path / "models" / "tiny-llama"
    assert not model.exists()
    user_env = {"PDMESH_CLUSTER_SECRET": "", "PDMESH_ADMIN_TOKEN": "", "PDMESH_STATE_DIR": str(tmp_path / "state")}
    up = Up(write_config(tmp_path, model), tmp_path / "logs", env=user_env)
    try:
        address = up.wait_for(READY, START_GUARD_S)[1]
        assert any(line.startswith("making the built-in tiny llama model") for line in up.lines)
        assert any(line.startswith(f"credentials made for this mesh in {tmp_path / 'logs' / 'credentials'}")
                   for line in up.lines)
        assert (model / "config.json").exists()
        key = (tmp_path / "logs" / "credentials" / "api_keys").read_text().strip()

        async def one():
            async with client_channel(address, bearer=key) as channel:
                return await stream_generate(channel, "Hello there", max_tokens=8, ignore_eos=True)
        result = asyncio.run(one())
        assert len(result.token_ids) == 8 and result.finish_reason == "length"
        assert result.usage.completion_tokens == 8 and 0 < result.ttft_s <= result.elapsed_s
        cli_env = {**os.environ, **user_env, "PYTHONPATH": str(ROOT)}
        cli = [sys.executable, "-m", "services.cli"]
        out = subprocess.run([*cli, "generate", "--gateway", address, "--max-tokens", "4", "hi"], env=cli_env,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "finish_reason=length" in out.stdout, out.stderr
        out = subprocess.run([*cli, "admin", "nodes", "--json"], env=cli_env, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0 and '"decode-0"' in out.stdout, out.stderr
        assert (tmp_path / "state" / "mesh.json").exists()
        for m in filter(None, map(PID.match, up.lines)):   # each runs on the cores its line says
            if not m[4]:
                assert os.sched_getaffinity(int(m[2])) == set(parse_cpu_list(m[3])), m[0]

        start = time.monotonic()
        up.proc.send_signal(signal.SIGTERM)
        assert up.finish(timeout_s=HANG_GUARD_S) == 0
        print(f"up exited {time.monotonic() - start:.2f}s after SIGTERM")
        assert [line for line in up.lines if READY.match(line)] == [f"gateway ready at {address}"]
        assert_all_gone(up, SERVICES)
        assert not (tmp_path / "state" / "mesh.json").exists()    # the record goes with the mesh
    finally:
        up.kill()


def test_up_demo_bind_any_advertise_name(tmp_path, model_dir):
    up = Up(write_config(tmp_path, model_dir, bind_any=True), tmp_path / "logs",
            "--demo", "--max-tokens", "12")
    try:
        code = up.finish(timeout_s=START_GUARD_S + HANG_GUARD_S)
        out = "\n".join(up.lines)
        assert code == 0, out
        assert sum(1 for line in up.lines if READY.match(line)) == 1
        done = [line for line in up.lines if re.match(r"^--- \[\d\] .*12 tokens in .* tokens/s", line)]
        assert len(done) == 4, out
        assert re.search(r"^--- 4/4 requests, 48 tokens in .* tokens/s overall", out, re.M), out
        assert "The quick brown fox" in out
        assert_all_gone(up, SERVICES)
    finally:
        up.kill()


RESTARTED = re.compile(r"^(\S+)\s+\S+\s+restarted at \S+ \(pid (\d+), cores .*\)$")


def test_up_restarts_a_service_that_dies_and_keeps_serving(tmp_path, model_dir):
    """A stopped decode node: `up` says it is unhealthy, then healthy again once resumed.
    kill -9 of the prefill node and of the decode node: `up` says so, starts each again
    with back-off, and the mesh serves; SIGTERM still stops everything with 0."""
    up = Up(write_config(tmp_path, model_dir), tmp_path / "logs")
    try:
        address = up.wait_for(READY, START_GUARD_S)[1]

        async def one():
            async with operator_channel(address) as channel:
                return await stream_generate(channel, "Hello there", max_tokens=8, ignore_eos=True)
        want = asyncio.run(one()).token_ids
        stopped = up.pids()["decode-0"]       # a stopped node: one line when it goes, one when it is back
        os.killpg(stopped, signal.SIGSTOP)
        try:
            up.wait_for(re.compile(r"^decode-0\s+decode\s+unhealthy \(no answer\) at \S+ \(pid \d+"), HANG_GUARD_S)
        finally:
            os.killpg(stopped, signal.SIGCONT)
        up.wait_for(re.compile(r"^decode-0\s+decode\s+healthy again at "), HANG_GUARD_S)
        for name in ("prefill-0", "decode-0"):
            old_pid = up.pids()[name] if name not in restarted_pids(up) else restarted_pids(up)[name]
            os.killpg(old_pid, signal.SIGKILL)
            up.wait_for(re.compile(rf"^{name}\s+exited with code -9; restarting in \d+\.\ds"), HANG_GUARD_S)
            m = up.wait_for(RESTARTED, HANG_GUARD_S)
            assert m[1] == name and int(m[2]) != old_pid
            assert up.proc.poll() is None, "up keeps the mesh running"
        restarted = time.monotonic()
        while True:   # until the restarted nodes have registered
            try:
                got = asyncio.run(one()).token_ids
                break
            except grpc.aio.AioRpcError:
                assert time.monotonic() - restarted < HANG_GUARD_S, "the restarted mesh never served"
                time.sleep(0.2)
        print(f"served {time.monotonic() - restarted:.2f}s after the last restart")
        assert got == want
        up.proc.send_signal(signal.SIGTERM)
        assert up.finish(timeout_s=HANG_GUARD_S) == 0
    finally:
        up.kill()
        for pid in restarted_pids(up).values():
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def restarted_pids(up: Up) -> dict[str, int]:
    return {m[1]: int(m[2]) for line in up.lines if (m := RESTARTED.match(line))}
