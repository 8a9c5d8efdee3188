"""Starts a whole mesh as separate processes on this host (`pdmesh up`, integration tests).

Order: meta-server -> kv-store (when configured) -> engine nodes -> gateway. Port 0 in the config means "pick a free
port" (one that no other port of the mesh has, planned or configured); the choice is passed to each process with
--port / --meta. Each start waits for grpc.health.v1 SERVING from the service's own process (a stranger that took
its port would answer SERVING too) and, for engine nodes, for their registration at the
meta-server, and prints one status line per service, with its cores and, when it serves
metrics (its metrics_port), where: http://HOST:PORT/metrics. Standby meta-servers share
meta_server's config, so each gets a free metrics port of its own (--metrics-port).

Cores (common/cpu_budget.plan_cores): the engine nodes split the cores this
process may use (a node at tensor_parallel_size N as N engines), one OpenMP thread per
core, unless engine.cpu_cores names theirs; the one decode node of a mesh with prefill
nodes borrows their cores while none of its prompts is prefilled remotely
(cpu_budget.plan_borrowing; borrow_cores=False: not);
meta-server, kv-store and gateway run on the cores left over, or on all when none are.
Each process starts pinned (and an engine with OMP_NUM_THREADS and the OpenMP wait policy
in its environment, where the environment does not set them already); plan_cores=False
leaves every process on every core. Credentials reach the processes in
the environment (`env`: variables naming files, services/security/credentials.py); the
launcher itself calls as the operator (admin token, admin.crt with TLS). `stop` sends SIGTERM tier by tier
(gateway, engine nodes, kv-store, meta-servers) and SIGKILL to whatever outlives the grace
period.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import cpu_budget
from common.bind_error import EXIT_CODE as BIND_EXIT_CODE
from common.config import MeshConfig
from protos.pdmesh.v1 import meta_pb2, meta_pb2_grpc
from services.cli.service_process import Service, listening_ports, wait_healthy  # noqa: F401 (re-exported)
from services.node.grpc_util import free_port, port_in_use

ROOT = Path(__file__).resolve().parents[2]
BIND_RETRIES = 2        # a planned port taken before the service bound it: that many more tries


@dataclass
class MeshProcesses:
    config_path: str
    mesh: MeshConfig
    log_dir: Path
    quiet: bool = False
    plan_cores: bool = True             # split the host's cores (module docstring)
    borrow_cores: bool = True           # lend the decode node the prefill nodes' idle cores
    services: dict[str, Service] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)   # set for every service's process
    planned_ports: set[int] = field(default_factory=set)   # configured or planned for a service of this mesh

    def _say(self, line: str) -> None:
        if not self.quiet:
            print(line, flush=True)

    def _new_port(self, host: str) -> int:
        """A free port on host that no service of this mesh is configured with or was
        planned on: free_port's answer is free only until another process binds it, so
        two calls may return one port, and a retry's new port may be one planned for a
        service not started yet. Adds it to planned_ports."""
        for _ in range(100):
            port = free_port(host)
            if port not in self.planned_ports:
                self.planned_ports.add(port)
                return port
        raise RuntimeError(f"no free port on {host} that this mesh has not planned already")

    def _plan(self) -> None:
        m = self.mesh
        self.planned_ports = {port for _, _, port in self._fixed_ports() if port}
        meta_port = m.meta.port or self._new_port(m.meta.host)
        meta_host = m.meta.advertise_host or m.meta.host
        self.meta_address = f"{meta_host}:{meta_port}"
        self.services["meta-server"] = Service("meta-server", "meta-server", meta_host, meta_port,
                                               [], self.log_dir / "meta-server.log",
                                               metrics_port=m.meta.metrics_port, port_planned=not m.meta.port)
        self.meta_addresses = [self.meta_address]
        for i in range(1, m.meta.standbys + 1):
            port = self._new_port(m.meta.host)
            name = f"meta-server-{i}"
            metrics_port = self._new_port(m.meta.host) if m.meta.metrics_port else 0
            self.services[name] = Service(name, "meta-server", meta_host, port,
                                          ["--metrics-port", str(metrics_port)] if metrics_port else [],
                                          self.log_dir / f"{name}.log", metrics_port=metrics_port)
            self.meta_addresses.append(f"{meta_host}:{port}")
        self.kv_store_address = ""
        if m.kv_store is not None:
            kv = m.kv_store
            port = kv.port or self._new_port(kv.host)
            self.services["kv-store"] = Service("kv-store", "kv-store", kv.advertise_host or kv.host,
                                                port, [], self.log_dir / "kv-store.log",
                                                metrics_port=kv.metrics_port)
            self.kv_store_address = self.services["kv-store"].address
        for node in m.nodes:
            port = node.port or self._new_port(node.host)
            self.services[node.node_id] = Service(node.node_id, node.role, node.advertised_host, port,
                                                  ["--node-id", node.node_id],
                                                  self.log_dir / f"{node.node_id}.log",
                                                  metrics_port=node.metrics_port, port_planned=not node.port)
        gw_port = m.gateway.port or self._new_port(m.gateway.host)
        # a wildcard bind is dialled on the loopback: an address that TLS certificates name
        gw_host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "[::1]", "[::]": "[::1]"}.get(m.gateway.host,
                                                                                               m.gateway.host)
        self.services["gateway"] = Service("gateway", "gateway", gw_host, gw_port, [],
                                           self.log_dir / "gateway.log", metrics_port=m.gateway.metrics_port,
                                           http_port=m.gateway.http_port,
                                           http_scheme="https" if m.security.tls_dir or self.environ.get(
                                               "PDMESH_TLS_DIR") else "http", port_planned=not m.gateway.port)
        self._plan_cores()

    def _plan_cores(self) -> None:
        available = cpu_budget.allowed_cpus()
        engine = self.mesh.engine_config()
        nodes = [n.node_id for n in self.mesh.nodes]
        control = [name for name in self.services if name not in nodes]
        own = {n.node_id: self.mesh.engine_config(n).cpu_cores for n in self.mesh.nodes}
        explicit = {n: cores for n, cores in own.items() if cores}
        if self.plan_cores and available:
            ranks = {n.node_id: self.mesh.engine_config(n).tensor_parallel_size for n in self.mesh.nodes}
            plan = cpu_budget.plan_cores(available, nodes, control, explicit, engine.num_threads, ranks)
            if self.borrow_cores and not any(self.mesh.engine_config(n).borrow_cores for n in self.mesh.nodes):
                plan = cpu_budget.plan_borrowing(plan, {n.node_id: n.role for n in self.mesh.nodes}, ranks)
        else:
            plan = {name: cpu_budget.CoreShare(explicit[name], True, by_config=True) if name in explicit
                    else cpu_budget.CoreShare(available, False) for name in self.services}
        for name, share in plan.items():
            self.services[name].cpu = share

    def _fixed_ports(self) -> list[tuple[str, str, int]]:
        """(what, bind host, port) of every port the config names (0: planned instead)."""
        m = self.mesh
        fixed = [("meta-server", m.meta.host, m.meta.port), ("gateway", m.gateway.host, m.gateway.port),
                 ("gateway HTTP", m.gateway.host, m.gateway.http_port),
                 ("meta-server dashboard", m.meta.host, m.meta.dashboard_port),
                 *((n.node_id, n.host, n.port) for n in m.nodes)]
        if m.kv_store is not None:
            fixed.append(("kv-store", m.kv_store.host, m.kv_store.port))
        return fixed + [(f"{name} metrics", host, port) for name, host, port in self._metrics_ports()]

    def _check_ports(self) -> None:
        """Fixed ports must be free: a stranger there would answer our health checks."""
        fixed = self._fixed_ports()
        seen: dict[tuple[str, int], str] = {}
        for name, host, port in fixed:
            if port and (host, port) in seen:
                raise RuntimeError(f"{name} and {seen[host, port]} both have port {host}:{port}")
            seen[host, port] = name
        taken = [f"{name} {host}:{port}" for name, host, port in fixed if port and port_in_use(host, port)]
        if taken:
            raise RuntimeError(f"port(s) already in use: {', '.join(taken)} (another mesh running?)")

    def _metrics_ports(self) -> list[tuple[str, str, int]]:
        """(service, bind host, metrics_port) of each service configured to serve metrics."""
        m = self.mesh
        ports = [("meta-server", m.meta.host, m.meta.metrics_port), ("gateway", m.gateway.host, m.gateway.metrics_port),
                 *((n.node_id, n.host, n.metrics_port) for n in m.nodes)]
        if m.kv_store is not None:
            ports.append(("kv-store", m.kv_store.host, m.kv_store.metrics_port))
        return [p for p in ports if p[2]]

    def _spawn(self, svc: Service) -> None:
        cmd = [sys.executable, "-m", "services.cli", "serve", svc.role, "--config", svc.config_path or self.config_path,
               "--port", str(svc.port), "--meta", ",".join(self.meta_addresses), *svc.args]
        if self.kv_store_address:
            cmd += ["--kv-store", self.kv_store_address]
        cpu = svc.cpu
        engine_env = {}
        if cpu is not None and svc.role in ("prefill", "decode", "both") and (cpu.pinned or cpu.num_threads):
            engine_env = cpu_budget.openmp_env(cpu.num_threads)
        if cpu is not None and cpu.borrows:
            cmd += ["--borrow-cores", cpu_budget.format_cpu_list(cpu.borrows)]
        if cpu is not None and cpu.pinned:
            cmd = cpu_budget.pinned_command(cmd, cpu.cores)
        env = {**engine_env, **os.environ, **self.env, **svc.env,
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        log = open(svc.log_path, "ab")
        svc.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True)
        log.close()

    @property
    def environ(self) -> dict[str, str]:
        """What the services' environment holds (before per-service additions)."""
        return {**os.environ, **self.env}

    def _make_credentials(self) -> None:
        """Fresh secrets for what neither the config nor the environment gives, for this
        mesh only (services/security/mesh_secrets.py); checked before anything starts."""
        from services.security.credentials import load_credentials
        from services.security.mesh_secrets import make_missing_secrets
        folder = self.log_dir / "credentials"
        made = make_missing_secrets(self.mesh, folder, self.environ)
        self.env.update(made)
        load_credentials(self.mesh.security, "gateway", self.mesh.gateway.api_keys_file, environ=self.environ)
        if made:
            self._say(f"credentials made for this mesh in {folder} "
                      f"({', '.join(Path(p).name for p in made.values())}; mode 0600)")

    def client_tls(self, cert_name: str | None = "admin"):
        """With TLS: the CA and cert_name's certificate (None: the CA only), else None."""
        from services.security.client_creds import client_tls
        return client_tls(self.mesh.security.tls_dir, cert_name, environ=self.environ, address=self.meta_address)

    def api_key(self) -> str | None:
        """A client API key of the gateway (None when it has none)."""
        from services.security.client_creds import api_key
        path = self.mesh.gateway.api_keys_file or self.environ.get("PDMESH_API_KEYS_FILE", "")
        return api_key(path) if path else None

    def gateway_channel(self):
        """A grpc.aio channel to the gateway as a client holding an API key."""
        from services.security.client_auth import client_channel
        return client_channel(self.gateway_address, bearer=self.api_key(), tls=self.client_tls(None))

    def admin_channel(self):
        """A blocking channel to the meta-server as the operator (admin token)."""
        return self.operator_channel(self.meta_address)

    def operator_channel(self, address: str):
        """A blocking channel to any service of the mesh as the operator (admin token; with
        TLS, admin.crt): MetaAdmin, and the stats an operator may read (GetEngineStats)."""
        from services.security.client_auth import client_channel
        from services.security.client_creds import admin_token
        token = admin_token(self.mesh.security.admin_token_file, environ=self.environ, address=self.meta_address)
        return client_channel(address, bearer=token, tls=self.client_tls(), sync=True)

    def _wait_healthy(self, svc: Service, timeout_s: float, replan: bool = True) -> None:
        """Until svc's own process serves (wait_healthy). With replan, the leading
        meta-server, a node or the gateway whose planned port was taken between planning
        and binding (free_port's answer is free only until another process binds it; the
        ranks' gloo and the transfer engines bind ephemeral ports too) starts again on a
        new port (_new_port), up to BIND_RETRIES times: at the mesh's start nothing knew its
        address yet (the meta-server is up before anything else starts; a node registers
        once healthy). Standby meta-servers and the kv-store are not retried: the nodes
        starting beside them were given their addresses."""
        for attempt in range(BIND_RETRIES + 1):
            try:
                wait_healthy(svc.address, timeout_s, svc.process, tls=self.client_tls())
                return
            except RuntimeError:
                taken = svc.process is not None and svc.process.poll() == BIND_EXIT_CODE
                if not (taken and replan and svc.port_planned and attempt < BIND_RETRIES):
                    raise
            old = svc.port
            svc.port = self._new_port(self._bind_host(svc))
            if svc.name == "meta-server":
                self.meta_address = self.meta_addresses[0] = svc.address
            self._say(f"{svc.name:<12} port {old} was taken meanwhile; starting again on {svc.port}")
            self._spawn(svc)

    def _bind_host(self, svc: Service) -> str:
        if svc.role == "gateway":
            return self.mesh.gateway.host
        if svc.name == "meta-server":
            return self.mesh.meta.host
        return next(n.host for n in self.mesh.nodes if n.node_id == svc.name)

    def _wait_registered(self, node_ids: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self.admin_channel() as channel:
            stub = meta_pb2_grpc.MetaAdminStub(channel)
            while True:
                members = {n.info.node_id for n in stub.ListNodes(meta_pb2.ListNodesRequest(), timeout=2).nodes
                           if n.state != "down"}
                if set(node_ids) <= members:
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nodes {sorted(set(node_ids) - members)} did not register")
                time.sleep(0.1)

    def start(self, timeout_s: float = 120.0) -> str:
        """Start everything; returns the gateway address. Stops what started on failure."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._make_credentials()
        self._check_ports()
        self._plan()
        try:
            standbys = [f"meta-server-{i}" for i in range(1, self.mesh.meta.standbys + 1)]
            store = ["kv-store"] if self.kv_store_address else []
            order = ["meta-server", *standbys, *store, *[n.node_id for n in self.mesh.nodes]]
            self._spawn(self.services["meta-server"])  # first, so it normally leads
            self._wait_healthy(self.services["meta-server"], timeout_s)
            for name in order[1:]:
                self._spawn(self.services[name])
            for name in order:
                svc = self.services[name]
                self._wait_healthy(svc, timeout_s)
                self._say(svc.status("healthy"))
            self._wait_registered([n.node_id for n in self.mesh.nodes], timeout_s)
            gw = self.services["gateway"]
            self._spawn(gw)
            self._wait_healthy(gw, timeout_s)
            self._say(gw.status("healthy"))
            if gw.http_port:
                self._say(f"{'gateway':<12} {'http':<11} OpenAI-compatible API at {gw.http_address}/v1")
        except BaseException as e:
            self.stop()
            logs = "\n".join(f"  {s.log_path}" for s in self.services.values())
            raise RuntimeError(f"mesh did not start: {e}\nlogs:\n{logs}") from e
        return gw.address

    @property
    def gateway_address(self) -> str:
        return self.services["gateway"].address

    @property
    def http_address(self) -> str:
        """http(s)://HOST:PORT of the gateway's OpenAI-compatible API ("" when http_port is 0)."""
        return self.services["gateway"].http_address

    def restart(self, name: str, timeout_s: float = 60.0, env: dict[str, str] | None = None) -> None:
        """Start a stopped or killed service again with the same arguments (and, when
        given, env as its own environment from now on). Only an engine node moves to a new
        port when its planned one was taken meanwhile (it registers the new address); the
        others' addresses are held by the services and clients that were given them."""
        svc = self.services[name]
        if env is not None:
            svc.env = dict(env)
        self._spawn(svc)
        self._wait_healthy(svc, timeout_s, replan=svc.role in ("prefill", "decode", "both"))
        self._say(svc.status("restarted"))

    def add_node(self, node: dict, env: dict[str, str] | None = None, timeout_s: float = 120.0,
                 wait: bool = True):
        """Start one more engine node in the running mesh. node: a `nodes:` entry (role,
        node_id, ... ; ValueError naming the field when it is not one); env: set for its
        process. Its config (the mesh's plus this entry) is written beside its log, so
        restart() starts it alike. wait: return once it is healthy and registered (a
        RuntimeError naming its log when it exits or does not come up), else at once with
        a callable that waits so."""
        import yaml
        from common.config import mesh_config_from_dict
        raw = yaml.safe_load(Path(self.config_path).read_text())
        if any(n.get("node_id") == node.get("node_id") for n in raw.get("nodes", [])) \
                or node.get("node_id") in self.services:
            raise ValueError(f"nodes[].node_id {node.get('node_id')!r} is already in the mesh")
        raw["nodes"] = [*raw.get("nodes", []), dict(node)]
        cfg = next(n for n in mesh_config_from_dict(raw).nodes if n.node_id == node.get("node_id"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        config_path = self.log_dir / f"{cfg.node_id}.yaml"
        config_path.write_text(yaml.safe_dump(raw))
        svc = Service(cfg.node_id, cfg.role, cfg.advertised_host, cfg.port or self._new_port(cfg.host),
                      ["--node-id", cfg.node_id], self.log_dir / f"{cfg.node_id}.log", env=dict(env or {}),
                      metrics_port=cfg.metrics_port, port_planned=not cfg.port, config_path=str(config_path))
        self.services[cfg.node_id] = svc
        self._spawn(svc)

        def finish() -> None:
            try:
                self._wait_healthy(svc, timeout_s)
                self._wait_registered([cfg.node_id], timeout_s)
            except (RuntimeError, TimeoutError) as e:
                self.kill(cfg.node_id)
                raise RuntimeError(f"{cfg.node_id} did not start: {e} (log: {svc.log_path})") from e
            self._say(svc.status("started"))
        if wait:
            finish()
            return None
        return finish

    def remove_node(self, name: str, grace_s: float = 30.0) -> int | None:
        """Stop engine node `name` and forget it: SIGTERM (it stops serving and deregisters),
        SIGKILL past grace_s; then it leaves `services` (the supervisor of `pdmesh up` no
        longer restarts it, stop() no longer stops it) and its port the planned ones.
        Blocks until it exited; returns its exit code (None when it never ran). It does not
        drain the node: a caller that must lose no request drains it first and waits until
        it is idle (services/cli/autoscaler.py). A thread other than the one iterating
        `services` may call it when that one iterates over a copy."""
        svc = self.services[name]
        if svc.role not in ("prefill", "decode", "both"):
            raise ValueError(f"{name} is a {svc.role}, not an engine node")
        proc = svc.process
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=grace_s)
                self._say(f"{name:<12} stopped")
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                self._say(f"{name:<12} killed after {grace_s:.0f}s")
        self.services.pop(name, None)
        self.planned_ports.discard(svc.port)
        return None if proc is None else proc.returncode

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.services[name].process
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=30)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM in tiers, each waited for: gateway, engine nodes, kv-store, meta-servers,
        so that nothing loses a peer it is still talking to (a node finishing a kv-store
        put, deregistering from the meta-server). SIGKILL past grace_s per tier."""
        tiers = [["gateway"], ["prefill", "decode", "both"], ["kv-store"], ["meta-server"]]
        for roles in tiers:
            running = [s for s in list(self.services.values()) if s.role in roles
                       and s.process is not None and s.process.poll() is None]
            for svc in reversed(running):
                try:
                    os.killpg(svc.process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace_s
            for svc in reversed(running):
                try:
                    svc.process.wait(timeout=max(0.1, deadline - time.monotonic()))
                    self._say(f"{svc.name:<12} stopped")
                except subprocess.TimeoutExpired:
                    os.killpg(svc.process.pid, signal.SIGKILL)
                    svc.process.wait()
                    self._say(f"{svc.name:<12} killed after {grace_s:.0f}s")
