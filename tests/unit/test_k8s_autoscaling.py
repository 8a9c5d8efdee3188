"""deploy/k8s's engine pools follow the planner: a KEDA ScaledObject per pool (prefill-pool,
decode-pool: StatefulSets whose pods are nodes of their own) on the leading meta-server's
pdmesh:planner_desired_nodes{role}, rendered as tests/unit/test_k8s.py renders the
overlays. kubernetes-validate has no schema for KEDA's CRD, so SCALED_OBJECT below is
KEDA's documented ScaledObject spec (keda.sh/docs/2.x: reference/scaledobject-spec and
scalers/prometheus) transcribed as a closed JSON schema (an unknown or misspelt field, or
a number where KEDA takes a string, fails), checked to refuse such mistakes; the numbers
are checked against the mesh config: the planner on with its profile in the ConfigMap,
the query less the role's fixed nodes, replica bounds the planner's less them, a pod
certificate for every replica. A pool's pods drain before they stop (preStop `pdmesh
drain --wait` on their own port) and undo a drain their name kept as they start."""
from __future__ import annotations

import copy
import json
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml

from common.metrics import name as metric
from services.cli import build_parser
from services.cli.autoscale_plan import POOL_OF
from services.cli.certs import pool_names
from services.meta_server.profile_file import profile_from_dict
from tests.k8s_manifests import K8S, is_pool, serve_container, workloads, overlay  # noqa: F401 (fixture)

_INT = {"type": "integer", "minimum": 0}
_STR = {"type": "string"}


def _closed(required: list[str], **properties) -> dict:
    return {"type": "object", "additionalProperties": False, "required": required, "properties": properties}


_RULES = _closed([], stabilizationWindowSeconds={"type": "integer", "minimum": 0, "maximum": 3600},
                 selectPolicy={"enum": ["Max", "Min", "Disabled"]},
                 policies={"type": "array", "minItems": 1, "items": _closed(
                     ["type", "value", "periodSeconds"], type={"enum": ["Pods", "Percent"]},
                     value={"type": "integer", "minimum": 1},
                     periodSeconds={"type": "integer", "minimum": 1, "maximum": 1800})})
# the prometheus scaler's metadata: every value a string (KEDA's metadata is map[string]string)
PROMETHEUS_METADATA = _closed(["serverAddress", "query", "threshold"], **{k: _STR for k in (
    "serverAddress", "query", "threshold", "activationThreshold", "queryParameters", "namespace", "customHeaders",
    "ignoreNullValues", "unsafeSsl", "timeout", "authModes")})
SCALED_OBJECT = _closed(
    ["apiVersion", "kind", "metadata", "spec"],
    apiVersion={"const": "keda.sh/v1alpha1"}, kind={"const": "ScaledObject"},
    metadata={"type": "object", "required": ["name"]},
    spec=_closed(
        ["scaleTargetRef", "triggers"],
        scaleTargetRef=_closed(["name"], apiVersion=_STR, kind=_STR, name=_STR, envSourceContainerName=_STR),
        pollingInterval=_INT, cooldownPeriod=_INT, initialCooldownPeriod=_INT, idleReplicaCount=_INT,
        minReplicaCount=_INT, maxReplicaCount=_INT,
        fallback=_closed(["failureThreshold", "replicas"], failureThreshold=_INT, replicas=_INT, behavior={
            "enum": ["static", "currentReplicas", "currentReplicasIfHigher", "currentReplicasIfLower"]}),
        advanced=_closed([], restoreToOriginalReplicaCount={"type": "boolean"},
                         horizontalPodAutoscalerConfig=_closed([], name=_STR, behavior=_closed(
                             [], scaleUp=_RULES, scaleDown=_RULES)),
                         scalingModifiers=_closed([], formula=_STR, target=_STR, activationTarget=_STR,
                                                  metricType={"enum": ["AverageValue", "Value"]})),
        triggers={"type": "array", "minItems": 1, "items": {
            **_closed(["type", "metadata"], type=_STR, name=_STR, useCachedMetrics={"type": "boolean"},
                      metricType={"enum": ["AverageValue", "Value", "Utilization"]},
                      metadata={"type": "object", "additionalProperties": _STR},
                      authenticationRef=_closed(["name"], name=_STR, kind={
                          "enum": ["TriggerAuthentication", "ClusterTriggerAuthentication"]})),
            "if": {"properties": {"type": {"const": "prometheus"}}},
            "then": {"properties": {"metadata": PROMETHEUS_METADATA}}}}))


def _scaled_objects(objs) -> dict[str, dict]:
    """StatefulSet name -> the ScaledObject that scales it."""
    out = {}
    for (kind, name), so in objs.items():
        if kind == "ScaledObject":
            target = so["spec"]["scaleTargetRef"]["name"]
            assert target not in out, f"{target} has two ScaledObjects"
            out[target] = so
    return out


def pool_certs(objs, workload: str) -> list[str]:
    """The certificates a pool's pods hold: one per pod name its ScaledObject allows."""
    return [f"{workload}-{i}" for i in range(_scaled_objects(objs)[workload]["spec"]["maxReplicaCount"])]


def _pools(objs) -> dict[str, tuple]:
    return {name: serve_container(wl) + (wl,) for name, wl in workloads(objs).items()
            if serve_container(wl) is not None and is_pool(serve_container(wl)[0])}


