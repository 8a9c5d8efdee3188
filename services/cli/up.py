"""`pdmesh up --config FILE [--log-dir DIR] [--demo] [--autoscale ROLE=MIN:MAX,...] [--no-core-plan]
[--no-borrow-cores]`: a whole mesh on this host.

Lifecycle:
  load the config -> make the built-in tiny model when the config names `tiny_arch` and
  the model folder is missing -> start meta-server, engine nodes, gateway as separate
  processes (services.cli.launcher; one status line each, with its pid and cores) -> print
  exactly one line `gateway ready at HOST:PORT` -> supervise until Ctrl-C or SIGTERM (with --demo:
  stream a few built-in prompts through the gateway concurrently and print text and
  timings instead) -> stop every service (SIGTERM, SIGKILL after a grace period), a
  status line as each stops.

Cores: each engine node gets its share of this host's cores (the ones `pdmesh up` may run
on), pinned, one OpenMP thread per core, OMP_WAIT_POLICY=PASSIVE (where the environment
sets neither); meta-server, kv-store and gateway run on the cores left over, or share
them all when the engines take every core (1 prefill + 1 decode node on 2 cores: one
core each; one colocated node: both). The one decode node of a mesh with prefill nodes
also borrows their cores for the steps in which none of its prompts is prefilled
remotely (engine.borrow_cores, common/engine/borrowed_cores.py; --no-borrow-cores: not).
`engine.cpu_cores` in the config pins every engine node to those cores instead;
--no-core-plan makes no plan (an explicit engine.cpu_cores still pins). The status lines
say who runs where.

Credentials: the secrets the config (`security:`, gateway.api_keys_file) and the
environment do not give are made fresh for this mesh under LOG_DIR/credentials (0600 files:
cluster_secret, admin_token, api_keys) and handed to the services by environment variables
naming those files; one line says where. Where the running mesh and its client
credentials are is recorded in ~/.pdmesh/mesh.json ($PDMESH_STATE_DIR), paths only, so
that `pdmesh generate --gateway` and `pdmesh admin` work without flags; removed at stop.
A config that binds a service anywhere but the loopback needs TLS (security.tls_dir or
$PDMESH_TLS_DIR) or `security.allow_plaintext: true`; otherwise nothing starts (exit 2).

Supervising: every HEALTH_POLL_S each service's grpc.health is asked; a status line says
when one turns unhealthy (NOT_SERVING, or no answer within HEALTH_CHECK_S at SILENT_POLLS
polls in a row: stopped, stalled, overloaded) and when it is healthy again. A service that exits is started again
with the same arguments, after a
back-off that doubles with each restart of it within RESTART_WINDOW_S (0.5 s up to
MAX_BACKOFF_S), with a status line for the exit and one for the restart; the others keep
serving meanwhile. The mesh is stopped only on Ctrl-C / SIGTERM, or when one service
failed to start MAX_START_FAILURES times in a row.

Autoscaling (--autoscale prefill=1:3,decode=1:3; services/cli/autoscaler.py, docs/planner.md):
the config must enable the meta-server's planner (meta_server.planner); every planner
interval the supervisor reads its decision and starts nodes (ids ROLE-a1, ROLE-a2, ...,
weights from a live peer by default) or drains one: DrainNode, then, once the node has
nothing running, waiting or moving KV, SIGTERM. Never outside [MIN, MAX] per role; a role
not named is left as configured. One status line per action; the nodes it started stop
with the mesh.

Exit code: 0 after a clean stop or a successful demo; 1 when the mesh did not start, a
service kept failing to start, or a demo request failed; 2 on a bad config.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

GRACE_S = 10.0


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("up", help="start a whole mesh on this host", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="mesh YAML (e.g. deploy/local.yaml)")
    p.add_argument("--log-dir", default="", help="one log file per service (default: a new temp dir)")
    p.add_argument("--demo", action="store_true",
                   help="send a few prompts through the gateway, print timings, shut down")
    p.add_argument("--max-tokens", type=int, default=64,
                   help="--demo: tokens per request (an instruct model's answer may end before)")
    p.add_argument("--start-timeout", type=float, default=120.0, help="seconds per service")
    p.add_argument("--autoscale", default="", metavar="ROLE=MIN:MAX,...",
                   help="follow the planner: start and drain engine nodes within these bounds per role "
                        "(e.g. prefill=1:3,decode=1:3; needs meta_server.planner.enabled)")
    p.add_argument("--no-core-plan", action="store_true",
                   help="leave every service on every core with torch's default threads (a host shared "
                        "with other work, where a pinned engine could not move off a busy core)")
    p.add_argument("--no-borrow-cores", action="store_true",
                   help="keep the decode node on its own cores even while the prefill node's idle")
    return p


def ensure_model(mesh) -> None:
    """Make the model folder when it is missing (no config.json): pull mesh.pull, a known
    model (common/model/catalog.py: converted in a temporary folder, then renamed), or
    make the tiny model mesh.tiny_arch names (built in a sibling temp folder, then
    renamed): never half-written. ValueError when the folder is missing and the config
    says neither."""
    model = Path(mesh.model)
    if (model / "config.json").exists() or (model.suffix == ".gguf" and model.is_file()):
        return
    if mesh.pull:
        from common.model.catalog import pull_model
        print(f"pulling {mesh.pull} into {model} (pdmesh models pull)", flush=True)
        pull_model(mesh.pull, folder=model, say=lambda line: print(line, flush=True))
        return
    if not mesh.tiny_arch:
        raise ValueError(f"model folder {model} has no config.json (set pull to a known model, "
                         "or tiny_arch to make a tiny one)")
    from common.model.tiny import ARCHS, make_tiny_model
    if mesh.tiny_arch not in ARCHS:
        raise ValueError(f"tiny_arch must be one of {sorted(ARCHS)}, got {mesh.tiny_arch!r}")
    print(f"making the built-in tiny {mesh.tiny_arch} model in {model}", flush=True)
    model.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{model.name}-", dir=model.parent))
    make_tiny_model(mesh.tiny_arch, partial)
    os.replace(partial, model)


class _Interrupts:
    """SIGINT and SIGTERM raise KeyboardInterrupt once; later ones are ignored, so that
    stopping the services is never cut short."""

    def __init__(self) -> None:
        self.fired = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if not self.fired:
            self.fired = True
            raise KeyboardInterrupt


def _print_failed_logs(mesh, num_lines: int = 15) -> None:
    for svc in mesh.services.values():
        if svc.process is not None and svc.process.returncode not in (None, 0, -signal.SIGTERM):
            lines = svc.log_path.read_text(errors="replace").splitlines()[-num_lines:]
            print(f"--- last lines of {svc.log_path}:", *lines, sep="\n", file=sys.stderr)


MAX_START_FAILURES = 5
FIRST_BACKOFF_S, MAX_BACKOFF_S, RESTART_WINDOW_S = 0.5, 10.0, 60.0
# Health as seen by an operator: asked often enough that a status line follows a change
# within about a second, with a deadline short enough that one silent service does not
# hold up the loop that notices exits (5 services x HEALTH_CHECK_S at worst). Silence is
# reported after SILENT_POLLS polls in a row: a busy 2-core host misses one 0.3 s
# deadline now and then, and a line for each was noise (NOT_SERVING is reported at once).
HEALTH_POLL_S, HEALTH_CHECK_S, SILENT_POLLS = 1.0, 0.3, 2


class _HealthWatch:
    """Each running service's last grpc.health answer; a status line when it changes."""

    def __init__(self, mesh) -> None:
        self.mesh = mesh
        self.unhealthy: dict[str, str] = {}   # name -> why, while unhealthy
        self.silent: dict[str, int] = {}      # name -> polls in a row without an answer
        self.next_poll = time.monotonic() + HEALTH_POLL_S
        self._channels: dict[str, tuple[str, object]] = {}   # name -> (address, channel)

    def poll(self, skip=lambda name: False) -> None:
        """skip(name): a service not to ask now (one the autoscaler is starting or stopping)."""
        if time.monotonic() < self.next_poll:
            return
        self.next_poll = time.monotonic() + HEALTH_POLL_S
        for name in [n for n in self._channels if n not in self.mesh.services]:   # removed (autoscale)
            self.unhealthy.pop(name, None)
            self.silent.pop(name, None)
            self._drop(name)
        for name, svc in list(self.mesh.services.items()):
            if svc.process is None or svc.process.poll() is not None or skip(name):
                continue   # an exit has its own lines
            why = self._ask(name, svc.address)
            self.silent[name] = self.silent.get(name, 0) + 1 if why == "no answer" else 0
            if why == "no answer" and self.silent[name] < SILENT_POLLS:
                continue
            if why and name not in self.unhealthy:
                self.unhealthy[name] = why
                print(svc.status(f"unhealthy ({why})"), flush=True)
            elif not why and name in self.unhealthy:
                del self.unhealthy[name]
                print(svc.status("healthy again"), flush=True)

    def restarted(self, name: str) -> None:
        """Its restart said it is healthy; a new process may listen elsewhere."""
        self.unhealthy.pop(name, None)
        self.silent.pop(name, None)
        self._drop(name)

    def close(self) -> None:
        for name in list(self._channels):
            self._drop(name)

    def _ask(self, name: str, address: str) -> str:
        """"" when SERVING, else why not."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        from services.security.client_auth import client_channel
        if name in self._channels and self._channels[name][0] != address:
            self._drop(name)
        if name not in self._channels:
            self._channels[name] = (address, client_channel(address, tls=self.mesh.client_tls(), sync=True))
        stub = health_pb2_grpc.HealthStub(self._channels[name][1])
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=HEALTH_CHECK_S)
        except grpc.RpcError as e:
            return "no answer" if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else e.code().name
        return "" if reply.status == health_pb2.HealthCheckResponse.SERVING else \
            health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def _drop(self, name: str) -> None:
        entry = self._channels.pop(name, None)
        if entry is not None:
            entry[1].close()


class _Restarts:
    """One service's recent restarts: the back-off before the next one."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.failed_starts = 0

    def backoff_s(self, now: float) -> float:
        self.times = [t for t in self.times if now - t < RESTART_WINDOW_S]
        return min(FIRST_BACKOFF_S * 2 ** len(self.times), MAX_BACKOFF_S)


