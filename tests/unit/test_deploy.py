"""deploy/ and docker-compose.yml agree with the CLI and with each other: every compose
command parses, the configs they name load, and addresses, ports and the model path line
up across services. `docker-compose config -q` too when docker-compose is installed."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from common.config import load_mesh_config
from services.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
LOCAL = ROOT / "deploy" / "local.yaml"
ENGINE_ROLES = ("prefill", "decode", "both")


def _image_root() -> str:
    """The image's WORKDIR, where the Dockerfile copies deploy/."""
    lines = (ROOT / "deploy" / "Dockerfile").read_text().splitlines()
    assert "COPY deploy deploy" in lines
    return next(line.split()[1] for line in lines if line.startswith("WORKDIR "))


def _host_path(image_path: str) -> Path:
    root = _image_root().rstrip("/") + "/"
    assert image_path.startswith(root), f"{image_path} is not under the image's {root}"
    return ROOT / image_path[len(root):]


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


@pytest.fixture(scope="module")
def parsed(services) -> dict:
    """service name -> argparse.Namespace of its command, for the services of our image."""
    return {name: build_parser().parse_args(svc["command"]) for name, svc in services.items()
            if svc.get("image") == "pdmesh:cpu"}


@pytest.fixture(scope="module")
def mesh(parsed):
    configs = {args.config for args in parsed.values() if args.command == "serve"}
    assert len(configs) == 1, f"every serve command names the same config, got {configs}"
    return load_mesh_config(str(_host_path(configs.pop())))


def test_every_command_parses_and_names_a_known_node(parsed, mesh):
    roles = sorted(args.role for args in parsed.values() if args.command == "serve")
    assert roles == sorted(["meta-server", "gateway", "kv-store", *(n.role for n in mesh.nodes)])
    for name, args in parsed.items():
        if args.command == "serve":
            assert args.port is None and args.meta == "", f"{name}: ports come from the config"
            if args.role in ENGINE_ROLES:
                assert mesh.node(args.node_id).role == args.role


def test_meta_address_is_the_meta_server_service(parsed, mesh):
    [meta_service] = [n for n, a in parsed.items() if a.command == "serve" and a.role == "meta-server"]
    assert mesh.meta.address == f"{meta_service}:{mesh.meta.port}"
    assert mesh.meta.host in ("0.0.0.0", meta_service)


def test_nodes_advertise_their_service_names(parsed, mesh):
    by_node = {a.node_id: n for n, a in parsed.items() if a.command == "serve" and a.role in ENGINE_ROLES}
    assert sorted(by_node) == sorted(n.node_id for n in mesh.nodes)
    for node in mesh.nodes:
        assert node.advertised_host == by_node[node.node_id]
        assert node.host in ("0.0.0.0", node.advertised_host)
        assert node.port > 0
    assert mesh.transfer.hostname == "", "each node's transfer endpoint must be its own name"
    ports = [mesh.meta.port, mesh.gateway.port, *(n.port for n in mesh.nodes)]
    assert all(p > 0 for p in ports)


def test_gateway_port_is_published(services, parsed, mesh):
    [gw] = [n for n, a in parsed.items() if a.command == "serve" and a.role == "gateway"]
    assert mesh.gateway.host == "0.0.0.0"
    published = [str(p).split(":") for p in services[gw].get("ports", [])]
    assert [str(mesh.gateway.port)] in [p[-1:] for p in published]
    assert mesh.gateway.http_port and [str(mesh.gateway.http_port)] in [p[-1:] for p in published]


def test_model_is_made_into_the_volume_every_service_reads(services, parsed, mesh):
    [maker] = [n for n, a in parsed.items() if a.command == "make-tiny-model"]
    args = parsed[maker]
    assert args.out == mesh.model and args.arch == mesh.tiny_arch and args.if_missing
    for name, a in parsed.items():
        if a.command == "serve" and a.role not in ("meta-server", "kv-store"):  # those need no model
            mounts = [v.split(":")[1] for v in services[name]["volumes"]]
            assert any(mesh.model.startswith(m.rstrip("/") + "/") for m in mounts), name
            assert services[name]["depends_on"][maker]["condition"] == "service_completed_successfully"


