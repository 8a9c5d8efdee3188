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
import atexit
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

ETCD_BINARY = os.environ.get("PDMESH_ETCD_BINARY", "etcd")


def etcd_binary() -> str | None:
    return shutil.which(ETCD_BINARY)


def require_etcd() -> str:
    path = etcd_binary()
    if path is None:
        pytest.skip(f"`{ETCD_BINARY}` not found on PATH (install etcd-server: `make sysdeps` as root)")
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EtcdServer:
    """One etcd process; `endpoint` is "127.0.0.1:<client port>" (aetcd style)."""

    def __init__(self, root: str | Path | None = None, name: str = "t"):
        self.binary = require_etcd()
        self._own_root = root is None
        self.root = Path(root or tempfile.mkdtemp(prefix="pdmesh-etcd-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self.data_dir = self.root / "data"
        self.name = name
        self.client_port = free_port()
        self.peer_port = free_port()
        while self.peer_port == self.client_port:
            self.peer_port = free_port()
        self._proc: subprocess.Popen | None = None
        self._log = None
        atexit.register(self.close)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        return f"http://{self.endpoint}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def command(self) -> list[str]:
        peer = f"http://127.0.0.1:{self.peer_port}"
        return [self.binary, "--name", self.name, "--data-dir", str(self.data_dir),
                "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"{self.name}={peer}", "--initial-cluster-state", "new",
                "--heartbeat-interval=10", "--election-timeout=100"]

    def start(self, timeout_s: float = 15.0) -> "EtcdServer":
        """Start (or restart) etcd on the same ports and data dir; returns once healthy."""
        if self.running:
            return self
        self._log = open(self.root / "etcd.log", "ab")
        self._proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self._proc.returncode}; see {self.root / 'etcd.log'}")
            if self.healthy():
                return self
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"etcd not healthy after {timeout_s}s; see {self.root / 'etcd.log'}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1) as resp:
                return resp.status == 200 and b'"true"' in resp.read()
        except OSError:
            return False

    def stop(self, kill: bool = False) -> None:
        """SIGTERM (SIGKILL with kill=True, or after 10 s) and wait; the data dir is kept."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def close(self) -> None:
        """Stop and remove the data dir when this object made it."""
        self.stop()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "EtcdServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


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


@pytest.fixture
def run(loop):
    """run(scenario) runs the coroutine function on the module loop and fails the test on
    any unhandled exception in a background task."""
    def run_scenario(scenario):
        loop.errors.clear()
        result = loop.run_until_complete(asyncio.wait_for(scenario(), 45))
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
