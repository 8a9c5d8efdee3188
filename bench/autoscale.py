"""Autoscaling a load ramp (issue 31's target): goodput and node-seconds of one ramp
replayed against three meshes, one after another, each started by `pdmesh up` in a
subprocess as a user runs it:

  small      1 prefill + 1 decode node, fixed
  large      1 prefill + 3 decode nodes, fixed (the ramp's peak size: the autoscaler's MAX)
  autoscale  1 prefill + 1 decode node, `pdmesh up --autoscale decode=1:3`

    python bench/autoscale.py [--out bench/results/autoscale.json] [--seed 31] [--meshes small,large,autoscale]

The ramp: open-loop Poisson arrivals at a rate piecewise linear through RAMP (seconds,
requests/s): a floor, a rise, a plateau at the peak, a fall, the floor again. Every mesh
gets the same arrival times, prompts (random token ids, PROMPT_TOKENS long) and output
lengths (OUTPUT_TOKENS, greedy, ignore_eos). The model: a tiny Llama by make_tiny_model
with MODEL (~20M parameters, so that a decode step's cost grows with its batch; the
default 4 x 256 one decoded 15 requests/s here without its ITL moving). The three meshes
share one config but for their nodes: the planner on in each (PLANNER; the fixed ones
ignore it), no core plan (`--no-core-plan`: every service may run on every core, as a
node the autoscaler starts does anyway, so the three meshes are placed alike).

The planner's profile is hand-written: a decode node keeps DECODE_TOKENS_PER_S output
tokens/s (one batch point, so the observed-ITL correction leaves that rate alone; prefill
so fast that the planner's prefill count stays 1). The floor's ~160 output tokens/s then
wants 1 decode node and the peak's ~720 wants 3. A profile measured here would want one
node at every rate of this ramp, since every node shares the same two cores; the
hand-written one stands for nodes that bring their own hardware, so that the control
loop (its lag, a start's cost, the drains) runs under a real ramp. Every engine runs one
OpenMP thread with the passive wait policy (ENGINE_ENV: a node's fixed share; torch's
default of two spinning threads a process made four engines on two cores several times
slower in a pilot).

Goodput: the share of the requests sent that finished with TTFT <= TTFT_SLO_MS and mean
ITL ((last token - first token) / (tokens - 1), DistServe's TPOT) <= ITL_SLO_MS; a failed
request misses. TTFT counts from the request's scheduled arrival. The SLOs are a few times
what the small mesh gives at the floor and just above its tail at the peak (pilot runs
here at a steady rate: TTFT p50 ~60 ms and ITL ~9 ms at 2-6 requests/s; at 10/s TTFT p99
~230 ms, ITL p99 ~17 ms; at 14/s its queue grows): TTFT_SLO_MS 300, ITL_SLO_MS
25. The small mesh thus meets them through the ramp with little room at the peak, and a
mesh that serves the peak worse than it shows it in goodput; looser, nothing would miss
and the comparison would say nothing; tighter, the floor itself would miss on this
machine's hiccups. Goodput at half and at twice both SLOs is reported too (`goodput_at`),
so that no single choice decides the result, and per 10 s of arrivals (`goodput_by_10s`).

Node-seconds: over the ramp's window (its first arrival to its last request's end), the
time each engine node's process was alive: the config's nodes the whole window; a node the
autoscaler started from its `starting (autoscale)` status line to its `stopped` line (lines
stamped as read). The meta-server's view is beside it: ListNodes polled every POLL_S, the
engine nodes up or draining, integrated (`registered_node_s`).

Exactness: every request's tokens against the offline engine (common.engine.LLM, greedy,
the nodes' engine settings), computed once after the three runs; `mismatches` counts the
requests that differ (0 expected).

On this machine (2 cores) more nodes cannot add compute: every node shares the same two
cores, so the large mesh cannot serve the peak faster than the small one except by
spreading Python overhead over processes, and a node started under load takes CPU from
the ones serving. What the run shows is whether autoscaling costs goodput against the
small mesh and how many node-seconds it saves against the large one; the output says so.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402
from up_mesh import POLL_S, Poller, UpProcess  # noqa: E402

MODEL = dict(hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=4)   # make_tiny_model's, ~20M parameters
ENGINE = {"num_blocks": 1024, "max_num_seqs": 32, "max_model_len": 2048}
RAMP = ((0, 2.0), (20, 2.0), (45, 9.0), (85, 9.0), (110, 2.0), (150, 2.0))   # (s, requests/s)
PROMPT_TOKENS = (16, 128)         # uniform, inclusive
OUTPUT_TOKENS = (32, 128)
VOCAB = 1024                      # the tiny model's
TTFT_SLO_MS, ITL_SLO_MS = 300.0, 25.0
DECODE_TOKENS_PER_S = 280.0
PLANNER = {"enabled": True, "interval_s": 4.0, "min_nodes": 1, "max_nodes": 3, "scale_down_after": 3,
           "cooldown_s": 8.0}
MESHES = {"small": (1, ""), "large": (3, ""), "autoscale": (1, "decode=1:3")}   # decode nodes, --autoscale
ENGINE_ENV = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}   # every service of every mesh
REQUEST_TIMEOUT_S = 120.0
START_GUARD_S = 300.0             # `pdmesh up` not ready by then: something is wrong
LINE = re.compile(r"^(\S+)\s+(?:(prefill|decode|both)\s+)?(.*)$")


@dataclass(frozen=True)
class Request:
    at_s: float                   # scheduled arrival, from the ramp's start
    prompt_ids: list[int]
    max_tokens: int


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    ttft_s: float | None = None
    itl_s: float | None = None    # mean, first to last token
    end_s: float = 0.0            # from the ramp's start
    finish: str = ""
    error: str = ""               # a gRPC status name when the request failed


def rate_at(t: float) -> float:
    for (t0, r0), (t1, r1) in zip(RAMP, RAMP[1:]):
        if t0 <= t <= t1:
            return r0 + (r1 - r0) * (t - t0) / (t1 - t0)
    return 0.0


def make_requests(seed: int) -> list[Request]:
    """Poisson arrivals at rate_at(t) (thinning a process at the peak rate), seeded."""
    rng = random.Random(seed)
    peak, end = max(r for _, r in RAMP), RAMP[-1][0]
    out, t = [], 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= end:
            return out
        if rng.random() < rate_at(t) / peak:
            prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(*PROMPT_TOKENS))]
            out.append(Request(round(t, 4), prompt, rng.randint(*OUTPUT_TOKENS)))


async def replay(gateway: str, requests: list[Request], t0: float) -> list[Outcome]:
    """Each request sent at t0 + at_s (open loop) on one channel; what came back."""
    import grpc
    from protos.pdmesh.v1 import gateway_pb2_grpc
    from services.cli.client import build_request
    from services.security.client_auth import gateway_channel
    async with gateway_channel(gateway) as ch:
        await asyncio.wait_for(ch.channel_ready(), 30)
        stub = gateway_pb2_grpc.GatewayStub(ch)

        async def one(req: Request) -> Outcome:
            await asyncio.sleep(max(0.0, t0 + req.at_s - time.monotonic()))
            out, first, last = Outcome(), None, None
            try:
                async for msg in stub.Generate(build_request(req.prompt_ids, max_tokens=req.max_tokens,
                                                             ignore_eos=True), timeout=REQUEST_TIMEOUT_S):
                    if msg.token_ids:
                        last = time.monotonic()
                        first = first or last
                        out.tokens.extend(msg.token_ids)
                    out.finish = msg.finish_reason or out.finish
            except grpc.aio.AioRpcError as e:
                out.error = e.code().name
            out.end_s = time.monotonic() - t0
            if first is not None:
                out.ttft_s = first - (t0 + req.at_s)
                if len(out.tokens) > 1:
                    out.itl_s = (last - first) / (len(out.tokens) - 1)
            return out
        return list(await asyncio.gather(*(one(r) for r in requests)))


def warm_up(gateway: str) -> None:
    """A few short requests, so the first of the ramp does not pay a cold engine's first steps."""
    rng = random.Random(0)
    asyncio.run(replay(gateway, [Request(0.1 * i, [rng.randrange(3, VOCAB) for _ in range(64)], 8)
                                 for i in range(4)], time.monotonic()))


