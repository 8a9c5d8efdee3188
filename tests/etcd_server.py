"""A real single-node etcd on free loopback ports, for tests.

Lifecycle:  EtcdServer() -> start() -> [stop() -> start()]* -> stop()
A restart keeps the ports and the data dir, so clients reconnect to the same endpoint and
find their keys and leases again (etcd extends every lease by its TTL when it restarts).
The process is always stopped at the end: by `with`, by the `etcd_server` fixture, or at
interpreter exit. Logs go to `<root>/etcd.log`.

Missing binary: `require_etcd()` skips the test with the reason (`make sysdeps` installs
Debian's etcd-server when running as root).

Tests of asyncio clients (aetcd) import the `loop` and `run` fixtures and `wait_until`
from here: one event loop per test module, scenarios run on it.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import time
import urllib.request
from pathlib import Path

import pytest

from tests.server_process import ServerProcess, free_port

ETCD_BINARY = os.environ.get("PDMESH_ETCD_BINARY", "etcd")


def etcd_binary() -> str | None:
    return shutil.which(ETCD_BINARY)


def require_etcd() -> str:
    path = etcd_binary()
    if path is None:
        pytest.skip(f"`{ETCD_BINARY}` not found on PATH (install etcd-server: `make sysdeps` as root)")
    return path


class EtcdServer(ServerProcess):
    """One etcd process; `endpoint` is "127.0.0.1:<client port>" (aetcd style)."""

    log_name = "etcd.log"

    def __init__(self, root: str | Path | None = None, name: str = "t"):
        self.binary = require_etcd()
        super().__init__(root, "pdmesh-etcd-")
        self.data_dir = self.root / "data"
        self.name = name
        self.client_port = free_port()
        self.peer_port = free_port()
        while self.peer_port == self.client_port:
            self.peer_port = free_port()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        return f"http://{self.endpoint}"

    def command(self) -> list[str]:
        peer = f"http://127.0.0.1:{self.peer_port}"
        return [self.binary, "--name", self.name, "--data-dir", str(self.data_dir),
                "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"{self.name}={peer}", "--initial-cluster-state", "new",
                "--heartbeat-interval=10", "--election-timeout=100"]

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1) as resp:
                return resp.status == 200 and b'"true"' in resp.read()
        except OSError:
            return False


@pytest.fixture
def etcd_server(tmp_path):
    """A started EtcdServer for one test (skips when etcd is not installed)."""
    server = EtcdServer(tmp_path / "etcd")
    try:
        yield server.start()
    finally:
        server.close()


@pytest.fixture(scope="module")
def loop():
    """One event loop for the module: grpc.aio completions that arrive after a test's
    client closed must not land on a closed loop (aetcd leaves keepalive streams behind)."""
    loop = asyncio.new_event_loop()
    loop.errors = []
    loop.set_exception_handler(lambda _, context: loop.errors.append(context))
    yield loop
    loop.run_until_complete(asyncio.sleep(0.2))
    loop.close()


SCENARIO_HANG_GUARD_S = 120.0   # a scenario takes seconds; past this it hangs (below the tier timeout)


@pytest.fixture
def run(loop):
    """run(scenario) runs the coroutine function on the module loop and fails the test on
    any unhandled exception in a background task."""
    def run_scenario(scenario):
        loop.errors.clear()
        result = loop.run_until_complete(asyncio.wait_for(scenario(), SCENARIO_HANG_GUARD_S))
        loop.run_until_complete(asyncio.sleep(0.05))
        assert not loop.errors, loop.errors
        return result
    return run_scenario


async def wait_until(predicate, timeout_s: float, what: str) -> float:
    """Seconds until predicate() holds; fails the test after timeout_s."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        await asyncio.sleep(0.01)
    return time.monotonic() - start
