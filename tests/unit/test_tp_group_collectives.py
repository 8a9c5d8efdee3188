"""TPGroup's all_gather and all_to_all (the MoE all_to_all dispatch: common/model/layers/
moe_dispatch.py) between two real gloo ranks, with uneven and zero row counts: every row
arrives where and in the order the contract says."""
from __future__ import annotations

import multiprocessing as mp

import torch

from common.parallel.group import TPGroup, make_store
from services.node.grpc_util import free_port

# rows rank r sends to rank j: SENDS[r][j]; a row's value encodes (sender, receiver, index)
SENDS = [[2, 0], [3, 1]]


def rows(sender: int, receiver: int) -> torch.Tensor:
    n = SENDS[sender][receiver]
    return torch.tensor([[100 * sender + 10 * receiver + i, -1.0] for i in range(n)]).reshape(n, 2)


def rank_main(rank: int, port: int, out: mp.Queue) -> None:
    group = TPGroup(make_store(rank, 2, port), rank, 2, "cpu", timeout_s=30)
    send = torch.cat([rows(rank, 0), rows(rank, 1)])
    received = group.all_to_all(send, [SENDS[0][rank], SENDS[1][rank]], SENDS[rank])
    gathered = group.all_gather(torch.full((2, 3), float(rank)))
    out.put((rank, received.tolist(), gathered.tolist()))


def test_all_to_all_and_all_gather_between_two_ranks():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, port, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = dict((rank, (received, gathered)) for rank, received, gathered in (out.get(timeout=60) for _ in procs))
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    for rank in (0, 1):
        received, gathered = results[rank]
        assert received == torch.cat([rows(0, rank), rows(1, rank)]).tolist()    # from rank 0 first, then rank 1
        assert gathered == [[0.0] * 3] * 2 + [[1.0] * 3] * 2
    assert len(results[0][0]) == 5 and len(results[1][0]) == 1                   # 2 + 3 rows, and 0 + 1