def write_config(work: Path, model: Path, num_decode: int) -> Path:
    profile = {"format": "pdmesh-node-profile/1",
               "prefill": [{"prompt_tokens": 16, "ttft_s": 0.001, "tokens_per_s": 1e6},
                           {"prompt_tokens": 2048, "ttft_s": 0.002, "tokens_per_s": 1e6}],
               "decode": [{"context_tokens": 256, "batch": 8, "itl_s": 8 / DECODE_TOKENS_PER_S}],
               "about": {"note": "hand-written by bench/autoscale.py (its docstring says why)"}}
    (work / "profile.json").write_text(json.dumps(profile))
    planner = {**PLANNER, "ttft_slo_ms": TTFT_SLO_MS, "itl_slo_ms": ITL_SLO_MS, "profile": str(work / "profile.json")}
    nodes = [{"role": "prefill", "node_id": "prefill-0"}] + [{"role": "decode", "node_id": f"decode-{i}"}
                                                             for i in range(num_decode)]
    raw = {"model": str(model), "engine": dict(ENGINE), "transfer": {"backend": "mooncake"},
           "meta_server": {"port": 0, "ttl_seconds": 2.0, "planner": planner}, "gateway": {"port": 0},
           "nodes": nodes}
    path = work / "mesh.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def process_node_s(lines: list[tuple[float, str]], config_nodes: list[str], t0: float, t1: float) -> float:
    """Seconds of engine-node processes alive within [t0, t1] (module docstring)."""
    total = (t1 - t0) * len(config_nodes)
    started: dict[str, float] = {}
    for at, line in lines:
        m = LINE.match(line)
        if m is None:
            continue
        node, what = m[1], m[3]
        if what == "starting (autoscale)":
            started[node] = at
        elif node in started and (what == "stopped" or what.startswith("did not start") or "while draining" in what):
            total += max(0.0, min(at, t1) - max(started.pop(node), t0))
    return total + sum(max(0.0, t1 - max(at, t0)) for at in started.values())


