"""The decode node's RemotePrefill against a real PrefillServicer (one process, real gRPC,
the fake transfer holding KV writes in flight): a cancel whose writes cannot be confirmed
stopped keeps the destination blocks QUARANTINED, never handed to another request, until
the prefill node confirms (the late write lands in the quarantined blocks only) or is
gone (its port refuses connections) for 2 x timeouts.transfer_s; a full prefill node answers RESOURCE_EXHAUSTED at
once and the decode node prefills locally, without waiting for room there; a prefill whose
cancel overtook it is refused."""
from __future__ import annotations

import asyncio
import logging
import random
import time

import grpc
import pytest
import torch

from common.engine import SamplingParams
from tests.prefill_pair import FAST, PrefillPair

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
HANG_GUARD_S = 30.0     # a wait's bound: only catches a hang, never a slow host


def prompt(seed: int, n: int = 60) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def reference(model, llm_factory):
    """Expected tokens, from an engine with no prefix cache: nothing an earlier test cached
    (or a fake prefill node registered without writing its KV) can change them."""
    return llm_factory(model, max_model_len=256, enable_prefix_caching=False)


def expect(reference, p, params):
    return reference.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids


async def wait_for(predicate, timeout_s: float = HANG_GUARD_S, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def quarantined(pair) -> int:
    return (await pair.decode.stats())["quarantined_blocks"]


async def start_held_remote(pair, rid: str, p: list[int]):
    """A remote prefill of p whose first KV write is held in flight; returns (task, blocks)."""
    pair.prefill_transfer.hold()
    remote = pair.remote(rid, p, GREEDY)
    task = asyncio.ensure_future(pair_collect(pair, rid, p, GREEDY, remote))
    await wait_for(lambda: _true(pair.prefill_transfer.num_held >= 1), what="a held write")
    blocks = list(pair.decode_engine.scheduler.remote[rid].block_ids)
    return task, blocks


async def leave_with_a_write_in_flight(pair, rid: str, p: list[int]) -> list[int]:
    """Start a remote prefill of p, hold its first write in flight, then leave the request
    (the client cancels): the cancel cannot be confirmed, so its blocks are quarantined."""
    task, blocks = await start_held_remote(pair, rid, p)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await quarantined(pair) == len(blocks)
    return blocks


async def _true(value: bool) -> bool:
    return value


async def pair_collect(pair, rid, p, params, remote=None) -> list[int]:
    return [t async for out in pair.decode.generate(rid, p, params, remote=remote) for t in out.new_token_ids]


def test_blocks_stay_quarantined_until_the_dead_prefill_node_plus_the_transfer_timeout(model, reference, caplog):
    a, b = prompt(1), prompt(2)
    want_b = expect(reference, b, GREEDY)

    async def scenario():
        pair = await PrefillPair(model, decode_blocks=16).start()
        try:
            blocks = await leave_with_a_write_in_flight(pair, "a", a)
            got_b = await pair_collect(pair, "b", b, GREEDY)   # runs meanwhile, elsewhere
            bm = pair.decode_engine.block_manager
            assert all(bm.blocks[i].ref_count == 1 and i not in bm.free_queue for i in blocks)
            await asyncio.sleep(2 * FAST.transfer_s)
            assert await quarantined(pair) == len(blocks)      # alive, unconfirmed: still held
            await pair.kill_prefill()           # its held write is dropped, never lands
            dead_at = time.monotonic()
            await wait_for(lambda: _eq(quarantined(pair), 0), what="the quarantine to end")
            return got_b, time.monotonic() - dead_at, pair
        finally:
            await pair.close()

    with caplog.at_level(logging.WARNING, logger="pdmesh.decode"):
        got_b, freed_after, pair = asyncio.run(scenario())
    print(f"freed {freed_after:.2f} s after the prefill node died (transfer_bound_s {FAST.transfer_bound_s} s)")
    assert got_b == want_b
    assert freed_after >= FAST.transfer_bound_s          # never before a late write could still land
    # freed because its port refused for transfer_bound_s, not at the request's deadline
    assert "prefill node prefill-0 is gone: freeing the blocks of a" in caplog.text
    assert pair.decode_engine.stats()["used_blocks"] == 0


async def _eq(coro, value) -> bool:
    return await coro == value


def test_a_late_write_lands_only_in_quarantined_blocks_then_they_are_freed(model, reference):
    a, b = prompt(3), prompt(4)
    want_b = expect(reference, b, LONG)

    async def scenario():
        pair = await PrefillPair(model, decode_blocks=32).start()
        try:
            blocks = await leave_with_a_write_in_flight(pair, "a", a)
            before = pair.decode_engine.kv_cache[:, :, blocks].clone()
            running_b = asyncio.ensure_future(pair_collect(pair, "b", b, LONG))
            await wait_for(lambda: _true(pair.decode_engine.scheduler.find("b") is not None
                                         and pair.decode_engine.scheduler.find("b").num_output_tokens > 5),
                           what="b decoding")
            b_blocks = set(pair.decode_engine.scheduler.find("b").block_ids)
            assert not b_blocks & set(blocks)
            pair.prefill_transfer.release_held()              # the late write lands now
            got_b = await running_b
            await wait_for(lambda: _eq(quarantined(pair), 0), what="the prefill node's confirmation")
            after = pair.decode_engine.kv_cache[:, :, blocks].clone()
            return got_b, before, after
        finally:
            await pair.close()

    got_b, before, after = asyncio.run(scenario())
    assert got_b == want_b                     # b's blocks were never written by it
    assert not torch.equal(before, after)      # the late write did land: in the quarantined blocks


def test_a_full_prefill_node_is_refused_at_once_and_the_decode_node_prefills_locally(model, reference):
    """The prefill node has 8 blocks; the first request's push is held, so its blocks stay
    held and the second waits for blocks: with max_queue 1 the third is refused."""
    first, second, third = prompt(5, 100), prompt(6, 100), prompt(7, 40)
    want_third = expect(reference, third, GREEDY)

    async def scenario():
        pair = await PrefillPair(model, prefill_blocks=8, max_queue=1).start()
        started: dict[str, float] = {}
        fallback: dict[str, float] = {}
        at_fallback: dict[str, tuple[int, int]] = {}
        fail_remote = pair.decode_engine.fail_remote

        def record_fallback(request_id, writer_settled):
            fallback[request_id] = time.monotonic()
            # what still occupies the prefill node: the first's held write, the second queued
            at_fallback[request_id] = (pair.prefill_transfer.num_held, pair.prefill_node.engine.num_waiting())
            assert writer_settled, "a refused prefill wrote nothing"
            return fail_remote(request_id, writer_settled)

        pair.decode_engine.fail_remote = record_fallback
        try:
            # One after the other: sent together, the second can reach the prefill node while
            # the first still waits there, and max_queue 1 refuses it instead of the third.
            first_task, _ = await start_held_remote(pair, "first", first)
            second_task = asyncio.ensure_future(pair_collect(pair, "second", second, GREEDY,
                                                             pair.remote("second", second, GREEDY)))
            held = [first_task, second_task]
            await wait_for(lambda: _true(pair.prefill_node.engine.num_waiting() == 1), what="a queued prefill")
            remote = pair.remote("third", third, GREEDY)
            fill = remote.fill

            async def timed_fill(block_ids, cached):
                started["third"] = time.monotonic()
                return await fill(block_ids, cached)

            remote.fill = timed_fill
            got = await pair_collect(pair, "third", third, GREEDY, remote)
            pair.prefill_transfer.release_held()
            await asyncio.gather(*held)
            return got, fallback["third"] - started["third"], remote.num_refused, at_fallback["third"]
        finally:
            await pair.close()

    got, delay, refused, occupied = asyncio.run(scenario())
    print(f"fell back {delay * 1e3:.0f} ms after the prefill call")
    assert got == want_third and refused == 1
    assert occupied[0] >= 1 and occupied[1] == 1   # refused while the node was still full: no wait for room


def test_a_prefill_whose_cancel_arrived_first_is_refused(model):
    from protos.pdmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
    from services.decode.remote_prefill import answered_settled

    async def scenario():
        pair = await PrefillPair(model).start()
        try:
            stub = engine_pb2_grpc.PrefillStub(pair._channel(pair.address))
            cancel = await stub.CancelPrefill(engine_pb2.CancelPrefillRequest(request_id="late"))
            assert (cancel.was_running, cancel.settled) == (False, True)
            dest = engine_pb2.KVDestination(node_id="decode-0", transfer_endpoint=pair.decode_transfer.endpoint,
                                            layout=pair.decode_node.layout.to_proto(), block_ids=[0, 1])
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Prefill(engine_pb2.PrefillRequest(
                    request_id="late", prompt_token_ids=prompt(8, 20), destination=dest,
                    sampling=common_pb2.SamplingParams(max_tokens=1)))
            assert err.value.code() == grpc.StatusCode.CANCELLED and answered_settled(err.value)
            assert pair.decode_transfer.num_bytes == 0 and pair.prefill_transfer.num_writes == 0
        finally:
            await pair.close()

    asyncio.run(scenario())


def test_a_stopped_prefill_node_keeps_the_blocks_quarantined_past_any_lease_until_it_confirms(model, reference):
    """SIGSTOP of a prefill node mid-push: its lease lapses (the decode node no longer asks
    the membership), but the process still listens and resumes its write calls when
    continued. The blocks must not be freed (and reused by b) after a time: only once the
    resumed node confirms its writes ended."""
    a, b = prompt(12), prompt(13)
    want_b = expect(reference, b, LONG)

    async def scenario():
        pair = await PrefillPair(model, decode_blocks=16).start()
        try:
            blocks = await leave_with_a_write_in_flight(pair, "a", a)
            await asyncio.sleep(3 * FAST.transfer_bound_s)
            assert await quarantined(pair) == len(blocks)     # still: it may resume writing
            running_b = asyncio.ensure_future(pair_collect(pair, "b", b, LONG))
            await wait_for(lambda: _true(pair.decode_engine.scheduler.find("b") is not None
                                         and pair.decode_engine.scheduler.find("b").num_output_tokens > 5),
                           what="b decoding")
            assert not set(pair.decode_engine.scheduler.find("b").block_ids) & set(blocks)
            pair.prefill_transfer.release_held()             # continued: the late write lands
            got_b = await running_b
            await wait_for(lambda: _eq(quarantined(pair), 0), what="the prefill node's confirmation")
            return got_b
        finally:
            await pair.close()

    assert asyncio.run(scenario()) == want_b
