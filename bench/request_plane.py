"""The request plane's cost: CPU per request summed over every mesh process, and TTFT,
with 32 concurrent streams through a 1-prefill + 1-decode mesh of the small tiny model
(its compute is small, so the RPC hops between gateway, meta-server, decode and prefill
show). Optionally against another checkout (--baseline-tree, e.g. a git worktree of an
older commit): both meshes run side by side and are measured in alternating rounds.

    python bench/request_plane.py [--baseline-tree DIR] [--rounds 4] [--requests 192]

Each tree's mesh is started by that tree's own launcher (services/cli/launcher.py) in a child
process; the client here speaks only the public pdmesh.v1.Gateway API, the same in both.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_model import ROOT
from services.security.client_auth import gateway_channel  # noqa: E402

LAUNCH = """
import json, sys
from pathlib import Path
import yaml
from common.config import mesh_config_from_dict
from services.cli.launcher import MeshProcesses
raw, work = json.loads(sys.argv[1]), Path(sys.argv[2])
(work / "mesh.yaml").write_text(yaml.safe_dump(raw))
mesh = MeshProcesses(str(work / "mesh.yaml"), mesh_config_from_dict(raw), work / "logs", quiet=True)
address = mesh.start()
print(json.dumps({"gateway": address, "pids": [s.process.pid for s in mesh.services.values()],
                  "api_keys_file": mesh.environ.get("PDMESH_API_KEYS_FILE", "")}), flush=True)
sys.stdin.read()
mesh.stop()
"""


class Mesh:
    """A 1P+1D mesh run by the launcher of `tree`."""

    def __init__(self, tree: Path, model: Path, transfer: str):
        self.tree = tree
        self.work = Path(tempfile.mkdtemp(prefix="pdmesh-plane-"))
        raw = {"model": str(model), "engine": {"num_blocks": 2048, "max_num_seqs": 64, "max_model_len": 1024},
               "meta_server": {"port": 0}, "gateway": {"port": 0}, "transfer": {"backend": transfer},
               "nodes": [{"role": "prefill", "node_id": "prefill-0"}, {"role": "decode", "node_id": "decode-0"}]}
        env = {**os.environ, "PYTHONPATH": str(tree)}
        self.proc = subprocess.Popen([sys.executable, "-c", LAUNCH, json.dumps(raw), str(self.work)], cwd=tree,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        info = json.loads(self.proc.stdout.readline())
        self.gateway, self.pids = info["gateway"], info["pids"]
        if info["api_keys_file"]:
            os.environ["PDMESH_API_KEY_FILE"] = info["api_keys_file"]

    def cpu_s(self) -> float:
        """CPU seconds (user + system) used so far by every process of the mesh."""
        total = 0
        for pid in self.pids:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        return total / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


async def one(stub, ids: list[int]) -> tuple[float, list[int]]:
    from protos.pdmesh.v1 import common_pb2, gateway_pb2
    req = gateway_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True))
    req.prompt_token_ids.ids.extend(ids)
    start, ttft, tokens = time.perf_counter(), None, []
    async for msg in stub.Generate(req):
        ttft = ttft if ttft is not None else time.perf_counter() - start
        tokens += msg.token_ids
    return ttft, tokens


async def measure(mesh: Mesh, prompts: list[list[int]], concurrency: int) -> dict:
    from protos.pdmesh.v1 import gateway_pb2_grpc
    async with gateway_channel(mesh.gateway) as channel:
        await asyncio.wait_for(channel.channel_ready(), 30)
        stub = gateway_pb2_grpc.GatewayStub(channel)
        await asyncio.gather(*(one(stub, p) for p in prompts[:concurrency]))   # warm
        sequential = [(await one(stub, p))[0] for p in prompts[:16]]
        sem = asyncio.Semaphore(concurrency)

        async def bounded(p):
            async with sem:
                return await one(stub, p)

        cpu0, t0 = mesh.cpu_s(), time.perf_counter()
        results = await asyncio.gather(*(bounded(p) for p in prompts))
        wall, cpu = time.perf_counter() - t0, mesh.cpu_s() - cpu0
    assert all(len(tokens) == 4 for _, tokens in results)
    return {"cpu_ms_per_request": cpu / len(prompts) * 1e3, "requests_per_s": len(prompts) / wall,
            "ttft_p50_ms_at_concurrency": statistics.median(t for t, _ in results) * 1e3,
            "ttft_p50_ms_sequential": statistics.median(sequential) * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-tree", default=None, help="another checkout to compare with")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--requests", type=int, default=192)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--transfer", default="mooncake", choices=["mooncake", "grpc"])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "request_plane.json"))
    args = ap.parse_args()
    from common.model.tiny import make_tiny_model
    model = ROOT / "models" / "tiny-llama"
    if not (model / "config.json").exists():
        make_tiny_model("llama", model)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(64)] for _ in range(args.requests)]
    trees = {"this": ROOT}
    if args.baseline_tree:
        trees["baseline"] = Path(args.baseline_tree).resolve()
    meshes = {name: Mesh(tree, model, args.transfer) for name, tree in trees.items()}
    rows: dict[str, list[dict]] = {name: [] for name in trees}
    try:
        for r in range(args.rounds):
            order = list(meshes) if r % 2 == 0 else list(reversed(meshes))
            for name in order:
                row = asyncio.run(measure(meshes[name], prompts, args.concurrency))
                rows[name].append(row)
                print(f"round {r} {name:>8}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
    finally:
        for mesh in meshes.values():
            mesh.stop()
    summary = {name: {k: statistics.median(row[k] for row in rs) for k in rs[0]} for name, rs in rows.items()}
    out = {"requests": args.requests, "concurrency": args.concurrency, "transfer": args.transfer,
           "trees": {name: str(tree) for name, tree in trees.items()}, "median": summary, "rounds": rows}
    if "baseline" in summary:
        out["ratio_this_to_baseline"] = {k: summary["this"][k] / summary["baseline"][k] for k in summary["this"]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    for name, s in summary.items():
        print(f"median {name:>8}: " + ", ".join(f"{k} {v:.2f}" for k, v in s.items()))
    if "ratio_this_to_baseline" in out:
        print("this / baseline: " + ", ".join(f"{k} {v:.2f}" for k, v in out["ratio_this_to_baseline"].items()))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
