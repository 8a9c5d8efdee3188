"""deploy/k8s/ renders, is valid Kubernetes, and agrees with the mesh config and the CLI:
each overlay (cpu, ascend, nvidia) is rendered with `kubectl kustomize` (when kubectl is
installed; else with the small kustomize subset in tests/k8s_manifests.py, checked against kubectl
where both exist), every object is validated offline against the Kubernetes schemas
(kubernetes-validate, strict), and probes, Services, ports, addresses, metrics ports,
secrets and the accelerator resources line up with the ConfigMap's mesh config, in the
spirit of test_deploy's compose checks."""
from __future__ import annotations

import copy

import kubernetes_validate
import pytest
import yaml

from services.cli import build_parser
from tests.k8s_manifests import (ENGINE_ROLES, HAVE_KUBECTL, K8S, OVERLAYS, ROOT, is_pool,  # noqa: F401 (overlay: fixture)
                                 kubectl_kustomize, objects_by_key, overlay, render_fallback, secret_mount,
                                 selector_matches, serve_container, service_port, tls_name, workloads)

K8S_VERSION = "1.31.0"      # a version kubernetes-validate ships schemas for (native gRPC probes: GA in 1.27)
CANN_MOUNTS = ("/usr/local/dcmi", "/usr/local/bin/npu-smi", "/usr/local/Ascend/driver/lib64",
               "/usr/local/Ascend/driver/version.info", "/etc/ascend_install.info")
ACCELERATOR = {"cpu": (None, "cpu"), "ascend": ("huawei.com/Ascend910", "npu"), "nvidia": ("nvidia.com/gpu", "cuda")}
SECRET_ENV = {"PDMESH_ADMIN_TOKEN_FILE": "admin_token", "PDMESH_API_KEYS_FILE": "api_keys"}
# kinds of CRDs that kubernetes-validate has no schema of: checked by the test named
CUSTOM_KINDS = {"ScaledObject": "tests/unit/test_k8s_autoscaling.py (KEDA's documented fields)"}


@pytest.mark.skipif(not HAVE_KUBECTL, reason="kubectl not installed")
@pytest.mark.parametrize("name", OVERLAYS)
def test_fallback_renderer_agrees_with_kubectl(name):
    folder = K8S / "overlays" / name
    assert objects_by_key(render_fallback(folder)) == objects_by_key(kubectl_kustomize(folder))


