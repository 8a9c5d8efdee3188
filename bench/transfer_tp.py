"""`bench/transfer.py --tp`: the KV push across tensor-parallel sizes (the receivers,
checksums and per-process CPU accounting are bench/transfer.py's).

`--tp` instead pushes the same prompt's KV across tensor-parallel sizes with `mooncake`
(protocol tcp), each case timed from the first push's start to the last one's ack, with the
receivers zeroed before and checksummed after every push:
- `p1d1`: the whole 4-head cache, one push into one receiver (the reference);
- `p2d2`: two sender ranks (2 heads each, one engine each, one thread each) push their whole
  blocks at once, each into its own 2-head receiver process;
- `p2d1`: the same two ranks push their head slices (head_offset 0 and 2) at once into one
  4-head receiver: one 512-byte write per (layer, K/V, block, token slot);
- `p2d1-staged`: the same destination bytes sent as whole blocks: rank i first copies both
  ranks' heads of its half of the blocks into a registered 4-head staging cache (standing in
  for an all-to-all between the prefill ranks), then pushes that half as runs of blocks.
Cases alternate in a rotating order each round; the ratio is the median of per-round
`p1d1` time / case time (the case's GB/s over the reference's).
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from transfer import LAYOUT, NUM_TOKENS, Receiver, digest, kv_shape, process_cpu_s

from common.kv_layout import KVLayout
from common.transfer import KVSender, create_transfer, plan_head_slice_writes


@dataclass
class Push:
    """One rank's push of src_ids (its cache) into dst_ids of a receiver at head_offset
    (None: the same heads); `prepare` runs first, inside the timing (the staging copy)."""

    sender: KVSender
    receiver: Receiver
    src_ids: list[int]
    dst_ids: list[int]
    head_offset: int | None = None
    prepare: Callable[[], None] | None = None
    prepare_s: list[float] = field(default_factory=list)

    def __call__(self) -> int:
        if self.prepare is not None:
            start = time.perf_counter()
            self.prepare()
            self.prepare_s.append(time.perf_counter() - start)
        return self.sender.send_blocks(self.receiver.info["endpoint"], self.receiver.layout, self.src_ids,
                                       self.dst_ids, head_offset=self.head_offset)

    @property
    def num_writes(self) -> int:
        return len(plan_head_slice_writes(self.sender.local, self.receiver.layout, self.head_offset or 0,
                                          self.src_ids, self.dst_ids))


def sender(kv: torch.Tensor, engine=None) -> KVSender:
    """A KVSender over kv registered with engine (default: a new mooncake engine)."""
    engine = engine or create_transfer("mooncake")
    local = KVLayout.of_tensor(kv)
    engine.register(local.base_address, local.span_bytes)
    return KVSender(engine, local)


def tp_main(args, env: dict[str, str]) -> None:
    """The --tp cases (module docstring); writes args.out and prints a summary."""
    num_blocks, heads = NUM_TOKENS // LAYOUT["block_size"], LAYOUT["num_kv_heads"]
    k = 2  # prefill ranks
    torch.manual_seed(0)
    full = torch.randn(kv_shape(num_blocks))
    nbytes = full.numel() * full.element_size()
    per_rank = heads // k
    ranks = [full[..., i * per_rank:(i + 1) * per_rank, :].contiguous() for i in range(k)]
    rank_senders = [sender(kv) for kv in ranks]
    half = num_blocks // k
    staging = [torch.zeros(kv_shape(half)) for _ in range(k)]
    staging_senders = [sender(buf, s.engine) for buf, s in zip(staging, rank_senders)]

    def stage(i: int) -> Callable[[], None]:
        def copy() -> None:
            for j, kv in enumerate(ranks):
                staging[i][..., j * per_rank:(j + 1) * per_rank, :].copy_(kv[:, :, i * half:(i + 1) * half])
        return copy

    whole = Receiver("mooncake", num_blocks, env)
    split = [Receiver("mooncake", num_blocks, env, num_kv_heads=per_rank) for _ in range(k)]
    expected = {whole: digest(full), **{r: digest(kv) for r, kv in zip(split, ranks)}}
    ids = list(range(num_blocks))
    cases = {
        "p1d1": [Push(sender(full), whole, ids, ids)],
        "p2d2": [Push(s, r, ids, ids) for s, r in zip(rank_senders, split)],
        "p2d1": [Push(s, whole, ids, ids, head_offset=i * per_rank) for i, s in enumerate(rank_senders)],
        "p2d1-staged": [Push(s, whole, list(range(half)), list(range(i * half, (i + 1) * half)), prepare=stage(i))
                        for i, s in enumerate(staging_senders)],
    }
    names = list(cases)
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu = {name: [0.0, 0.0] for name in names}
    match = dict.fromkeys(names, True)
    with ThreadPoolExecutor(k) as pool:
        for rep in range(args.repeats + 1):
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                pushes = cases[name]
                receivers = list(dict.fromkeys(p.receiver for p in pushes))
                assert all(r.ask("zero") == "ok" for r in receivers)
                cpu_start = (time.process_time(), sum(process_cpu_s(r.proc.pid) for r in receivers))
                start = time.perf_counter()
                sent = sum(f.result() for f in [pool.submit(p) for p in pushes])
                elapsed = time.perf_counter() - start
                if rep:
                    times[name].append(elapsed)
                    cpu[name][0] += time.process_time() - cpu_start[0]
                    cpu[name][1] += sum(process_cpu_s(r.proc.pid) for r in receivers) - cpu_start[1]
                assert sent == nbytes, (name, sent)
                match[name] &= all(r.ask("sum") == expected[r] for r in receivers)

    def summary(name: str) -> dict:
        ts, pushes = times[name], cases[name]
        out = {"ranks": len(pushes), "writes_per_rank": [p.num_writes for p in pushes],
               "writes_per_block_per_rank": [round(p.num_writes / len(p.src_ids), 4) for p in pushes],
               "gb_per_s": round(nbytes / statistics.median(ts) / 1e9, 3),
               "ratio_to_p1d1": round(statistics.median(r / t for r, t in zip(times["p1d1"], ts)), 4),
               "median_ms": round(statistics.median(ts) * 1e3, 2), "runs_ms": [round(t * 1e3, 2) for t in ts],
               "bytes_match": match[name],
               "cpu_ms_per_push": {"senders": round(cpu[name][0] / len(ts) * 1e3, 1),
                                   "receivers": round(cpu[name][1] / len(ts) * 1e3, 1)}}
        if pushes[0].prepare_s:
            out["staging_copy_ms"] = round(statistics.median(s for p in pushes for s in p.prepare_s[1:]) * 1e3, 2)
        return out

    results = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "payload": {**LAYOUT, "dtype": "float32", "num_tokens": NUM_TOKENS, "num_blocks": num_blocks,
                    "bytes": nbytes, "backend": "mooncake", "protocol": "tcp", "prefill_ranks": k},
        "repeats": args.repeats,
        "ratio_to_p1d1": "median over rounds of p1d1_time / case_time (= case GB/s / p1d1 GB/s)",
        "writes_per_block_per_rank": "writes of one rank's push / blocks it pushes (all layers and K/V)",
        "results": {name: summary(name) for name in names},
        "env": {k: v for k, v in os.environ.items() if k.startswith("MC_")},
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
                    "platform": platform.platform(), "load_avg": os.getloadavg()},
    }
    for r in [whole, *split]:
        r.finish()
    for s in [*rank_senders, cases["p1d1"][0].sender]:
        s.engine.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"KV push across TP sizes, mooncake tcp, {nbytes / 2**20:.0f} MiB ({num_blocks} blocks, "
          f"{NUM_TOKENS} tokens), median of {args.repeats}:")
    for name, r in results["results"].items():
        staged = f"  (staging copy {r['staging_copy_ms']:.1f} ms)" if "staging_copy_ms" in r else ""
        print(f"  {name:12s} {r['ranks']} rank(s) x {r['writes_per_rank'][0]:6d} writes "
              f"({r['writes_per_block_per_rank'][0]:g}/block)  {r['median_ms']:8.1f} ms  "
              f"{r['gb_per_s']:6.3f} GB/s  {r['ratio_to_p1d1']:6.3f}x p1d1  "
              f"CPU ms senders {r['cpu_ms_per_push']['senders']:7.1f} receivers "
              f"{r['cpu_ms_per_push']['receivers']:6.1f}  bytes match: {r['bytes_match']}{staged}")
    print(f"wrote {args.out}")