def registered_node_s(samples, t0: float, t1: float) -> float:
    inside = [(at, live) for at, live, _ in samples if t0 <= at <= t1]
    return sum((b[0] - a[0]) * len(a[1]) for a, b in zip(inside, inside[1:]))


def run_mesh(name: str, work: Path, model: Path, requests: list[Request]) -> dict:
    num_decode, bounds = MESHES[name]
    work.mkdir(parents=True)
    config = write_config(work, model, num_decode)
    os.environ["PDMESH_STATE_DIR"] = str(work / "state")   # this process's clients find the mesh's credentials there
    up = UpProcess(config, work / "logs", ["--autoscale", bounds] if bounds else [],
                   {"PDMESH_STATE_DIR": str(work / "state"), **ENGINE_ENV})
    poller = None
    try:
        began = time.monotonic()
        gateway = up.wait_for(r"^gateway ready at (\S+)$", START_GUARD_S)[1]
        start_s = time.monotonic() - began
        if bounds:
            up.wait_for(r"^autoscale\s+decode 1\.\.3 nodes, following the planner", 30)
        meta = json.loads((work / "state" / "mesh.json").read_text())["meta"]
        poller = Poller(meta)
        warm_up(gateway)
        time.sleep(PLANNER["interval_s"] + 1)   # the warm-up's requests in a planner window of their own
        print(f"{name}: ready in {start_s:.1f}s; replaying {len(requests)} requests over {RAMP[-1][0]}s",
              flush=True)
        t0 = time.monotonic()
        outcomes = asyncio.run(replay(gateway, requests, t0))
        t1 = max(t0 + RAMP[-1][0], t0 + max(o.end_s for o in outcomes))
        time.sleep(POLL_S * 2)
    finally:
        if poller is not None:
            poller.close()
        code = up.stop()
    config_nodes = ["prefill-0"] + [f"decode-{i}" for i in range(num_decode)]
    decisions, seen = [], set()
    for at, live, plan in poller.samples:
        if plan["decision"] not in seen and t0 <= at <= t1:
            seen.add(plan["decision"])
            decisions.append({"t_s": round(at - t0, 1), **plan})
    timeline = [(round(at - t0, 1), sum(1 for n in live if n.startswith("decode")))
                for at, live, _ in poller.samples if t0 <= at <= t1]
    return {"mesh": name, "decode_nodes": num_decode, "autoscale": bounds, "start_s": round(start_s, 1),
            "window_s": round(t1 - t0, 1), "up_exit_code": code,
            "node_s": round(process_node_s(up.lines, config_nodes, t0, t1), 1),
            "registered_node_s": round(registered_node_s(poller.samples, t0, t1), 1),
            "max_decode_nodes": max((n for _, n in timeline), default=0),
            "decode_nodes_timeline": timeline[::4], "planner_decisions": decisions,
            "autoscale_lines": [f"{at - t0:7.1f}s {text}" for at, text in up.lines
                                if bounds and re.match(r"^(autoscale|decode-a)", text)],
            "outcomes": outcomes}