def _supervise(mesh, start_timeout_s: float, autoscaler=None) -> int:
    """Restart what exits, until a signal (KeyboardInterrupt) or until one service failed
    to start MAX_START_FAILURES times in a row (-> 1). autoscaler: stepped every round;
    the nodes it owns now (starting, draining, stopping) are its own to watch."""
    restarts: dict[str, _Restarts] = {}
    health = _HealthWatch(mesh)
    try:
        return _supervise_with(mesh, start_timeout_s, restarts, health, autoscaler)
    finally:
        health.close()


def _supervise_with(mesh, start_timeout_s: float, restarts: dict, health: _HealthWatch, autoscaler=None) -> int:
    owns = autoscaler.owns if autoscaler is not None else (lambda name: False)
    failed = ""
    while True:
        time.sleep(0.2)
        if autoscaler is not None:
            try:
                autoscaler.step()
            except Exception as e:   # noqa: BLE001 (a bug in the autoscaler must not stop the mesh it scales)
                if repr(e) != failed:
                    print(f"{'autoscale':<12} {'':<11} step failed: {e!r}; trying again", flush=True)
                failed = repr(e)
        health.poll(skip=owns)
        for name, svc in list(mesh.services.items()):
            if svc.process.poll() is None or owns(name):
                continue
            state = restarts.setdefault(name, _Restarts())
            delay = state.backoff_s(time.monotonic())
            print(f"{name:<12} exited with code {svc.process.returncode}; restarting in {delay:.1f}s "
                  f"(log: {svc.log_path})", flush=True)
            time.sleep(delay)
            state.times.append(time.monotonic())
            try:
                mesh.restart(name, timeout_s=start_timeout_s)
                health.restarted(name)
                state.failed_starts = 0
            except (RuntimeError, TimeoutError) as e:
                mesh.kill(name)   # started but never healthy: try again after the back-off
                state.failed_starts += 1
                print(f"{name:<12} failed to start ({state.failed_starts} of {MAX_START_FAILURES} in a row): {e}",
                      flush=True)
                if state.failed_starts >= MAX_START_FAILURES:
                    print(f"{name} failed to start {MAX_START_FAILURES} times in a row; stopping the mesh",
                          file=sys.stderr, flush=True)
                    _print_failed_logs(mesh)
                    return 1


