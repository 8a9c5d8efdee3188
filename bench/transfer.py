"""KV push bandwidth: `mooncake` and `grpc` against raw loopback TCP, same run, alternating.

Payload: a 4,096-token prompt's KV in the bench model's layout (8 layers, 4 KV heads,
head_dim 64, float32, block_size 16): 256 blocks, 64 MiB, sent by KVSender as one batch of
16 writes (layer x K/V, one run each) from this process into a receiver process's KV cache.
Raw TCP sends the same bytes with `sendall` (4 MiB pieces) into a preallocated buffer that
the receiver fills with `recv_into`, then acks one byte. Every timing ends with the ack.
After the runs each receiver's checksum is compared with the sender's.

    python bench/transfer.py [--repeats 7] [--out bench/results/transfer.json]
"""
from __future__ import annotations

import argparse
from dataclasses import asdict
import hashlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.transfer import KVLayout, KVSender, create_transfer  # noqa: E402

LAYOUT = dict(num_layers=8, block_size=16, num_kv_heads=4, head_dim=64)
NUM_TOKENS = 4096
PIECE = 4 << 20


def kv_shape(num_blocks: int) -> tuple[int, ...]:
    return (LAYOUT["num_layers"], 2, num_blocks, LAYOUT["block_size"], LAYOUT["num_kv_heads"],
            LAYOUT["head_dim"])


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def serve(backend: str, num_blocks: int) -> None:
    """Receiver process: prints one JSON line, then answers `sum` and `exit` on stdin."""
    kv = torch.zeros(kv_shape(num_blocks))
    if backend == "tcp":
        listener = socket.create_server(("127.0.0.1", 0))
        print(json.dumps({"port": listener.getsockname()[1]}), flush=True)
        conn, _ = listener.accept()
        view = memoryview(kv.view(torch.uint8).numpy()).cast("B")
        while True:
            got = 0
            while got < len(view):
                n = conn.recv_into(view[got:], min(PIECE, len(view) - got))
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
        else:
            break
    engine.close()


class Receiver:
    def __init__(self, backend: str, num_blocks: int, env: dict[str, str]):
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", backend, "--num-blocks", str(num_blocks)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            env=env)
        self.info = json.loads(self.proc.stdout.readline())

    def checksum(self) -> str:
        self.proc.stdin.write("sum\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


def make_runners(src: torch.Tensor, backends: list[str], env: dict[str, str]):
    """{name: (send() -> bytes, receiver, close)} for raw TCP and each backend."""
    num_blocks = src.shape[2]
    runners = {}
    tcp = Receiver("tcp", num_blocks, env)
    sock = socket.create_connection(("127.0.0.1", tcp.info["port"]))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = memoryview(src.view(torch.uint8).numpy()).cast("B")

    def send_tcp() -> int:
        for off in range(0, len(payload), PIECE):
            sock.sendall(payload[off:off + PIECE])
        assert sock.recv(1) == b"k"
        return len(payload)

    def close_tcp() -> None:
        sock.close()
        tcp.checksum_after_close = tcp.proc.stdout.readline().strip()
        tcp.close()

    runners["tcp"] = (send_tcp, tcp, close_tcp)
    local = KVLayout.of_tensor(src)
    for backend in backends:
        receiver = Receiver(backend, num_blocks, env)
        engine = create_transfer(backend)
        engine.register(local.base_address, local.span_bytes)
        sender = KVSender(engine, local)
        remote = KVLayout(**{**receiver.info["layout"], "strides": tuple(receiver.info["layout"]["strides"])})
        ids = list(range(num_blocks))

        def send(sender=sender, endpoint=receiver.info["endpoint"], remote=remote, ids=ids) -> int:
            return sender.send_blocks(endpoint, remote, ids, ids)

        def close(engine=engine, receiver=receiver) -> None:
            receiver.close()
            engine.close()

        runners[backend] = (send, receiver, close)
    return runners


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--backends", default="mooncake,grpc")
    ap.add_argument("--out", default=str(ROOT / "bench/results/transfer.json"))
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--num-blocks", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.num_blocks)
        return

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    num_blocks = NUM_TOKENS // LAYOUT["block_size"]
    torch.manual_seed(0)
    src = torch.randn(kv_shape(num_blocks))
    nbytes = src.numel() * src.element_size()
    runners = make_runners(src, args.backends.split(","), env)
    times: dict[str, list[float]] = {name: [] for name in runners}
    for rep in range(args.repeats + 1):
        for name, (send, _, _) in runners.items():
            start = time.perf_counter()
            assert send() == nbytes
            if rep:
                times[name].append(time.perf_counter() - start)
    want = digest(src)
    checks = {name: r.checksum() == want for name, (_, r, _) in runners.items() if name != "tcp"}
    for _, _, close in runners.values():
        close()
    checks["tcp"] = runners["tcp"][1].checksum_after_close == want

    gbps = {name: nbytes / statistics.median(ts) / 1e9 for name, ts in times.items()}
    results = {
        "payload": {**LAYOUT, "dtype": "float32", "num_tokens": NUM_TOKENS, "num_blocks": num_blocks,
                    "bytes": nbytes, "writes_per_batch": 2 * LAYOUT["num_layers"]},
        "repeats": args.repeats,
        "results": {name: {"gb_per_s": round(gbps[name], 3), "ratio_to_tcp": round(gbps[name] / gbps["tcp"], 3),
                           "median_ms": round(statistics.median(ts) * 1e3, 2),
                           "runs_ms": [round(t * 1e3, 2) for t in ts], "bytes_match": checks[name]}
                    for name, ts in times.items()},
        "env": {k: v for k, v in os.environ.items() if k.startswith("MC_")},
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                    "load_avg": os.getloadavg()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"KV push, {nbytes / 2**20:.0f} MiB ({num_blocks} blocks, {NUM_TOKENS} tokens), "
          f"median of {args.repeats}:")
    for name, r in results["results"].items():
        print(f"  {name:9s} {r['gb_per_s']:6.3f} GB/s  {r['ratio_to_tcp']:5.2f}x raw TCP  "
              f"bytes match: {r['bytes_match']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