def reference(model: Path, requests: list[Request]) -> list[list[int]]:
    from common.engine import LLM, SamplingParams
    llm = LLM(str(model), **ENGINE)
    outs = llm.generate([{"prompt_token_ids": r.prompt_ids} for r in requests],
                        [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in requests])
    return [list(o.outputs[0].token_ids) for o in outs]


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def goodput(outcomes: list[Outcome], ttft_ms: float, itl_ms: float) -> float:
    good = sum(1 for o in outcomes if not o.error and o.ttft_s is not None and o.ttft_s * 1e3 <= ttft_ms
               and (o.itl_s is None or o.itl_s * 1e3 <= itl_ms))
    return good / len(outcomes)


def summarize(run: dict, requests: list[Request], want: list[list[int]]) -> dict:
    outs: list[Outcome] = run.pop("outcomes")
    done = [o for o in outs if not o.error]
    ms = lambda v: None if v is None else round(v * 1e3, 1)   # noqa: E731
    ttfts, itls = [o.ttft_s for o in done if o.ttft_s is not None], [o.itl_s for o in done if o.itl_s is not None]
    peak = [o for r, o in zip(requests, outs) if rate_at(r.at_s) >= 0.8 * max(x for _, x in RAMP)]
    run.update({
        "requests": len(outs), "completed": len(done), "failed": len(outs) - len(done),
        "errors": sorted({o.error for o in outs if o.error}),
        "mismatches": sum(1 for o, w in zip(outs, want) if not o.error and (o.tokens, o.finish) != (w, "length")),
        "goodput": round(goodput(outs, TTFT_SLO_MS, ITL_SLO_MS), 4),
        "goodput_at": {f"{k}x_slo": round(goodput(outs, k * TTFT_SLO_MS, k * ITL_SLO_MS), 4) for k in (0.5, 2)},
        "goodput_peak": round(goodput(peak, TTFT_SLO_MS, ITL_SLO_MS), 4) if peak else None,
        "goodput_by_10s": [round(goodput(w, TTFT_SLO_MS, ITL_SLO_MS), 3) if w else None for w in
                           ([o for r, o in zip(requests, outs) if s <= r.at_s < s + 10]
                            for s in range(0, int(RAMP[-1][0]), 10))],
        "ttft_ms": {"p50": ms(pct(ttfts, 0.5)), "p90": ms(pct(ttfts, 0.9)), "p99": ms(pct(ttfts, 0.99))},
        "itl_ms": {"p50": ms(pct(itls, 0.5)), "p90": ms(pct(itls, 0.9)), "p99": ms(pct(itls, 0.99))},
        "per_request": [[r.at_s, len(r.prompt_ids), r.max_tokens, ms(o.ttft_s), ms(o.itl_s), o.error or None]
                        for r, o in zip(requests, outs)],
    })
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "autoscale.json"))
    ap.add_argument("--seed", type=int, default=31)
    ap.add_argument("--meshes", default=",".join(MESHES), help="which of small,large,autoscale to run, in order")
    args = ap.parse_args()
    names = [n.strip() for n in args.meshes.split(",")]
    if not names or any(n not in MESHES for n in names):
        raise SystemExit(f"--meshes: a comma-separated list of {', '.join(MESHES)}, got {args.meshes!r}")
    requests = make_requests(args.seed)
    began = time.monotonic()
    runs = []
    with tempfile.TemporaryDirectory(prefix="pdmesh-autoscale-") as tmp:
        from common.model.tiny import make_tiny_model
        model = make_tiny_model("llama", Path(tmp) / "tiny-llama", **MODEL)
        for name in names:
            runs.append(run_mesh(name, Path(tmp) / name, model, requests))
        print("checking every request against the offline engine", flush=True)
        want = reference(model, requests)
    runs = [summarize(run, requests, want) for run in runs]
    by = {r["mesh"]: r for r in runs}
    target = None
    if {"small", "large", "autoscale"} <= set(by):
        a, s, big = by["autoscale"], by["small"], by["large"]
        target = {"goodput_at_least_small": a["goodput"] >= s["goodput"],
                  "fewer_node_s_than_large": a["node_s"] < big["node_s"],
                  "autoscale_over_large_node_s": round(a["node_s"] / big["node_s"], 3),
                  "exact": all(r["mismatches"] == 0 for r in runs)}
        target["met"] = target["goodput_at_least_small"] and target["fewer_node_s_than_large"]
    out = {"command": " ".join(["python bench/autoscale.py", *sys.argv[1:]]),
           "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                       "load_avg_after": [round(x, 2) for x in os.getloadavg()]},
           "note": (f"{os.cpu_count()} cores: every node of every mesh shares them, so more nodes add no "
                    "compute; what is measured is whether autoscaling costs goodput against the small mesh "
                    "and how many node-seconds it saves against the large one"),
           "model": {"make_tiny_model": "llama", **MODEL}, "engine": ENGINE,
           "ramp": {"knots_s_rps": RAMP, "requests": len(requests), "prompt_tokens": PROMPT_TOKENS,
                    "output_tokens": OUTPUT_TOKENS, "seed": args.seed},
           "slo": {"ttft_ms": TTFT_SLO_MS, "itl_ms": ITL_SLO_MS},
           "planner": {**PLANNER, "decode_tokens_per_s_a_node": DECODE_TOKENS_PER_S},
           "wall_s": round(time.monotonic() - began, 1), "target": target, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(compact_json(out))
    print_summary(out)
    print(f"wrote {args.out}")
    return 0


_SCALAR = r'(?:-?[\d.eE+-]+|null|true|false|"[A-Za-z_]*")'
_FLAT_LIST = re.compile(rf"\[\s+({_SCALAR}(?:,\s+{_SCALAR})*)\s+\]")


def compact_json(out: dict) -> str:
    """Indented JSON with every list of plain numbers (or short words) on one line."""
    return _FLAT_LIST.sub(lambda m: "[" + re.sub(r",\s+", ", ", m[1]) + "]", json.dumps(out, indent=1)) + "\n"


def print_summary(out: dict) -> None:
    print(f"\nramp: {out['ramp']['requests']} requests over {out['ramp']['knots_s_rps'][-1][0]}s, "
          f"rates {out['ramp']['knots_s_rps']}; SLOs TTFT <= {TTFT_SLO_MS:.0f} ms, mean ITL <= {ITL_SLO_MS:.0f} ms")
    head = f"{'mesh':<10} {'done':>5} {'fail':>4} {'mism':>4} {'goodput':>8} {'@0.5x':>6} {'@2x':>6} " \
           f"{'peak':>6} {'TTFT p50/p99 ms':>16} {'ITL p50/p99':>12} {'node-s':>7} {'reg-s':>7} {'max D':>5}"
    print(head)
    for r in out["runs"]:
        print(f"{r['mesh']:<10} {r['completed']:>5} {r['failed']:>4} {r['mismatches']:>4} {r['goodput']:>8.1%} "
              f"{r['goodput_at']['0.5x_slo']:>6.1%} {r['goodput_at']['2x_slo']:>6.1%} "
              f"{(r['goodput_peak'] or 0):>6.1%} "
              f"{r['ttft_ms']['p50']:>7}/{r['ttft_ms']['p99']:<8} {r['itl_ms']['p50']:>5}/{r['itl_ms']['p99']:<6} "
              f"{r['node_s']:>7} {r['registered_node_s']:>7} {r['max_decode_nodes']:>5}")
    for r in out["runs"]:
        if r["autoscale"]:
            print(*r["autoscale_lines"], sep="\n")
    if out["target"]:
        t = out["target"]
        print(f"target (autoscale goodput >= small's, node-seconds < large's): {'MET' if t['met'] else 'NOT MET'} "
              f"(goodput >= small: {t['goodput_at_least_small']}, node-s {t['autoscale_over_large_node_s']:.2f}x "
              f"the large mesh's; every request exact: {t['exact']})")
    print(f"note: {out['note']}")


if __name__ == "__main__":
    raise SystemExit(main())
