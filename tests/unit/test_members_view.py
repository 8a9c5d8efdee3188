"""services/node/members_view.py: which list a lookup answers from, how often the source
is asked (single flight, spaced), and what happens while the meta-server is away; plus
ListMembers over real gRPC from a real meta-server."""
from __future__ import annotations

import asyncio

import pytest

from common.config import MetaConfig
from protos.pdmesh.v1 import common_pb2, meta_pb2, meta_pb2_grpc
from services.meta_server.server import create_server
from services.node.members_view import MembersUnavailable, MembersView, MetaMembers
from tests.channels import operator_channel


def info(node_id: str, role: str = "decode") -> common_pb2.NodeInfo:
    return common_pb2.NodeInfo(node_id=node_id, role=role, address=f"127.0.0.1:{1000 + len(node_id)}")


class Source:
    """Answers `members` (after `delay_s`), or raises while `down`; counts its calls."""

    def __init__(self, members):
        self.members, self.calls, self.down, self.delay_s = list(members), 0, False, 0.0

    async def __call__(self):
        self.calls += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.down:
            raise ConnectionError("meta-server away")
        return list(self.members)


def by_id(node_id: str):
    return lambda m: m.node_id == node_id


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_hit_is_answered_from_the_cache_until_max_age():
    async def body():
        source, clock = Source([info("d0")]), Clock()
        view = MembersView(source, max_age_s=1.0, max_stale_s=3.0, min_interval_s=0.0, clock=clock)
        assert (await view.find(by_id("d0"))).node_id == "d0"
        assert source.calls == 1
        clock.now += 0.4
        assert (await view.find(by_id("d0"))).node_id == "d0"
        await asyncio.sleep(0)
        assert source.calls == 1                      # young enough: no fetch
        clock.now += 0.7
        source.members = []                           # d0 left
        assert await view.find(by_id("d0")) is None   # past max_age: fetched again first
        assert source.calls == 2
    asyncio.run(body())


def test_a_hit_on_an_aging_list_refreshes_it_in_the_background():
    async def body():
        source, clock = Source([info("d0")]), Clock()
        view = MembersView(source, max_age_s=1.0, max_stale_s=3.0, min_interval_s=0.0, clock=clock)
        await view.find(by_id("d0"))
        clock.now += 0.6                              # older than max_age / 2
        source.delay_s = 0.05
        assert (await view.find(by_id("d0"))).node_id == "d0"   # answered at once ...
        assert source.calls == 1
        await asyncio.sleep(0.1)                      # ... while the list is fetched behind it
        assert source.calls == 2
        clock.now += 0.6                              # 1.2 s after the first fetch, 0.6 after the second
        source.delay_s = 10.0                         # a fetch now would time the test out
        assert (await view.find(by_id("d0"))).node_id == "d0"
        await asyncio.sleep(0)
        assert source.calls == 3                      # the next refresh started, not awaited
        await view.close()
    asyncio.run(body())


def test_kept_fresh_a_lookup_after_a_quiet_spell_does_not_wait_for_a_fetch():
    """keep_fresh: requests further apart than max_age_s (sparse traffic) still find a
    young list; without it each such lookup waits for ListMembers first."""
    async def body(keep_fresh: bool) -> bool:
        source = Source([info("d0")])
        view = MembersView(source, max_age_s=0.4, max_stale_s=5.0, min_interval_s=0.0, keep_fresh=keep_fresh)
        assert (await view.find(by_id("d0"))).node_id == "d0"
        await asyncio.sleep(1.2)                        # three max_ages without a lookup
        gate = asyncio.Event()
        real = source.__call__

        async def blocked():
            await gate.wait()
            return await real()
        view.source = blocked                          # a fetch now would wait for the gate
        try:
            await asyncio.wait_for(view.find(by_id("d0")), 1.0)
            waited = False
        except asyncio.TimeoutError:
            waited = True
        gate.set()
        fetches = source.calls
        await view.close()
        assert keep_fresh is False or fetches >= 3, f"kept fresh in the background: {fetches} fetches"
        return waited
    assert asyncio.run(body(keep_fresh=True)) is False
    assert asyncio.run(body(keep_fresh=False)) is True


def test_keeping_fresh_stops_when_lookups_stop_and_for_good_once_closed():
    async def body():
        source = Source([info("d0")])
        view = MembersView(source, max_age_s=0.2, max_stale_s=5.0, min_interval_s=0.0, keep_fresh=True,
                           keep_fresh_s=0.3)
        await view.find(by_id("d0"))
        await asyncio.sleep(0.8)                         # lookups stopped 0.3 s in
        quiet = source.calls
        await asyncio.sleep(0.4)
        assert source.calls == quiet and view._keeper is None, "no lookups: no fetches"
        await view.find(by_id("d0"))                     # lookups again: kept fresh again
        assert view._keeper is not None
        await view.close()
        assert view._keeper is None
        await view.find(by_id("d0"))                     # a late lookup after close()
        calls = source.calls
        await asyncio.sleep(0.4)
        assert view._keeper is None and source.calls == calls, "closed: nothing renews the list"
    asyncio.run(body())


