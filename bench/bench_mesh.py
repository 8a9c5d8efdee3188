"""The 1-prefill + 1-decode mesh several bench/*.py scripts measure: separate processes
on this host (services.cli.launcher), config and logs in a new temp folder."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import yaml

from bench_model import ROOT  # noqa: F401  (puts the repository on sys.path)

from common.config import mesh_config_from_dict  # noqa: E402
from services.cli.launcher import MeshProcesses  # noqa: E402


def ensure_tiny_model(model: Path) -> Path:
    """The built-in tiny llama at `model`, made there first if missing."""
    if not (model / "config.json").exists():
        from common.model.tiny import make_tiny_model
        print(f"making the tiny model in {model}", flush=True)
        make_tiny_model("llama", model)
    return model


PD_NODES = (("prefill", "prefill-0"), ("decode", "decode-0"))
COLOCATED_NODES = (("both", "both-0"),)


def start_pd_mesh(model: Path, engine: dict, transfer: str = "mooncake", prefix: str = "pdmesh-bench-",
                  nodes=PD_NODES, kv_push: str = "layerwise", timeouts: dict | None = None,
                  meta: dict | None = None, plan_cores: bool = True,
                  env: dict[str, str] | None = None, borrow_cores: bool = True) -> MeshProcesses:
    """Start the meta-server, the nodes (default prefill-0 and decode-0) and the gateway on
    free ports; the caller stops it (mesh.stop()). timeouts: TimeoutConfig fields to set;
    meta: MetaConfig fields (the router's) to set; plan_cores: the launcher's core plan
    (False: no node pinned); borrow_cores: the decode node borrows the prefill node's
    cores while it is idle (the launcher's default); env: set for every service's process."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    raw = {"model": str(model), "engine": engine, "transfer": {"backend": transfer, "kv_push": kv_push},
           "meta_server": {"port": 0, **(meta or {})}, "gateway": {"port": 0}, "timeouts": dict(timeouts or {}),
           "nodes": [{"role": role, "node_id": node_id} for role, node_id in nodes]}
    cfg = work / "mesh.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    mesh = MeshProcesses(str(cfg), mesh_config_from_dict(raw), work / "logs", plan_cores=plan_cores,
                         borrow_cores=borrow_cores, env=dict(env or {}))
    mesh.start()
    use_client_key(mesh)
    return mesh


def use_client_key(mesh: MeshProcesses) -> None:
    """Let this process's gateway clients (services.security.client_auth.gateway_channel)
    present the API key the launcher made for this mesh."""
    path = mesh.environ.get("PDMESH_API_KEYS_FILE", "")
    if path:
        os.environ["PDMESH_API_KEY_FILE"] = path


def write_result(path: str | Path, out: dict, ok: bool) -> int:
    """Write a benchmark's JSON, say PASS or FAIL and where; the exit code."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=2))
    print(f"{'PASS' if ok else 'FAIL'}; wrote {path}")
    return 0 if ok else 1
