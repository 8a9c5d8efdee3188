"""One service process of a mesh started by the launcher (services/cli/launcher.py): what it
is (Service: role, address, log, cores, environment) and when it counts as healthy
(wait_healthy: grpc.health.v1 SERVING from its own process, read from /proc where there is
one, so that a stranger on a planned port is never taken for it)."""
from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import cpu_budget


@dataclass
class Service:
    name: str
    role: str
    host: str
    port: int
    args: list[str]
    log_path: Path
    process: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)   # set for this service's process only
    cpu: cpu_budget.CoreShare | None = None
    metrics_port: int = 0               # GET /metrics there (0 = none)
    port_planned: bool = False          # the launcher chose `port` (free then, maybe taken by now)
    http_port: int = 0                  # the gateway's OpenAI-compatible HTTP API (0 = none)
    http_scheme: str = "http"           # https when the mesh runs TLS
    config_path: str = ""               # its own config file ("": the mesh's; add_node)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def metrics_address(self) -> str:
        """http://HOST:PORT/metrics, or "" when the service serves no metrics."""
        return f"http://{self.host}:{self.metrics_port}/metrics" if self.metrics_port else ""

    def status(self, what: str) -> str:
        cores = f", {self.cpu.describe()}" if self.cpu is not None else ""
        metrics = f", metrics at {self.metrics_address}" if self.metrics_port else ""
        return f"{self.name:<12} {self.role:<11} {what} at {self.address}{metrics} (pid {self.process.pid}{cores})"

    @property
    def http_address(self) -> str:
        """http(s)://HOST:PORT of the gateway's HTTP API, or "" when it has none."""
        return f"{self.http_scheme}://{self.host}:{self.http_port}" if self.http_port else ""


# the service binds its port a few seconds after it was spawned: without these, gRPC backs
# off 1 s, then 1.6 s, ... between connection attempts, and a service that binds just
# after an attempt is seen up to seconds late (every `pdmesh up` and test mesh waited so)
# (min_reconnect_backoff_ms is left alone: gRPC takes it as the connect timeout)
HEALTH_POLL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 250)]


def listening_ports(pid: int) -> set[int] | None:
    """The TCP ports process pid listens on (from /proc; set() once it has exited), or
    None where the OS has no /proc to read them from."""
    if not os.path.isdir("/proc/self/fd"):
        return None
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return set()
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue        # closed meanwhile
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:    # sl local_address rem_address st ... inode
            fields = row.split()
            if fields[3] == "0A" and fields[9] in inodes:    # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def wait_healthy(address: str, timeout_s: float, process: subprocess.Popen | None = None,
                 tls=None) -> None:
    """Until address answers SERVING; with process, only once that process listens on
    the address's port (another server that took the port answers SERVING as well); a
    RuntimeError when process exits first. tls: TLSFiles (the CA and the admin
    certificate) when the mesh runs TLS."""
    from services.security.client_auth import client_channel
    deadline = time.monotonic() + timeout_s
    port = int(address.rsplit(":", 1)[1])
    with client_channel(address, tls=tls, sync=True, options=HEALTH_POLL_OPTIONS) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"process for {address} exited with code {process.returncode}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING and (
                        process is None or (ports := listening_ports(process.pid)) is None or port in ports):
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} not healthy after {timeout_s:.0f}s")
            time.sleep(0.1)
