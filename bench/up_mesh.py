"""`pdmesh up` driven from a bench script: the process and its stamped lines (UpProcess),
and the operator's view of its meta-server polled in the background (Poller)."""
from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POLL_S = 0.5
STOP_GUARD_S = 120.0              # `pdmesh up` stops every service on SIGTERM well within this


class UpProcess:
    """`pdmesh up` in a subprocess; its lines, each stamped (time.monotonic()) as read."""

    def __init__(self, config: Path, log_dir: Path, extra: list[str], env: dict[str, str]):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "up", "--config", str(config), "--log-dir", str(log_dir),
             "--no-core-plan", *extra],
            cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", **env}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        self.lines: list[tuple[float, str]] = []
        self._new: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))
            self._new.put(line.rstrip("\n"))
        self._new.put(None)

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self._new.get(timeout=0.2)
            except queue.Empty:
                continue
            if line is None:
                break
            if m := re.match(pattern, line):
                return m
        raise RuntimeError(f"pdmesh up: no line matching {pattern!r}; output:\n" +
                           "\n".join(text for _, text in self.lines))

    def stop(self) -> int:
        """SIGTERM (pdmesh up stops every service), then, only if it hangs, SIGKILL to it and
        to the process groups of the services it named (their pids from its lines)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=STOP_GUARD_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for _, line in self.lines:
            if m := re.search(r"\(pid (\d+)", line):
                try:
                    os.killpg(int(m[1]), signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        return self.proc.returncode


class Poller:
    """Every POLL_S, as the operator: the engine nodes the meta-server lists (up or
    draining) and the planner's last decision, into samples."""

    def __init__(self, meta: str):
        from services.security.client_creds import operator_channel
        self.channel = operator_channel(meta)
        self.samples: list[tuple[float, list[str], dict]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import grpc
        from protos.pdmesh.v1 import meta_pb2, meta_pb2_grpc
        stub = meta_pb2_grpc.MetaAdminStub(self.channel)
        while not self._stop.wait(POLL_S):
            try:
                nodes = stub.ListNodes(meta_pb2.ListNodesRequest(), timeout=2).nodes
                plan = stub.GetPlanner(meta_pb2.GetPlannerRequest(), timeout=2)
            except grpc.RpcError:
                continue
            live = [n.info.node_id for n in nodes if n.state in ("up", "draining")]
            decode = next((r for r in plan.roles if r.role == "decode"), None)
            self.samples.append((time.monotonic(), live, {
                "decision": plan.num_decisions, "current": decode.current_nodes if decode else 0,
                "wanted": decode.wanted_nodes if decode else 0, "desired": decode.desired_nodes if decode else 0}))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.channel.close()
