"""A real redis-server on a free loopback port, for tests.

Lifecycle:  RedisServer() -> start() -> [stop() / kill() -> start()]* -> close()
Nothing is persisted (`--save '' --appendonly no`): a restarted server is empty, like a
Redis that lost its memory. Always stopped at the end: by `with`, by the `redis_server`
fixture, or at interpreter exit. Logs go to `<root>/redis.log`.

Missing binary: `require_redis()` skips the test with the reason (`make sysdeps`
installs Debian's redis-server when running as root).
"""
from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import pytest

from tests.server_process import ServerProcess, free_port

REDIS_BINARY = os.environ.get("PDMESH_REDIS_BINARY", "redis-server")


def require_redis() -> str:
    path = shutil.which(REDIS_BINARY)
    if path is None:
        pytest.skip(f"`{REDIS_BINARY}` not found on PATH (install redis-server: `make sysdeps` as root)")
    return path


class RedisServer(ServerProcess):
    log_name = "redis.log"

    def __init__(self, root: str | Path | None = None):
        self.binary = require_redis()
        super().__init__(root, "pdmesh-redis-")
        self.port = free_port()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        return [self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
                "--appendonly", "no", "--dir", str(self.root)]

    def healthy(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False


@pytest.fixture
def redis_server(tmp_path):
    """A started RedisServer for one test (skips when redis-server is not installed)."""
    server = RedisServer(tmp_path / "redis")
    try:
        yield server.start()
    finally:
        server.close()
