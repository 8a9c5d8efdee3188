"""KV push bandwidth: `mooncake` and `grpc` against raw loopback TCP, same run, alternating.

Payload: a 4,096-token prompt's KV in the bench model's layout (8 layers, 4 KV heads,
head_dim 64, float32, block_size 16): 256 blocks, 64 MiB, sent by KVSender as one batch of
16 writes (layer x K/V, one run each) from this process into a receiver process's KV cache.
Raw TCP sends the same bytes with `sendall` (4 MiB pieces) into a preallocated buffer that
the receiver fills with `recv_into`, then acks one byte. Every timing ends with the ack.
`tcp-64k` is the same raw TCP at Mooncake's syscall size (64 KiB per send and recv), a
reference for what its TCP transport can reach. After the runs each receiver's checksum is
compared with the expected bytes. The ratio to raw TCP is the median of per-repeat ratios
(every path timed once per round, in turn), which cancels most of the drift of a shared,
busy host. `--scattered` adds a push into shuffled destination blocks: one 16 KiB write
per (layer, K/V, block), the worst case. CPU time per push (sender process, receiver
process) is reported too: it moves less than wall time when other work shares the cores.

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

    python bench/transfer.py [--repeats 9] [--scattered] [--out bench/results/transfer.json]
    python bench/transfer.py --tp [--repeats 9] [--out bench/results/transfer_tp.json]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.transfer import (KVLayout, KVSender, block_runs, create_transfer,  # noqa: E402
                             plan_head_slice_writes)

LAYOUT = dict(num_layers=8, block_size=16, num_kv_heads=4, head_dim=64)
NUM_TOKENS = 4096
PIECE = 4 << 20
# Mooncake's TCP transport moves a transfer through asio's async_write / async_read, which
# issue one send / recv per 64 KiB at most: `tcp-64k` is raw TCP at that syscall size.
ASIO_PIECE = 64 << 10


def kv_shape(num_blocks: int, num_kv_heads: int = LAYOUT["num_kv_heads"]) -> tuple[int, ...]:
    return (LAYOUT["num_layers"], 2, num_blocks, LAYOUT["block_size"], num_kv_heads, LAYOUT["head_dim"])


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all threads (10 ms ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serve(backend: str, num_blocks: int, piece: int, num_kv_heads: int) -> None:
    """Receiver process: prints one JSON line, then answers on stdin `sum` (prints the
    checksum), `zero` (zeroes the cache, prints "ok") and anything else (exits)."""
    kv = torch.zeros(kv_shape(num_blocks, num_kv_heads))
    if backend == "tcp":
        listener = socket.create_server(("127.0.0.1", 0))
        print(json.dumps({"port": listener.getsockname()[1]}), flush=True)
        conn, _ = listener.accept()
        view = memoryview(kv.view(torch.uint8).numpy()).cast("B")
        while True:
            got = 0
            while got < len(view):
                n = conn.recv_into(view[got:], min(piece, len(view) - got))
                if n == 0:
                    print(digest(kv), flush=True)
                    return
                got += n
            conn.sendall(b"k")
    engine = create_transfer(backend)
    layout = KVLayout.of_tensor(kv)
    engine.register(layout.base_address, layout.span_bytes)
    print(json.dumps({"endpoint": engine.endpoint, "layout": asdict(layout)}), flush=True)
    for line in sys.stdin:
        if line.strip() == "sum":
            print(digest(kv), flush=True)
        elif line.strip() == "zero":
            kv.zero_()
            print("ok", flush=True)
        else:
            break
    engine.close()


class Receiver:
    def __init__(self, backend: str, num_blocks: int, env: dict[str, str], piece: int = PIECE,
                 num_kv_heads: int = LAYOUT["num_kv_heads"]):
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", backend, "--num-blocks", str(num_blocks),
             "--piece", str(piece), "--heads", str(num_kv_heads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            env=env)
        self.info = json.loads(self.proc.stdout.readline())

    def ask(self, command: str) -> str:
        """Send one command line (engine receivers: `sum`, `zero`); its one-line answer."""
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    @property
    def layout(self) -> KVLayout:
        info = self.info["layout"]
        return KVLayout(**{**info, "strides": tuple(info["strides"])})

    def finish(self, ask: bool = True) -> str:
        """The receiver's checksum; then it exits."""
        checksum = self.ask("sum") if ask else self.proc.stdout.readline().strip()
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        return checksum


class TcpPath:
    """`piece` bytes per sendall and per recv_into."""

    def __init__(self, src: torch.Tensor, env: dict[str, str], piece: int = PIECE):
        self.piece = piece
        self.receiver = Receiver("tcp", src.shape[2], env, piece)
        self.sock = socket.create_connection(("127.0.0.1", self.receiver.info["port"]))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.payload = memoryview(src.view(torch.uint8).numpy()).cast("B")
        self.expected = digest(src)

    def send(self) -> int:
        for off in range(0, len(self.payload), self.piece):
            self.sock.sendall(self.payload[off:off + self.piece])
        assert self.sock.recv(1) == b"k"
        return len(self.payload)

    def finish(self) -> bool:
        self.sock.close()
        return self.receiver.finish(ask=False) == self.expected