def test_local_yaml_loads_with_distinct_fixed_ports():
    mesh = load_mesh_config(str(LOCAL))
    assert mesh.pull == "smollm2-135m-instruct" and mesh.model == "models/smollm2-135m-instruct"
    assert not mesh.tiny_arch
    assert sorted(n.role for n in mesh.nodes) == ["decode", "prefill"]
    ports = [mesh.meta.port, mesh.gateway.port, mesh.gateway.http_port, mesh.kv_store.port,
             *(n.port for n in mesh.nodes)]
    assert len(set(ports)) == len(ports) and all(p > 0 for p in ports)
    hosts = {mesh.meta.host, mesh.gateway.host, mesh.transfer.hostname, mesh.kv_store.host,
             *(n.host for n in mesh.nodes)}
    assert hosts == {"127.0.0.1"}
    assert mesh.transfer.backend == "mooncake" and mesh.transfer.protocol == "tcp"
    mesh.engine_config()  # engine fields are valid


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_docker_compose_validates():
    proc = subprocess.run(["docker-compose", "-f", str(COMPOSE), "config", "-q"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_etcd_service_is_what_the_mesh_points_at(services, parsed, mesh):
    host, _, port = mesh.etcd_endpoint.rpartition(":")
    assert host in services and host not in parsed, "etcd_endpoint names the etcd service"
    env = dict(e.split("=", 1) for e in services[host]["environment"])
    assert env["ETCD_LISTEN_CLIENT_URLS"].endswith(f":{port}")
    assert env["ETCD_ADVERTISE_CLIENT_URLS"] == f"http://{host}:{port}"
    for name, args in parsed.items():
        if args.command == "serve" and args.role not in ("gateway", "kv-store"):  # no etcd use
            assert host in services[name]["depends_on"], f"{name} starts after etcd"


def test_kv_store_service_and_its_redis_are_what_the_mesh_points_at(services, parsed, mesh):
    [store] = [n for n, a in parsed.items() if a.command == "serve" and a.role == "kv-store"]
    assert mesh.kv_store.address == f"{store}:{mesh.kv_store.port}"
    assert mesh.kv_store.host in ("0.0.0.0", store)
    redis_host, redis_port = mesh.kv_store.redis_url.removeprefix("redis://").split("/")[0].split(":")
    assert redis_host in services and redis_host not in parsed, "redis_url names the redis service"
    assert redis_port == "6379" and redis_host in services[store]["depends_on"]


def test_every_served_service_is_restarted_when_it_fails(services, parsed):
    """A node whose engine died exits 1 for its supervisor: compose must restart it."""
    for name, args in parsed.items():
        want = "on-failure" if args.command == "serve" else "no"
        assert services[name].get("restart") == want, name


def _tls_name(args) -> str:
    """The certificate a `pdmesh serve` loads (services/security/credentials.tls_files)."""
    return args.node_id if args.role in ENGINE_ROLES else args.role


def test_every_served_service_reads_the_mesh_secrets_from_compose_secrets(services, parsed):
    """The admin token reaches each pdmesh service as a compose secret named by
    PDMESH_*_FILE (never on a command line); only the gateway holds the API keys; no
    cluster secret (with TLS the certificates are the identity)."""
    top = yaml.safe_load(COMPOSE.read_text())["secrets"]
    plain = {name: s for name, s in top.items() if s["file"].startswith("./deploy/secrets/")}
    assert sorted(plain) == ["admin_token", "api_keys"]
    assert {s["file"] for s in plain.values()} == {f"./deploy/secrets/{n}" for n in plain}
    for name, args in parsed.items():
        if args.command != "serve":
            continue
        svc = services[name]
        env = svc["environment"]
        assert env["PDMESH_ADMIN_TOKEN_FILE"] == "/run/secrets/admin_token", name
        assert not any(k.startswith("PDMESH_CLUSTER_SECRET") for k in env), name
        assert "admin_token" in svc["secrets"], name
        assert ("api_keys" in svc["secrets"]) == (args.role == "gateway"), name
        assert ("PDMESH_API_KEYS_FILE" in env) == (args.role == "gateway"), name
        assert not any("secret" in part.lower() or "token" in part.lower() for part in svc["command"]), name
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert "/deploy/secrets/" in ignored and "/deploy/certs/" in ignored
    unbaked = (ROOT / ".dockerignore").read_text().splitlines()   # the image copies deploy/
    assert "deploy/secrets" in unbaked and "deploy/certs" in unbaked


def test_every_served_service_runs_tls_with_only_its_own_key(services, parsed, mesh):
    """Secure by default: PDMESH_TLS_DIR holds the CA's certificate and the service's own
    pair from `pdmesh certs init deploy/certs` (never ca.key nor another's key), its
    healthcheck presents that certificate, and with it every 0.0.0.0 bind passes the
    plaintext policy (without it each would refuse)."""
    from services.security.bind_policy import PlaintextBindError, check_mesh_binds
    top = yaml.safe_load(COMPOSE.read_text())["secrets"]
    tls_dirs = set()
    for name, args in parsed.items():
        if args.command != "serve":
            continue
        svc, own = services[name], _tls_name(args)
        tls_dir = svc["environment"]["PDMESH_TLS_DIR"]
        mounted = {s["target"]: top[s["source"]]["file"] for s in svc["secrets"] if isinstance(s, dict)}
        assert mounted == {f: f"./deploy/certs/{f}" for f in ("ca.crt", f"{own}.crt", f"{own}.key")}, name
        assert tls_dir == "/run/secrets", name
        tls_dirs.add(tls_dir)
        health = build_parser().parse_args(svc["healthcheck"]["test"][2:])
        port = mesh.node(args.node_id).port if args.role in ENGINE_ROLES else {
            "meta-server": mesh.meta.port, "gateway": mesh.gateway.port, "kv-store": mesh.kv_store.port}[args.role]
        assert svc["healthcheck"]["test"][:2] == ["CMD", "pdmesh"] and health.command == "health", name
        assert health.address == f"127.0.0.1:{port}" and health.cert == own, name
    assert not any(s["file"].endswith("ca.key") for s in top.values())
    assert not mesh.security.allow_plaintext
    check_mesh_binds(mesh, environ={"PDMESH_TLS_DIR": tls_dirs.pop()})
    with pytest.raises(PlaintextBindError, match="security.allow_plaintext"):
        check_mesh_binds(mesh, environ={})


# ---- device overrides: docker-compose.{cuda,ascend}.yml -------------------------------
DEVICE_OVERRIDES = {"cuda": ROOT / "docker-compose.cuda.yml", "npu": ROOT / "docker-compose.ascend.yml"}
# what a device variant of deploy/compose.yaml may change
VARIANT_FIELDS = {"cuda": {("engine", "device")},
                  "npu": {("engine", "device"), ("engine", "kernel_backend"), ("transfer", "protocol")}}


def _devices_given(device: str, service: dict) -> int:
    """How many accelerators the compose service gets: GPUs it reserves, /dev/davinciN it maps."""
    if device == "cuda":
        [req] = service["deploy"]["resources"]["reservations"]["devices"]
        assert req["driver"] == "nvidia" and "gpu" in req["capabilities"]
        return int(req["count"])
    names = [d.split(":")[0] for d in service["devices"]]
    assert {"/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"} <= set(names)
    return sum(1 for n in names if n.removeprefix("/dev/davinci").isdigit())


@pytest.mark.parametrize("device", sorted(DEVICE_OVERRIDES))
def test_each_engine_node_gets_one_device_per_tensor_parallel_rank(services, device):
    override = yaml.safe_load(DEVICE_OVERRIDES[device].read_text())["services"]
    assert sorted(override) == ["decode", "prefill"]
    given = []
    for name, svc in override.items():
        args = build_parser().parse_args(svc["command"])
        assert args.command == "serve" and args.role == name == build_parser().parse_args(
            services[name]["command"]).role
        mesh = load_mesh_config(str(_host_path(args.config)))
        node = mesh.node(args.node_id)
        engine = mesh.engine_config(node)
        assert engine.device == device
        assert _devices_given(device, svc) == engine.tensor_parallel_size > 1, name
        given.append(svc.get("devices", []))
    if device == "npu":   # no NPU in two containers
        chips = [{d for d in devs if d.removeprefix("/dev/davinci").isdigit()} for devs in given]
        assert not chips[0] & chips[1]


@pytest.mark.parametrize("device", sorted(DEVICE_OVERRIDES))
def test_a_device_config_is_compose_yaml_but_for_its_device_fields(device):
    base = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())
    [config] = {build_parser().parse_args(s["command"]).config
                for s in yaml.safe_load(DEVICE_OVERRIDES[device].read_text())["services"].values()}
    variant = yaml.safe_load(_host_path(config).read_text())
    for section, field in VARIANT_FIELDS[device]:
        variant[section].pop(field, None)
        base[section].pop(field, None)
    for node in variant["nodes"]:
        node.pop("engine")
    assert variant == base


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
@pytest.mark.parametrize("device", sorted(DEVICE_OVERRIDES))
def test_docker_compose_validates_with_a_device_override(device):
    proc = subprocess.run(["docker-compose", "-f", str(COMPOSE), "-f", str(DEVICE_OVERRIDES[device]), "config", "-q"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
