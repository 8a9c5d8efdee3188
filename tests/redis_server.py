"""A real redis-server on a free loopback port, for tests.

Lifecycle:  RedisServer() -> start() -> [stop() / kill() -> start()]* -> close()
Nothing is persisted (`--save '' --appendonly no`): a restarted server is empty, like a
Redis that lost its memory. Always stopped at the end: by `with`, by the `redis_server`
fixture, or at interpreter exit. Logs go to `<root>/redis.log`.

Missing binary: `require_redis()` skips the test with the reason (`make sysdeps`
installs Debian's redis-server when running as root).
"""
from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.etcd_server import free_port

REDIS_BINARY = os.environ.get("PDMESH_REDIS_BINARY", "redis-server")


def require_redis() -> str:
    path = shutil.which(REDIS_BINARY)
    if path is None:
        pytest.skip(f"`{REDIS_BINARY}` not found on PATH (install redis-server: `make sysdeps` as root)")
    return path


class RedisServer:
    def __init__(self, root: str | Path | None = None):
        self.binary = require_redis()
        self._own_root = root is None
        self.root = Path(root or tempfile.mkdtemp(prefix="pdmesh-redis-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self._proc: subprocess.Popen | None = None
        atexit.register(self.close)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def start(self, timeout_s: float = 10.0) -> "RedisServer":
        if self._proc is not None and self._proc.poll() is None:
            return self
        with open(self.root / "redis.log", "ab") as log:
            self._proc = subprocess.Popen(
                [self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
                 "--appendonly", "no", "--dir", str(self.root)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self._proc.returncode}; see {self.root / 'redis.log'}")
            if self.ping():
                return self
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"redis-server not answering after {timeout_s}s")

    def stop(self, kill: bool = False) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def close(self) -> None:
        self.stop()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


@pytest.fixture
def redis_server(tmp_path):
    """A started RedisServer for one test (skips when redis-server is not installed)."""
    server = RedisServer(tmp_path / "redis")
    try:
        yield server.start()
    finally:
        server.close()
