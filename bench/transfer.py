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

`--tp` instead pushes the same prompt's KV across tensor-parallel sizes (bench/transfer_tp.py);
`--latent` pushes an MLA latent cache from two prefill ranks into two decode ranks, each
decode rank's copy from its own prefill rank or both from one (bench/transfer_latent.py).

    python bench/transfer.py [--repeats 9] [--scattered] [--out bench/results/transfer.json]
    python bench/transfer.py --tp [--repeats 9] [--out bench/results/transfer_tp.json]
    python bench/transfer.py --latent [--repeats 9] [--out bench/results/transfer_latent.json]
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
from dataclasses import asdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.kv_layout import KVLayout  # noqa: E402
from common.transfer import KVSender, block_runs, create_transfer  # noqa: E402

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


def latent_shape(num_blocks: int, width: int) -> tuple[int, ...]:
    """MLA's one-plane latent cache of LAYOUT's layers and block size (rows `width` wide)."""
    return (LAYOUT["num_layers"], 1, num_blocks, LAYOUT["block_size"], 1, width)


def serve(backend: str, num_blocks: int, piece: int, num_kv_heads: int, latent_width: int = 0) -> None:
    """Receiver process: prints one JSON line, then answers on stdin `sum` (prints the
    checksum), `zero` (zeroes the cache, prints "ok") and anything else (exits).
    latent_width > 0: an MLA latent cache (latent_shape) instead of K/V heads."""
    kv = torch.zeros(latent_shape(num_blocks, latent_width) if latent_width else kv_shape(num_blocks, num_kv_heads))
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
                 num_kv_heads: int = LAYOUT["num_kv_heads"], latent_width: int = 0):
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", backend, "--num-blocks", str(num_blocks),
             "--piece", str(piece), "--heads", str(num_kv_heads), "--latent-width", str(latent_width)],
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--backends", default="mooncake,grpc")
    ap.add_argument("--scattered", action="store_true",
                    help="also push into shuffled destination blocks (one write per block)")
    ap.add_argument("--tp", action="store_true",
                    help="push across tensor-parallel sizes instead (mooncake; module docstring)")
    ap.add_argument("--latent", action="store_true",
                    help="MLA's latent push from two prefill ranks into two decode ranks: spread or one writer "
                         "(mooncake; bench/transfer_latent.py)")
    ap.add_argument("--out", help="default bench/results/transfer.json, with --tp transfer_tp.json, "
                                  "with --latent transfer_latent.json")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--num-blocks", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--piece", type=int, default=PIECE, help=argparse.SUPPRESS)
    ap.add_argument("--heads", type=int, default=LAYOUT["num_kv_heads"], help=argparse.SUPPRESS)
    ap.add_argument("--latent-width", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.num_blocks, args.piece, args.heads, args.latent_width)
        return

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    name = "transfer_tp" if args.tp else "transfer_latent" if args.latent else "transfer"
    args.out = args.out or str(ROOT / "bench/results" / f"{name}.json")
    if args.tp:
        from transfer_tp import tp_main
        tp_main(args, env)
        return
    if args.latent:
        from transfer_latent import latent_main
        latent_main(args, env)
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