def _check_tensor_parallel(mesh_cfg) -> None:
    """Every node's TP size fits the model (its heads divide), before any node starts:
    otherwise the node would fail to load and be restarted forever."""
    from common.model.config import load_model_config
    from common.parallel.shard import check_tensor_parallel
    sizes = {(e.tensor_parallel_size, e.enable_expert_parallel)
             for e in (mesh_cfg.engine_config(n) for n in mesh_cfg.nodes) if e.tensor_parallel_size > 1}
    if sizes:
        model = load_model_config(mesh_cfg.model)
        for size, expert_parallel in sorted(sizes):
            check_tensor_parallel(model, size, expert_parallel)


def run(args: argparse.Namespace) -> int:
    from common.config import load_mesh_config
    from common.model.catalog import PullError
    try:
        mesh_cfg = load_mesh_config(args.config)
        from services.security.bind_policy import check_mesh_binds
        check_mesh_binds(mesh_cfg)   # plaintext off the loopback: refused before anything starts
        from common.parallel import check_role
        for node in mesh_cfg.nodes:   # engine fields valid (cpu_cores among them) before anything starts
            check_role(node.role, mesh_cfg.engine_config(node).tensor_parallel_size, mesh_cfg.transfer.backend)
        mesh_cfg.engine_config()
        bounds = {}
        if args.autoscale:
            from services.cli.autoscale_plan import check_autoscale, parse_autoscale
            if args.demo:
                raise ValueError("--autoscale follows the load of a serving mesh; --demo stops after a few prompts")
            bounds = parse_autoscale(args.autoscale)
            check_autoscale(mesh_cfg, bounds)
        ensure_model(mesh_cfg)
        _check_tensor_parallel(mesh_cfg)
    except (OSError, ValueError, PullError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from services.cli.launcher import MeshProcesses
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdmesh-up-"))
    print(f"logs in {log_dir}", flush=True)
    mesh = MeshProcesses(args.config, mesh_cfg, log_dir, plan_cores=not args.no_core_plan,
                         borrow_cores=not args.no_borrow_cores)
    interrupts = _Interrupts()
    code = 0
    recorded: dict[str, str] = {}
    autoscaler = None
    try:
        address = mesh.start(timeout_s=args.start_timeout)
        recorded = _record(mesh)
        print(f"gateway ready at {address}", flush=True)
        if mesh.http_address:
            print(f"OpenAI-compatible HTTP API at {mesh.http_address}/v1", flush=True)
        if args.demo:
            from services.cli.demo import run_demo
            if mesh_cfg.tiny_arch:
                print("(the tiny model has random weights: its text is gibberish)", flush=True)
            code = run_demo(address, max_tokens=args.max_tokens, api_key=mesh.api_key(),
                            tls=mesh.client_tls(cert_name=None), http_address=mesh.http_address,
                            model=mesh_cfg.model, chat=not mesh_cfg.tiny_arch)
        else:
            if bounds:
                from services.cli.autoscale_local import LocalMesh
                from services.cli.autoscaler import Autoscaler
                interval_s = mesh_cfg.meta.planner.interval_s
                autoscaler = Autoscaler(LocalMesh(mesh), bounds, interval_s)
                print(f"{'autoscale':<12} {'':<11} " + ", ".join(f"{role} {b} nodes" for role, b in bounds.items())
                      + f", following the planner (every {interval_s:g}s)", flush=True)
            code = _supervise(mesh, args.start_timeout, autoscaler)
    except KeyboardInterrupt:
        pass
    except RuntimeError as e:
        if not isinstance(e.__cause__, KeyboardInterrupt):
            print(f"error: {e}", file=sys.stderr)
            _print_failed_logs(mesh)
            code = 1
    finally:
        interrupts.fired = True
        if autoscaler is not None:
            autoscaler.close()
        mesh.stop(grace_s=GRACE_S)
        if recorded:
            from services.security.mesh_secrets import clear_state
            clear_state(recorded)
    return code


def _dashboard_url(meta) -> str:
    """The meta-server's KV-memory dashboard (`pdmesh top` reads it), "" when off."""
    if not meta.dashboard_port:
        return ""
    host = "127.0.0.1" if meta.host in ("", "0.0.0.0") else "[::1]" if meta.host == "::" else meta.host
    return f"http://{host}:{meta.dashboard_port}"


def _record(mesh) -> dict[str, str]:
    """~/.pdmesh/mesh.json: where this mesh and its client credentials are."""
    from services.security.mesh_secrets import write_state
    environ, sec = mesh.environ, mesh.mesh.security
    values = {"gateway": mesh.gateway_address, "http": mesh.http_address, "meta": mesh.meta_address,
              "kv_store": mesh.kv_store_address,
              "dashboard": _dashboard_url(mesh.mesh.meta),
              "api_keys_file": mesh.mesh.gateway.api_keys_file or environ.get("PDMESH_API_KEYS_FILE", ""),
              "admin_token_file": sec.admin_token_file or environ.get("PDMESH_ADMIN_TOKEN_FILE", ""),
              "tls_dir": sec.tls_dir or environ.get("PDMESH_TLS_DIR", "")}
    values = {k: (str(Path(v).resolve()) if k.endswith(("_file", "_dir")) and v else v) for k, v in values.items()}
    path = write_state(values)
    print(f"client credentials: API key in {values['api_keys_file'] or '(none: the API is open)'}, "
          f"admin token in {values['admin_token_file'] or '(none)'} (recorded in {path})", flush=True)
    if values["dashboard"]:
        print(f"KV-memory dashboard at {values['dashboard']}/dashboard#token=ADMIN_TOKEN (pdmesh top)", flush=True)
    return values