def test_each_engine_role_has_a_pool_scaled_by_keda_within_the_planners_bounds(overlay):
    _, objs, mesh, raw = overlay
    pools = _pools(objs)
    scaled = _scaled_objects(objs)
    assert sorted(pools) == sorted(scaled) == ["decode-pool", "prefill-pool"]
    planner = mesh.meta.planner
    assert planner.enabled
    for name, (args, c, wl) in pools.items():
        so = scaled[name]
        jsonschema.validate(so, SCALED_OBJECT)
        assert so["metadata"].get("namespace", "pdmesh") == "pdmesh"
        assert so["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": name}
        role = POOL_OF[args.role]
        fixed = [n.node_id for n in mesh.nodes if POOL_OF[n.role] == role and n.node_id not in
                 {a.node_id for a, _, _ in pools.values()}]
        assert fixed, f"{role}: a fixed node serves while the pool is at 0"
        [trigger] = so["spec"]["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        meta = trigger["metadata"]
        assert meta["query"] == (f'sum({metric("planner_desired_nodes")}{{role="{role}"}} * on(instance) '
                                 f'({metric("meta_leader")} == 1)) - {len(fixed)}'), name
        assert meta["threshold"] == "1" and meta["ignoreNullValues"] == "true", "replicas = the planner's count"
        assert so["spec"]["minReplicaCount"] == max(0, planner.min_nodes - len(fixed))
        assert so["spec"]["maxReplicaCount"] == planner.max_nodes - len(fixed) >= 1
        assert "replicas" not in wl["spec"], f"{name}: KEDA owns the count"


def test_the_planner_reads_its_profile_from_the_configmap(overlay):
    _, objs, mesh, _ = overlay
    cm = objs[("ConfigMap", "pdmesh-config")]
    meta_args, meta_c = serve_container(workloads(objs)["meta-server"])
    folder = str(Path(meta_args.config).parent)
    assert mesh.meta.planner.profile == f"{folder}/node-profile.json"
    profile = profile_from_dict(json.loads(cm["data"]["node-profile.json"]))
    assert profile.prefill and profile.decode


def test_a_pools_pods_are_nodes_of_their_own_that_drain_before_they_stop(overlay):
    _, objs, mesh, _ = overlay
    for name, (args, c, wl) in _pools(objs).items():
        service = wl["spec"]["serviceName"]
        assert args.node_id == name == service and mesh.node(args.node_id).advertise_host == service
        assert args.node_name == "$(POD_NAME)" and args.advertise_host == f"$(POD_NAME).{service}", name
        assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in c["env"]
        grpc_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
        hooks = {}
        for hook in ("preStop", "postStart"):
            sh, dash_c, script = c["lifecycle"][hook]["exec"]["command"]
            assert (sh, dash_c) == ("sh", "-c") and "$(" not in script, f"{name} {hook}: hooks are not expanded"
            words = shlex.split(script.replace('"$POD_NAME"', "POD"))
            hooks[hook] = words
        stop = hooks["preStop"]
        assert stop[:2] == ["exec", "pdmesh"], stop
        drain = build_parser().parse_args(stop[2:])
        assert (drain.command, drain.node_id, drain.cert, drain.undo) == ("drain", "POD", "POD", False)
        assert drain.wait == f"127.0.0.1:{grpc_port}" and drain.config == args.config
        assert drain.timeout < wl["spec"]["template"]["spec"]["terminationGracePeriodSeconds"], \
            f"{name}: the drain ends before Kubernetes kills the pod"
        start = hooks["postStart"]
        assert start[0] == "pdmesh" and start[-2:] == ["||", "true"], "a failed undo must not kill the pod"
        undo = build_parser().parse_args(start[1:-2])
        assert (undo.command, undo.node_id, undo.cert, undo.undo, undo.config) == (
            "drain", "POD", "POD", True, args.config)


def test_pdmesh_certs_init_makes_the_pools_certificates_as_documented():
    header = (K8S / "base" / "kustomization.yaml").read_text()
    objs = {("ScaledObject", o["metadata"]["name"]): o
            for o in yaml.safe_load_all((K8S / "base" / "autoscaling.yaml").read_text()) if o}
    for so in _scaled_objects(objs).values():
        pool, most = so["spec"]["scaleTargetRef"]["name"], so["spec"]["maxReplicaCount"]
        assert f"--pool {pool}={most}" in header
        names, hosts = pool_names([f"{pool}={most}"])
        assert names == pool_certs(objs, pool) and hosts == [f"*.{pool}"]
    with pytest.raises(ValueError, match="--pool must be NAME=N"):
        pool_names(["decode-pool"])


@pytest.mark.parametrize("mistake", [
    lambda so: so["spec"].update(maxReplicas=2),                                  # not a KEDA field
    lambda so: so["spec"]["triggers"][0]["metadata"].update(threshold=1),         # a number, not a string
    lambda so: so["spec"]["triggers"][0]["metadata"].pop("serverAddress"),        # required by the scaler
    lambda so: so["spec"]["triggers"][0]["metadata"].update(serverAdress="x"),    # misspelt
    lambda so: so["spec"]["triggers"][0].update(metricType="Average"),
    lambda so: so["spec"]["scaleTargetRef"].pop("name"),
])
def test_the_schema_refuses_what_keda_would(mistake):
    [so] = [o for o in yaml.safe_load_all((K8S / "base" / "autoscaling.yaml").read_text())
            if o and o["metadata"]["name"] == "decode-pool"]
    jsonschema.validate(so, SCALED_OBJECT)
    wrong = copy.deepcopy(so)
    mistake(wrong)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(wrong, SCALED_OBJECT)
