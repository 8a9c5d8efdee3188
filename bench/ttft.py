"""TTFT through the gateway on a 1-prefill + 1-decode mesh against the in-process engine,
same prompts, same run, one request at a time; the mesh's TTFT is broken down into
queueing, prefill compute and KV transfer (measured by the prefill node) and the rest
(RPC, routing, scheduling hops).

The client keeps one channel to the gateway, connected before anything is timed, as any
serving client does (grpc channels are long-lived and carry many calls): TTFT is from
sending the request to its first token, without TCP/HTTP2 connection setup.

    python bench/ttft.py [--lengths 128 512 1024] [--repeats 6] [--transfer mooncake]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

from bench_mesh import start_pd_mesh
from bench_model import ROOT, ensure_bench_model

from common.engine import LLM, SamplingParams  # noqa: E402
from services.security.client_auth import gateway_channel  # noqa: E402

ENGINE = {"num_blocks": 1024, "max_num_seqs": 16, "max_model_len": 4096}


class Client:
    """One persistent channel to the gateway, on its own event loop, ready before use."""

    def __init__(self, address: str):
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self._connect(address))

    async def _connect(self, address: str) -> None:
        from protos.pdmesh.v1 import gateway_pb2_grpc
        self.channel = gateway_channel(address)
        await asyncio.wait_for(self.channel.channel_ready(), 30)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    def first_token(self, ids: list[int]):
        return self.loop.run_until_complete(self._first_token(ids))

    async def _first_token(self, ids: list[int]):
        from protos.pdmesh.v1 import common_pb2, gateway_pb2
        req = gateway_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=1, ignore_eos=True))
        req.prompt_token_ids.ids.extend(ids)
        start = time.perf_counter()
        async for msg in self.stub.Generate(req):
            return time.perf_counter() - start, msg.prefill_timing, list(msg.token_ids)

    def close(self) -> None:
        self.loop.run_until_complete(self.channel.close())
        self.loop.close()


def p50(values):
    return statistics.median(values) if values else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024])
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--transfer", default="mooncake", choices=["mooncake", "grpc"])
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "ttft.json"))
    args = ap.parse_args()
    model = ensure_bench_model(*( [args.model_dir] if args.model_dir else []))
    vocab = 640
    rng = random.Random(0)
    llm = LLM(str(model), **ENGINE)
    mesh = start_pd_mesh(model, ENGINE, args.transfer, prefix="pdmesh-ttft-")
    address = mesh.gateway_address
    results = {}
    client = None
    try:
        client = Client(address)
        client.first_token([5] * 64)  # warm-up
        llm.generate({"prompt_token_ids": [5] * 64}, SamplingParams(max_tokens=1))
        for n in args.lengths:
            rows = []
            for _ in range(args.repeats):
                ids = [rng.randrange(3, vocab) for _ in range(n)]
                start = time.perf_counter()
                local = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0.0))
                inproc = time.perf_counter() - start
                ttft, timing, tok = client.first_token(ids)
                assert tok == local[0].outputs[0].token_ids, "mesh and in-process first tokens differ"
                parts = (timing.queue_ms + timing.compute_ms + timing.transfer_ms) / 1e3
                rows.append(dict(inproc_s=inproc, mesh_s=ttft, queue_s=timing.queue_ms / 1e3,
                                 compute_s=timing.compute_ms / 1e3, transfer_s=timing.transfer_ms / 1e3,
                                 overhead_s=ttft - parts, remote=timing.remote))
            summary = {k: p50([r[k] for r in rows]) for k in rows[0] if k != "remote"}
            summary["overhead_vs_inproc_s"] = p50([r["mesh_s"] - r["transfer_s"] - r["inproc_s"] for r in rows])
            results[n] = {"p50": summary, "runs": rows}
            print(f"prompt {n:>5}: in-process {summary['inproc_s'] * 1e3:7.1f} ms | mesh {summary['mesh_s'] * 1e3:7.1f} ms "
                  f"= queue {summary['queue_s'] * 1e3:.1f} + compute {summary['compute_s'] * 1e3:.1f} + "
                  f"transfer {summary['transfer_s'] * 1e3:.1f} + overhead {summary['overhead_s'] * 1e3:.1f} ms "
                  f"(mesh - transfer - in-process: {summary['overhead_vs_inproc_s'] * 1e3:.1f} ms)", flush=True)
    finally:
        if client is not None:
            client.close()
        mesh.stop()
    out = {"transfer": args.transfer, "engine": ENGINE, "lengths": results,
           "target": "overhead besides the transfer <= 10 ms at p50"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
