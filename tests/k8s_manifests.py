"""deploy/k8s/ as the tests read it: each overlay rendered (`kubectl kustomize` where
kubectl is installed, else the small kustomize subset below, which test_k8s.py checks
against kubectl where both exist), the `overlay` fixture over the three overlays, and
helpers over the rendered objects (workloads, their `pdmesh serve` containers, Services,
pools, certificates, secret mounts) shared by test_k8s*.py."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from common.config import mesh_config_from_dict
from services.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "ascend", "nvidia")
WORKLOADS = ("Deployment", "StatefulSet")
ENGINE_ROLES = ("prefill", "decode", "both")


# --- the kustomize subset these manifests use: resources, namespace, labels (pairs,
# includeTemplates), configMapGenerator (files; behavior create | replace | merge; no name
# suffix), patches (strategic merge, lists merged by the Kubernetes merge keys) ---

MERGE_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name", "env": "name",
              "volumeMounts": "mountPath", "ports": "containerPort"}


def merge_patch(base, patch, key=None):
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = merge_patch(base[k], v, k) if k in base else v
        return out
    if isinstance(base, list) and isinstance(patch, list) and key in MERGE_KEYS:
        mk, out = MERGE_KEYS[key], list(base)
        keys = [b.get(mk) for b in base]
        for item in patch:   # merged in place; new items go first, in the patch's order (as kustomize)
            if item.get(mk) in keys:
                at = keys.index(item.get(mk))
                out[at] = merge_patch(out[at], item)
        new = [item for item in patch if item.get(mk) not in keys]
        return new + out
    return patch


def render_fallback(folder: Path) -> list[dict]:
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    objs: list[dict] = []
    for res in k.get("resources", []):
        path = folder / res
        objs += render_fallback(path) if path.is_dir() else [o for o in yaml.safe_load_all(path.read_text()) if o]
    for gen in k.get("configMapGenerator", []):
        data = {}
        for f in gen["files"]:
            name, _, src = f.rpartition("=") if "=" in f else (f, "", f)
            data[name] = (folder / src).read_text()
        cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data}
        if gen.get("behavior") in ("replace", "merge"):   # keeps the metadata the base gave it
            [old] = [o for o in objs if (o["kind"], o["metadata"]["name"]) == ("ConfigMap", gen["name"])]
            old["data"] = data if gen["behavior"] == "replace" else {**old["data"], **data}
        else:
            objs.append(cm)
    for p in k.get("patches", []):
        patch = yaml.safe_load((folder / p["path"]).read_text())
        [at] = [i for i, o in enumerate(objs) if (o["kind"], o["metadata"]["name"]) ==
                (patch["kind"], patch["metadata"]["name"])]
        objs[at] = merge_patch(objs[at], patch)
    for o in objs:
        if "namespace" in k and o["kind"] != "Namespace":
            o["metadata"]["namespace"] = k["namespace"]
        for entry in k.get("labels", []):
            o["metadata"].setdefault("labels", {}).update(entry["pairs"])
            if entry.get("includeTemplates") and o["kind"] in WORKLOADS:
                o["spec"]["template"]["metadata"].setdefault("labels", {}).update(entry["pairs"])
                for claim in o["spec"].get("volumeClaimTemplates", []):
                    claim["metadata"].setdefault("labels", {}).update(entry["pairs"])
    return objs


def objects_by_key(objs: list[dict]) -> dict:
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def kubectl_kustomize(folder: Path) -> list[dict]:
    proc = subprocess.run(["kubectl", "kustomize", str(folder)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [o for o in yaml.safe_load_all(proc.stdout) if o]


HAVE_KUBECTL = shutil.which("kubectl") is not None


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request):
    """(name, {(kind, name): object}, MeshConfig of its ConfigMap)."""
    folder = K8S / "overlays" / request.param
    objs = kubectl_kustomize(folder) if HAVE_KUBECTL else render_fallback(folder)
    by_key = objects_by_key(objs)
    assert len(by_key) == len(objs), "duplicate objects"
    [cm] = [o for o in objs if o["kind"] == "ConfigMap"]
    raw = yaml.safe_load(cm["data"]["mesh.yaml"])
    return request.param, by_key, mesh_config_from_dict(raw), raw


# --- helpers over the rendered objects ---

def workloads(objs):
    return {name: o for (kind, name), o in objs.items() if kind in WORKLOADS}


def serve_container(workload):
    """(argparse.Namespace, container) of the workload's `pdmesh serve` container, or None."""
    for c in workload["spec"]["template"]["spec"]["containers"]:
        if c.get("image", "").startswith("pdmesh:"):
            return build_parser().parse_args(c["args"]), c
    return None


def selector_matches(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def service_port(objs, host: str, port: int):
    """The Service `host` (a Service name, or POD.SERVICE of a StatefulSet's pod) and the
    workload it selects, after checking that it serves `port` on a container port."""
    pod, _, svc_name = host.rpartition(".") if "." in host else ("", "", host)
    svc = objs.get(("Service", svc_name))
    assert svc is not None, f"{host}: no Service {svc_name}"
    [sp] = [p for p in svc["spec"]["ports"] if p["port"] == port] or [None]
    assert sp is not None, f"Service {svc_name} has no port {port}"
    [wl] = [w for w in workloads(objs).values()
            if selector_matches(svc["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])]
    if pod:
        name, _, ordinal = pod.rpartition("-")
        assert wl["kind"] == "StatefulSet" and wl["metadata"]["name"] == name, host
        assert wl["spec"]["serviceName"] == svc_name and int(ordinal) < wl["spec"]["replicas"], host
    ports = {p["name"]: p["containerPort"] for c in wl["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
    assert ports.get(sp["targetPort"], sp["targetPort"]) == port, f"{svc_name}:{port} targets {sp['targetPort']}"
    return svc, wl


# --- pools and certificates ---

def is_pool(args) -> bool:
    """A scaled pool's pods: each registers as its pod name (serve --node-name)."""
    return bool(getattr(args, "node_name", ""))


def tls_name(args) -> str:
    """The certificate a `pdmesh serve` loads (services/security/credentials.tls_files) and
    its probes present; a pool's pods load their own (POD.crt) and are probed with the first
    pod's, which every pod of the pool mounts (test_k8s_autoscaling.py)."""
    if is_pool(args):
        return f"{args.node_id}-0"
    return args.node_id if args.role in ENGINE_ROLES else args.role


def secret_mount(wl, c, secret_name: str) -> tuple[str, dict]:
    """(mount path, {file: key}) of the container's read-only mount of Secret secret_name."""
    [vol] = [v for v in wl["spec"]["template"]["spec"]["volumes"]
             if v.get("secret", {}).get("secretName") == secret_name]
    assert vol["secret"]["defaultMode"] == 0o400
    [mount] = [m for m in c["volumeMounts"] if m["name"] == vol["name"]]
    assert mount["readOnly"]
    return mount["mountPath"], {i["path"]: i["key"] for i in vol["secret"]["items"]}
