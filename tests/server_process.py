"""A test-owned server process (etcd, redis-server) on loopback: start, wait until healthy,
stop, restart with the same ports and folder.

Lifecycle:  Server() -> start() -> [stop() / stop(kill=True) -> start()]* -> close()
Always stopped at the end: by `with`, by the test's fixture, or at interpreter exit.
Logs go to `<root>/<log_name>`. Subclasses give `command()` and `healthy()`.
"""
from __future__ import annotations

import atexit
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tests import service_logs


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    log_name = "server.log"

    def __init__(self, root: str | Path | None, prefix: str):
        self._own_root = root is None
        self.root = Path(root or tempfile.mkdtemp(prefix=prefix))
        self.root.mkdir(parents=True, exist_ok=True)
        self._proc: subprocess.Popen | None = None
        self._log = None
        atexit.register(self.close)
        service_logs.watch_server(self)

    def command(self) -> list[str]:
        raise NotImplementedError

    def healthy(self) -> bool:
        raise NotImplementedError

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def log_path(self) -> Path:
        return self.root / self.log_name

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self, timeout_s: float = 15.0):
        """Start (or restart); returns self once healthy."""
        if self.running:
            return self
        self._log = open(self.root / self.log_name, "ab")
        self._proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"{self.command()[0]} exited with {self._proc.returncode}; "
                                   f"see {self.root / self.log_name}")
            if self.healthy():
                return self
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"{self.command()[0]} not healthy after {timeout_s}s; see {self.root / self.log_name}")

    def stop(self, kill: bool = False) -> None:
        """SIGTERM (SIGKILL with kill=True, or after 10 s) and wait; the folder is kept."""
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
        """Stop and remove the folder when this object made it."""
        self.stop()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
