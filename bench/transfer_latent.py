"""`bench/transfer.py --latent`: who writes an MLA decode rank's copy of the latent.

Under tensor parallelism every rank of an MLA model holds the same latent cache, so a
prefill node at TP p can fill a decode node at TP d from any of its ranks
(common/transfer/tp_pairing.py). For p = d = 2 (a 4,096-token prompt, the bench layout's 8
layers and block size 16, DeepSeek's 576-wide latent rows, float32: 72 MiB a copy), with
`mooncake` (protocol tcp), each case timed from the first push's start to the last ack, the
receivers zeroed before and checksummed after every push:
- `p1d1`: one rank pushes one copy into one receiver (the reference);
- `spread`: decode rank j's copy from prefill rank j % p (what pdmesh does): two senders,
  one engine each, push at once;
- `one-writer`: prefill rank 0 pushes both copies at once (two threads on one engine), the
  other rank idle.
Cases alternate in a rotating order each round; the ratio is the median of per-round
`p1d1` time / case time (2 copies move twice p1d1's bytes: 2.0 would be twice its rate).
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from transfer import LAYOUT, NUM_TOKENS, Receiver, digest, latent_shape, process_cpu_s

from common.kv_layout import KVLayout
from common.transfer import KVSender, create_transfer

WIDTH = 576       # kv_lora_rank 512 + qk_rope_head_dim 64


def _sender(kv: torch.Tensor) -> KVSender:
    engine = create_transfer("mooncake")
    local = KVLayout.of_tensor(kv)
    engine.register(local.base_address, local.span_bytes)
    return KVSender(engine, local)


def latent_main(args, env: dict[str, str]) -> None:
    """The --latent cases (module docstring); writes args.out and prints a summary."""
    num_blocks = NUM_TOKENS // LAYOUT["block_size"]
    torch.manual_seed(0)
    latent = torch.randn(latent_shape(num_blocks, WIDTH))
    copy_bytes = latent.numel() * latent.element_size()
    copies = [latent.clone() for _ in range(3)]     # every prefill rank holds the same latent (kept alive)
    ranks = [_sender(kv) for kv in copies[:2]]
    reference = _sender(copies[2])
    decode = [Receiver("mooncake", num_blocks, env, latent_width=WIDTH) for _ in range(2)]
    ids = list(range(num_blocks))

    def push(sender: KVSender, receiver: Receiver):
        return lambda: sender.send_blocks(receiver.info["endpoint"], receiver.layout, ids, ids)

    cases = {"p1d1": [push(reference, decode[0])],
             "spread": [push(ranks[j % 2], decode[j]) for j in range(2)],
             "one-writer": [push(ranks[0], decode[j]) for j in range(2)]}
    receivers = {"p1d1": decode[:1], "spread": decode, "one-writer": decode}
    expected = digest(latent)
    names = list(cases)
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu = {name: [0.0, 0.0] for name in names}
    match = dict.fromkeys(names, True)
    with ThreadPoolExecutor(2) as pool:
        for rep in range(args.repeats + 1):
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                assert all(r.ask("zero") == "ok" for r in receivers[name])
                cpu_start = (time.process_time(), sum(process_cpu_s(r.proc.pid) for r in receivers[name]))
                start = time.perf_counter()
                sent = sum(f.result() for f in [pool.submit(p) for p in cases[name]])
                elapsed = time.perf_counter() - start
                assert sent == copy_bytes * len(cases[name]), (name, sent)
                if rep:
                    times[name].append(elapsed)
                    cpu[name][0] += time.process_time() - cpu_start[0]
                    cpu[name][1] += sum(process_cpu_s(r.proc.pid) for r in receivers[name]) - cpu_start[1]
                match[name] &= all(r.ask("sum") == expected for r in receivers[name])

    def summary(name: str) -> dict:
        ts = times[name]
        return {"copies": len(cases[name]), "median_ms": round(statistics.median(ts) * 1e3, 2),
                "runs_ms": [round(t * 1e3, 2) for t in ts],
                "gb_per_s": round(copy_bytes * len(cases[name]) / statistics.median(ts) / 1e9, 3),
                "ratio_to_p1d1": round(statistics.median(r / t for r, t in zip(times["p1d1"], ts)), 4),
                "bytes_match": match[name],
                "cpu_ms_per_push": {"senders": round(cpu[name][0] / len(ts) * 1e3, 1),
                                    "receivers": round(cpu[name][1] / len(ts) * 1e3, 1)}}

    results = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "payload": {"num_layers": LAYOUT["num_layers"], "block_size": LAYOUT["block_size"], "latent_width": WIDTH,
                    "dtype": "float32", "num_tokens": NUM_TOKENS, "num_blocks": num_blocks, "bytes_per_copy": copy_bytes,
                    "backend": "mooncake", "protocol": "tcp", "prefill_ranks": 2, "decode_ranks": 2},
        "repeats": args.repeats,
        "ratio_to_p1d1": "median over rounds of p1d1_time / case_time (the case moves `copies` times the bytes)",
        "results": {name: summary(name) for name in names},
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
                    "platform": platform.platform(), "load_avg": os.getloadavg()},
    }
    for r in decode:
        r.finish()
    for s in [*ranks, reference]:
        s.engine.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"MLA latent push, prefill TP 2 -> decode TP 2, mooncake tcp, {copy_bytes / 2**20:.0f} MiB a copy, "
          f"median of {args.repeats}:")
    for name, r in results["results"].items():
        print(f"  {name:10s} {r['copies']} cop{'y' if r['copies'] == 1 else 'ies'}  {r['median_ms']:8.1f} ms  "
              f"{r['gb_per_s']:6.3f} GB/s  {r['ratio_to_p1d1']:6.3f}x p1d1 time  CPU ms senders "
              f"{r['cpu_ms_per_push']['senders']:7.1f} receivers {r['cpu_ms_per_push']['receivers']:6.1f}  "
              f"bytes match: {r['bytes_match']}")
    print(f"wrote {args.out}")