def test_kept_fresh_a_failing_meta_server_is_asked_at_most_every_half_max_age():
    async def body():
        source = Source([info("d0")])
        view = MembersView(source, max_age_s=0.2, max_stale_s=5.0, min_interval_s=0.0, keep_fresh=True)
        await view.find(by_id("d0"))
        source.down = True
        before = source.calls
        await asyncio.sleep(1.0)
        await view.close()
        assert source.calls - before <= 1.0 / 0.1 + 1
    asyncio.run(body())


def test_a_miss_fetches_a_list_begun_after_the_call():
    async def body():
        source, clock = Source([info("d0")]), Clock()
        view = MembersView(source, max_age_s=10.0, max_stale_s=10.0, min_interval_s=0.0, clock=clock)
        assert await view.find(by_id("d1")) is None
        assert source.calls == 1
        source.members.append(info("d1"))             # d1 registers, then its request comes
        clock.now += 0.01
        assert (await view.find(by_id("d1"))).node_id == "d1"
        assert source.calls == 2
    asyncio.run(body())


def test_concurrent_misses_share_one_fetch_and_fetches_are_spaced():
    async def body():
        source = Source([info("d0")])
        source.delay_s = 0.05
        view = MembersView(source, max_age_s=10.0, max_stale_s=10.0, min_interval_s=0.2)
        found = await asyncio.gather(*[view.find(by_id(f"x{i}")) for i in range(50)])
        assert found == [None] * 50 and source.calls == 1
        loop = asyncio.get_running_loop()
        start = loop.time()
        assert await view.find(by_id("x")) is None    # a new miss waits for the spacing
        assert source.calls == 2 and loop.time() - start >= 0.2 - 0.08
        # a flood of misses for 0.5 s costs about 0.5 / min_interval_s fetches
        end = loop.time() + 0.5
        while loop.time() < end:
            await asyncio.gather(*[view.find(by_id("forged")) for _ in range(20)])
        assert source.calls <= 2 + 4
    asyncio.run(body())


def test_meta_server_away_hits_from_the_last_list_until_max_stale():
    async def body():
        source, clock = Source([info("d0")]), Clock()
        view = MembersView(source, max_age_s=1.0, max_stale_s=3.0, min_interval_s=0.0, clock=clock)
        await view.find(by_id("d0"))
        source.down = True
        clock.now += 2.0                              # stale, but within max_stale
        assert (await view.find(by_id("d0"))).node_id == "d0"
        with pytest.raises(MembersUnavailable, match="meta-server away"):
            await view.find(by_id("d9"))              # a miss cannot be vouched for
        clock.now += 1.5                              # past max_stale
        with pytest.raises(MembersUnavailable):
            await view.find(by_id("d0"))
        source.down = False
        clock.now += 0.01
        assert (await view.find(by_id("d0"))).node_id == "d0"
    asyncio.run(body())


def test_a_source_that_hangs_is_bounded_by_the_fetch_timeout():
    """The source never answers (within the test): only the fetch timeout can end the find."""
    async def body():
        source = Source([info("d0")])
        source.delay_s = 3600.0
        view = MembersView(source, max_age_s=1.0, max_stale_s=1.0, fetch_timeout_s=0.2)
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(MembersUnavailable, match="did not answer in time"):
            await asyncio.wait_for(view.find(by_id("d0")), 30.0)   # a hang guard only
        print(f"the find gave up after {loop.time() - start:.2f} s (fetch_timeout_s 0.2)")
        await view.close()
    asyncio.run(body())


def test_meta_members_lists_the_registered_nodes_over_grpc():
    async def body():
        server, port = await create_server(MetaConfig(port=0, ttl_seconds=60.0))
        channel = operator_channel(f"127.0.0.1:{port}")
        source = MetaMembers([f"127.0.0.1:{port}"])
        try:
            stub = meta_pb2_grpc.MetaServerStub(channel)
            await stub.Register(meta_pb2.RegisterRequest(node=info("decode-7"), instance_id="a"), timeout=5)
            view = MembersView(source, max_age_s=1.0, max_stale_s=1.0)
            assert (await view.find(by_id("decode-7"))).role == "decode"
            assert await view.find(by_id("decode-8")) is None
        finally:
            await source.close()
            await channel.close()
            await server.stop(None)
            await server.close_extras()
    asyncio.run(body())