def test_every_object_is_valid_kubernetes(overlay):
    _, objs, _, _ = overlay
    for (kind, name), obj in objs.items():
        if kind in CUSTOM_KINDS:
            continue
        try:
            kubernetes_validate.validate(copy.deepcopy(obj), K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{kind}/{name}: {'.'.join(map(str, e.path))}: {e.message}")
        assert obj["metadata"].get("namespace", "pdmesh") == "pdmesh"


# --- ports, probes, Services ---

def test_probes_and_services_target_container_ports(overlay):
    """pdmesh services are probed by an exec of `pdmesh health 127.0.0.1:GRPC_PORT --cert
    NAME` (kubelet's gRPC probes speak no TLS, and an internal port asks for a mesh
    certificate): its own port, its own certificate; the others by a port of theirs."""
    _, objs, _, _ = overlay
    for name, wl in workloads(objs).items():
        for c in wl["spec"]["template"]["spec"]["containers"]:
            ports = {p["containerPort"] for p in c["ports"]} | {p["name"] for p in c["ports"]}
            probes = [c[p] for p in ("startupProbe", "readinessProbe", "livenessProbe") if p in c]
            assert "readinessProbe" in c and "livenessProbe" in c, f"{name}/{c['name']}"
            for probe in probes:
                [(kind, action)] = [(k, v) for k, v in probe.items() if k in ("grpc", "httpGet", "tcpSocket", "exec")]
                if not c.get("image", "").startswith("pdmesh:"):
                    assert kind != "exec" and action["port"] in ports, f"{name}/{c['name']} {kind} probe"
                    continue
                assert kind == "exec" and action["command"][0] == "pdmesh", f"{name}: pdmesh health"
                served, _ = serve_container(wl)
                health = build_parser().parse_args(action["command"][1:])
                grpc_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
                assert health.command == "health" and health.address == f"127.0.0.1:{grpc_port}", name
                assert health.cert == tls_name(served) and not health.tls_dir, f"{name}: its own cert, from env"
                assert probe["timeoutSeconds"] >= 5, f"{name}: a Python process, not kubelet's 1 s default"
            res = c.get("resources", {})
            assert {"cpu", "memory"} <= set(res.get("requests", {})) and "memory" in res.get("limits", {}), \
                f"{name}/{c['name']}: resource requests and a memory limit"
    for (kind, name), svc in objs.items():
        if kind == "Service":
            matched = [w for w in workloads(objs).values()
                       if selector_matches(svc["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])]
            assert len(matched) == 1, f"Service {name} selects {[w['metadata']['name'] for w in matched]}"
            for p in svc["spec"]["ports"]:
                service_port(objs, name, p["port"])
    for name, wl in workloads(objs).items():
        assert wl["spec"]["selector"]["matchLabels"].items() <= wl["spec"]["template"]["metadata"]["labels"].items()
        if wl["kind"] == "StatefulSet":
            assert objs[("Service", wl["spec"]["serviceName"])]["spec"]["clusterIP"] == "None", name


def test_every_service_of_the_mesh_runs_once_from_the_configmap(overlay):
    _, objs, mesh, _ = overlay
    served = {}
    for name, wl in workloads(objs).items():
        found = serve_container(wl)
        if found is None:
            continue
        args, c = found
        assert args.command == "serve" and args.port is None and args.meta == "" and args.metrics_port is None, \
            f"{name}: ports and addresses come from the config"
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        [cm_volume] = [v for v in wl["spec"]["template"]["spec"]["volumes"] if "configMap" in v]
        assert cm_volume["configMap"]["name"] == "pdmesh-config"
        assert args.config == f"{mounts[cm_volume['name']]}/mesh.yaml", name
        key = args.node_id if args.role in ENGINE_ROLES else args.role
        assert key not in served, f"{key} runs in {served.get(key)} and {name}"
        served[key] = name
        if args.role in ENGINE_ROLES and is_pool(args):   # test_k8s_autoscaling.py checks the rest
            assert mesh.node(args.node_id).role == args.role
            assert wl["kind"] == "StatefulSet" and wl["spec"]["serviceName"] == args.node_id, name
        elif args.role in ENGINE_ROLES:
            assert mesh.node(args.node_id).role == args.role
            assert wl["kind"] == "Deployment" and wl["spec"]["replicas"] == 1, \
                f"{name}: a node_id is one pod (a second would be refused as a live node_id)"
            assert wl["spec"]["strategy"]["type"] == "Recreate", name
    assert sorted(served) == sorted(["meta-server", "gateway", "kv-store", *(n.node_id for n in mesh.nodes)])
    meta = workloads(objs)[served["meta-server"]]
    assert meta["kind"] == "StatefulSet" and meta["spec"]["replicas"] == 2 and mesh.etcd_endpoint, \
        "two meta-servers electing a leader on etcd"
    # each replica is a candidate of its own name (POD.SERVICE, what the gateway dials)
    meta_args, meta_c = serve_container(meta)
    assert meta_args.advertise_host == f"$(POD_NAME).{meta['spec']['serviceName']}"
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in meta_c["env"]
    assert "ENTRYPOINT [\"pdmesh\"]" in (ROOT / "deploy" / "Dockerfile").read_text()


def test_config_addresses_name_services_with_those_ports(overlay):
    _, objs, mesh, _ = overlay
    assert mesh.meta.host == mesh.gateway.host == mesh.kv_store.host == "0.0.0.0"
    service_port(objs, mesh.meta.advertise_host, mesh.meta.port)
    meta_wl = workloads(objs)["meta-server"]
    assert sorted(mesh.gateway.meta_addresses) == [f"meta-server-{i}.meta-server:{mesh.meta.port}"
                                                   for i in range(meta_wl["spec"]["replicas"])]
    for address in mesh.gateway.meta_addresses:
        host, _, port = address.rpartition(":")
        service_port(objs, host, int(port))
    service_port(objs, "gateway", mesh.gateway.port)
    service_port(objs, "gateway", mesh.gateway.http_port)
    host, _, port = mesh.etcd_endpoint.rpartition(":")
    _, etcd = service_port(objs, host, int(port))
    assert etcd["kind"] == "StatefulSet" and etcd["metadata"]["name"] == "etcd"
    args = etcd["spec"]["template"]["spec"]["containers"][0]["command"]
    assert f"--listen-client-urls=http://0.0.0.0:{port}" in args
    members = next(a for a in args if a.startswith("--initial-cluster=")).split("=", 1)[1].split(",")
    assert len(members) == etcd["spec"]["replicas"]
    host, port = mesh.kv_store.redis_url.removeprefix("redis://").split("/")[0].split(":")
    service_port(objs, host, int(port))
    # the kv-store's and each node's address is also its Mooncake endpoint (ports Mooncake
    # picks): a headless Service that resolves to the pod, published before it is ready
    assert mesh.transfer.hostname == ""
    endpoints = [(mesh.kv_store.advertise_host, mesh.kv_store.port, "kv-store", None)]
    endpoints += [(n.advertised_host, n.port, n.role, n.node_id) for n in mesh.nodes]
    for host, port, role, node_id in endpoints:
        svc, wl = service_port(objs, host, port)
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"], host
        args, _ = serve_container(wl)
        assert (args.role, args.node_id or None) == (role, node_id), host
    for node in mesh.nodes:
        assert node.host == "0.0.0.0" and node.advertise_host == node.node_id


def test_metrics_ports_are_configured_exposed_and_scraped(overlay):
    _, objs, mesh, _ = overlay
    want = {"meta-server": mesh.meta.metrics_port, "gateway": mesh.gateway.metrics_port,
            "kv-store": mesh.kv_store.metrics_port, **{n.node_id: n.metrics_port for n in mesh.nodes}}
    assert sorted(want.values()) == list(range(9100, 9100 + len(want))), want
    for name, wl in workloads(objs).items():
        if serve_container(wl) is None:
            continue
        args, c = serve_container(wl)
        port = want[args.node_id if args.role in ENGINE_ROLES else args.role]
        notes = wl["spec"]["template"]["metadata"]["annotations"]
        assert notes == {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                         "prometheus.io/path": "/metrics"}, name
        assert {"name": "metrics", "containerPort": port} in c["ports"], name


def test_secrets_reach_every_service_as_files_named_by_env(overlay):
    """docs/security.md: the Secret's files mounted read-only, named by PDMESH_*_FILE;
    only the gateway holds the API keys; no cluster secret (the certificates are the
    identity); nothing secret on a command line."""
    _, objs, _, _ = overlay
    assert ("Secret", "pdmesh-secrets") not in objs, "no secret value is committed"
    for name, wl in workloads(objs).items():
        if serve_container(wl) is None:
            continue
        args, c = serve_container(wl)
        env = {e["name"]: e["value"] for e in c.get("env", []) if e["name"] in SECRET_ENV}
        want = [k for k in SECRET_ENV if k != "PDMESH_API_KEYS_FILE" or args.role == "gateway"]
        assert sorted(env) == sorted(want), name
        path, files = secret_mount(wl, c, "pdmesh-secrets")
        assert {f"{path}/{f}": key for f, key in files.items()} == {p: SECRET_ENV[var] for var, p in env.items()}, name
        assert not any(e["name"].startswith("PDMESH_CLUSTER_SECRET") for e in c.get("env", [])), name
        assert not any("secret" in a.lower() or "token" in a.lower() for a in c["args"]), name


def test_the_model_is_made_where_the_services_read_it(overlay):
    _, objs, mesh, _ = overlay
    for name, wl in workloads(objs).items():
        if serve_container(wl) is None or serve_container(wl)[0].role in ("meta-server", "kv-store"):   # those need no model
            continue
        spec = wl["spec"]["template"]["spec"]
        [maker] = spec["initContainers"]
        margs = build_parser().parse_args(maker["args"])
        assert margs.command == "make-tiny-model" and margs.out == mesh.model and margs.arch == mesh.tiny_arch
        assert margs.if_missing
        _, c = serve_container(wl)
        for container in (maker, c):
            mounts = [m["mountPath"] for m in container["volumeMounts"]]
            assert any(mesh.model.startswith(m.rstrip("/") + "/") for m in mounts), f"{name}/{container['name']}"


def test_accelerators_of_each_overlay(overlay):
    name, objs, mesh, raw = overlay
    resource, device = ACCELERATOR[name]
    assert mesh.engine_config().device == device
    base = yaml.safe_load((K8S / "base" / "mesh.yaml").read_text())
    assert {k: v for k, v in raw.items() if k not in ("engine", "transfer")} == \
        {k: v for k, v in base.items() if k not in ("engine", "transfer")}, "overlays change only engine, transfer"
    if name == "ascend":
        assert mesh.transfer.protocol == "ascend"
    for wl_name, wl in workloads(objs).items():
        found = serve_container(wl)
        if found is None:
            continue
        args, c = found
        limits = c["resources"]["limits"]
        spec = wl["spec"]["template"]["spec"]
        host_paths = {v["name"]: v["hostPath"]["path"] for v in spec.get("volumes", []) if "hostPath" in v}
        mounted = {m["mountPath"] for m in c["volumeMounts"] if host_paths.get(m["name"]) == m["mountPath"]}
        if args.role in ENGINE_ROLES and resource is not None:
            # one device per tensor-parallel rank of the node (nodes[].engine over engine)
            tp = mesh.engine_config(mesh.node(args.node_id)).tensor_parallel_size
            assert limits.get(resource) == tp, wl_name
            assert c["image"] == f"pdmesh:{device if name == 'nvidia' else name}", wl_name
        else:
            assert not {k for k in limits if "/" in k}, f"{wl_name}: no accelerator"
            assert c["image"] == "pdmesh:cpu", wl_name
        if args.role in ENGINE_ROLES and name == "ascend":
            assert set(CANN_MOUNTS) | {"/etc/hccn.conf"} <= mounted, wl_name
            assert all(m["readOnly"] for m in c["volumeMounts"] if m["mountPath"] in mounted)
        else:
            assert not host_paths, f"{wl_name}: no host mounts"


def test_only_the_mesh_reaches_its_pods_but_clients_reach_the_gateways_public_ports(overlay):
    _, objs, _, _ = overlay
    policies = {name: o["spec"] for (kind, name), o in objs.items() if kind == "NetworkPolicy"}
    assert sorted(policies) == ["pdmesh-gateway-public", "pdmesh-internal", "pdmesh-metrics-scrape"]
    internal = policies["pdmesh-internal"]
    assert internal["podSelector"] == {} and internal["policyTypes"] == ["Ingress"]
    assert internal["ingress"] == [{"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/part-of": "pdmesh"}}}]}]
    for workload in workloads(objs).values():   # every pod carries the label the policy admits
        assert workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/part-of"] == "pdmesh"
    public = policies["pdmesh-gateway-public"]
    [gateway] = [w for w in workloads(objs).values()
                 if selector_matches(public["podSelector"]["matchLabels"], w["spec"]["template"]["metadata"]["labels"])]
    named = {p["name"] for c in gateway["spec"]["template"]["spec"]["containers"] for p in c.get("ports", ())}
    assert [p["port"] for p in public["ingress"][0]["ports"]] == ["grpc", "http"] and {"grpc", "http"} <= named
    assert "from" not in public["ingress"][0]
    assert policies["pdmesh-metrics-scrape"]["ingress"][0]["ports"] == [{"port": "metrics"}]
