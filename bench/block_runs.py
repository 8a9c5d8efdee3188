"""KV push writes per block in steady state: how consecutive the block ids of a prefill node
and a decode node stay after their caches have churned.

A push is one write per (layer, K/V, run of consecutive block ids on both sides), so the
writes per pushed block (per layer and K/V) decide whether a push moves a few long ranges
or one 16 KiB range per block (docs/benchmarks.md, "KV transfer": about 50 µs each on
Mooncake over TCP). This replays a mixed workload through the engine's real BlockManager on
both sides, with no model: prompts of 64-2,047 tokens, 30% of them behind a shared system
prompt of 128-512 tokens, 16-511 generated tokens each, up to 8 requests decoding at once on
a 2,048-block decode cache fed by a 1,024-block prefill cache (block size 16). The first
100 requests warm the caches up and are not counted.

    python bench/block_runs.py [--requests 600] [--seeds 5] [--out bench/results/block_runs.json]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.engine.block_manager import BlockManager  # noqa: E402
from common.engine.sampling_params import SamplingParams  # noqa: E402
from common.engine.sequence import Sequence  # noqa: E402
from common.transfer import block_runs  # noqa: E402

BLOCK_SIZE, WARMUP, MAX_DECODING = 16, 100, 8


def computed(bm: BlockManager, seq: Sequence) -> None:
    seq.num_computed_tokens = len(seq.token_ids)
    bm.cache_full_blocks(seq)


def replay(seed: int, num_requests: int) -> list[tuple[int, int]]:
    """(blocks pushed, runs) per counted request."""
    rng = random.Random(seed)
    prefill, decode = BlockManager(1024, BLOCK_SIZE), BlockManager(2048, BLOCK_SIZE)
    system = [rng.randrange(1000) for _ in range(512)]
    decoding: deque[Sequence] = deque()
    pushes = []
    for i in range(num_requests):
        shared = system[:rng.choice([128, 256, 512])] if rng.random() < 0.3 else []
        prompt = shared + [rng.randrange(1000) for _ in range(rng.randrange(64, 2048))]
        on_decode = Sequence(f"d{i}", list(prompt), SamplingParams(), i)
        on_prefill = Sequence(f"p{i}", list(prompt), SamplingParams(), i)
        while not decode.allocate(on_decode):
            decode.free(decoding.popleft())
        assert prefill.allocate(on_prefill), "the prefill cache holds one request at a time"
        dst = on_decode.block_ids[on_decode.num_computed_tokens // BLOCK_SIZE:]
        src = on_prefill.block_ids[len(on_prefill.block_ids) - len(dst):]
        if i >= WARMUP:
            pushes.append((len(dst), len(block_runs(src, dst))))
        computed(prefill, on_prefill)
        prefill.free(on_prefill)
        computed(decode, on_decode)
        on_decode.token_ids.extend(rng.randrange(1000) for _ in range(rng.randrange(16, 512)))
        while not decode.can_append(on_decode):
            decode.free(decoding.popleft())
        decode.append_slots(on_decode)
        decoding.append(on_decode)
        if len(decoding) > MAX_DECODING:
            decode.free(decoding.popleft())
    while decoding:
        decode.free(decoding.popleft())
    assert prefill.num_used_blocks == 0 and decode.num_used_blocks == 0
    return pushes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench/results/block_runs.json"))
    args = ap.parse_args()
    per_seed = []
    for seed in range(args.seeds):
        pushes = replay(seed, args.requests)
        blocks, runs = sum(b for b, _ in pushes), sum(r for _, r in pushes)
        per_seed.append({"seed": seed, "pushes": len(pushes), "blocks": blocks, "runs": runs,
                         "runs_per_block": round(runs / blocks, 4),
                         "median_blocks_per_run": statistics.median(b / r for b, r in pushes)})
    runs_per_block = round(sum(s["runs"] for s in per_seed) / sum(s["blocks"] for s in per_seed), 4)
    results = {"block_size": BLOCK_SIZE, "requests_per_seed": args.requests, "warmup": WARMUP,
               "runs_per_block": runs_per_block, "seeds": per_seed}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"steady state over {args.seeds} seeds x {args.requests - WARMUP} requests: "
          f"{runs_per_block:.3f} writes per pushed block (1.000 = one write per block), "
          f"{1 / runs_per_block:.1f} blocks per write")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
