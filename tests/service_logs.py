"""The services a test started (meshes of processes, etcd, redis-server), so that a test
that fails or hangs says what they were doing: tests/conftest.py adds their last log
lines to the failure's report (a pytest-timeout hang included: it fails the test after
dumping every thread's stack).

    watch_mesh(mesh)        # services.cli.launcher.MeshProcesses, once started
    watch_server(server)    # tests.server_process.ServerProcess
    last_lines()            # "" when nothing watched is running
"""
from __future__ import annotations

from collections import deque
from pathlib import Path

NUM_LINES = 15          # per service: enough for the last request or traceback, short enough to read
_meshes: list = []
_servers: list = []


def watch_mesh(mesh) -> None:
    _meshes.append(mesh)


def watch_server(server) -> None:
    _servers.append(server)


def _tail(path: Path, num_lines: int) -> list[str]:
    try:
        with open(path, "rb") as f:
            return [line.decode("utf-8", "replace").rstrip() for line in deque(f, maxlen=num_lines)]
    except OSError as e:
        return [f"(cannot read {path}: {e.strerror})"]


def _state(process) -> str:
    if process is None:
        return "not started"
    code = process.poll()
    return f"running, pid {process.pid}" if code is None else f"exited {code}"


def last_lines(num_lines: int = NUM_LINES) -> str:
    """The last lines of every service of each watched mesh that still has a live process
    (a mesh stopped by its fixture is over), and of each watched server that runs."""
    parts = []
    for mesh in _meshes:
        services = list(mesh.services.values())
        if not any(s.process is not None and s.process.poll() is None for s in services):
            continue
        for svc in services:
            parts.append(f"== {svc.name} ({svc.role}, {_state(svc.process)}): {svc.log_path}")
            parts.extend(_tail(svc.log_path, num_lines))
    for server in _servers:
        if server.running:
            parts.append(f"== {type(server).__name__} (running, pid {server.pid}): {server.log_path}")
            parts.extend(_tail(server.log_path, num_lines))
    return "\n".join(parts)