class EnginePath:
    """KVSender pushing all of src's blocks into dst_block_ids of a receiver process."""

    def __init__(self, backend: str, src: torch.Tensor, dst_block_ids: list[int], env: dict[str, str]):
        num_blocks = src.shape[2]
        self.receiver = Receiver(backend, num_blocks, env)
        self.engine = create_transfer(backend)
        local = KVLayout.of_tensor(src)
        self.engine.register(local.base_address, local.span_bytes)
        self.sender = KVSender(self.engine, local)
        self.remote = self.receiver.layout
        self.endpoint = self.receiver.info["endpoint"]
        self.src_ids, self.dst_ids = list(range(num_blocks)), dst_block_ids
        expected = torch.zeros_like(src)
        expected[:, :, dst_block_ids] = src
        self.expected = digest(expected)

    def send(self) -> int:
        return self.sender.send_blocks(self.endpoint, self.remote, self.src_ids, self.dst_ids)

    def finish(self) -> bool:
        ok = self.receiver.finish() == self.expected
        self.engine.close()
        return ok


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--backends", default="mooncake,grpc")
    ap.add_argument("--scattered", action="store_true",
                    help="also push into shuffled destination blocks (one write per block)")
    ap.add_argument("--tp", action="store_true",
                    help="push across tensor-parallel sizes instead (mooncake; module docstring)")
    ap.add_argument("--out", help="default bench/results/transfer.json, with --tp transfer_tp.json")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--num-blocks", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--piece", type=int, default=PIECE, help=argparse.SUPPRESS)
    ap.add_argument("--heads", type=int, default=LAYOUT["num_kv_heads"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.num_blocks, args.piece, args.heads)
        return

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args.out = args.out or str(ROOT / "bench/results" / ("transfer_tp.json" if args.tp else "transfer.json"))
    if args.tp:
        tp_main(args, env)
        return
    num_blocks = NUM_TOKENS // LAYOUT["block_size"]
    torch.manual_seed(0)
    src = torch.randn(kv_shape(num_blocks))
    nbytes = src.numel() * src.element_size()
    paths = {"tcp": TcpPath(src, env), "tcp-64k": TcpPath(src, env, piece=ASIO_PIECE)}
    scattered = list(range(num_blocks))
    random.Random(0).shuffle(scattered)
    for backend in args.backends.split(","):
        paths[backend] = EnginePath(backend, src, list(range(num_blocks)), env)
        if args.scattered:
            paths[f"{backend}-scattered"] = EnginePath(backend, src, scattered, env)
    times: dict[str, list[float]] = {name: [] for name in paths}
    cpu = {name: [0.0, 0.0] for name in paths}
    for rep in range(args.repeats + 1):
        for name, path in paths.items():
            cpu_start = (time.process_time(), process_cpu_s(path.receiver.proc.pid))
            start = time.perf_counter()
            assert path.send() == nbytes
            if rep:
                times[name].append(time.perf_counter() - start)
                cpu[name][0] += time.process_time() - cpu_start[0]
                cpu[name][1] += process_cpu_s(path.receiver.proc.pid) - cpu_start[1]
    checks = {name: path.finish() for name, path in paths.items()}

    def ratio(base: str, ts: list[float]) -> float:
        return round(statistics.median(t / b for t, b in zip(times[base], ts)), 3)

    def summary(name: str) -> dict:
        ts = times[name]
        return {"gb_per_s": round(nbytes / statistics.median(ts) / 1e9, 3),
                "ratio_to_tcp": ratio("tcp", ts),
                "ratio_to_tcp_64k": ratio("tcp-64k", ts),
                "median_ms": round(statistics.median(ts) * 1e3, 2),
                "runs_ms": [round(t * 1e3, 2) for t in ts], "bytes_match": checks[name],
                "cpu_ms_per_push": {"sender": round(cpu[name][0] / len(ts) * 1e3, 1),
                                    "receiver": round(cpu[name][1] / len(ts) * 1e3, 1)}}

    results = {
        "payload": {**LAYOUT, "dtype": "float32", "num_tokens": NUM_TOKENS, "num_blocks": num_blocks,
                    "bytes": nbytes, "writes_per_batch": 2 * LAYOUT["num_layers"],
                    "writes_per_batch_scattered":
                        2 * LAYOUT["num_layers"] * len(block_runs(range(num_blocks), scattered))},
        "repeats": args.repeats,
        "ratio_to_tcp": "median over repeats of tcp_time / time, each pair timed back to back",
        "results": {name: summary(name) for name in times},
        "env": {k: v for k, v in os.environ.items() if k.startswith("MC_")},
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                    "load_avg": os.getloadavg()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"KV push, {nbytes / 2**20:.0f} MiB ({num_blocks} blocks, {NUM_TOKENS} tokens), "
          f"median of {args.repeats}:")
    for name, r in results["results"].items():
        print(f"  {name:18s} {r['gb_per_s']:6.3f} GB/s  {r['ratio_to_tcp']:5.2f}x raw TCP "
              f"({r['ratio_to_tcp_64k']:4.2f}x at 64 KiB)  "
              f"CPU ms/push sender {r['cpu_ms_per_push']['sender']:6.1f} receiver "
              f"{r['cpu_ms_per_push']['receiver']:6.1f}  bytes match: {r['bytes_match']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
