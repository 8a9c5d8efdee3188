"""common/cluster over a real etcd (tests/etcd_server.py): membership, member view, admin
store and leader election, including etcd dying and coming back on the same data dir.

Nothing here asserts how fast: a wait fails only past HANG_GUARD_S (a hang) and prints what
it took. Leaving at once rather than by expiry shows as the lease gone (revoked) as soon as
close() or resign() returns."""
from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("aetcd")

from common.cluster import ChangeKind, StoreUnavailableError  # noqa: E402
from common.cluster.etcd import EtcdCluster, EtcdConfig  # noqa: E402
from tests.etcd_server import etcd_server, loop, run, wait_until  # noqa: E402,F401  (fixtures)

TTL = 2
NODES = [("prefill", "prefill-0"), ("prefill", "prefill-1"), ("decode", "decode-0"), ("decode", "decode-1")]
HANG_GUARD_S = 30.0    # only catches a hang: a loaded machine is slower, never this slow


def config(server, cluster="test") -> EtcdConfig:
    return EtcdConfig(endpoint=server.endpoint, cluster=cluster, timeout_s=1.0, retry_max_s=0.5)


async def start_nodes(cluster, nodes=NODES):
    members = []
    for role, node_id in nodes:
        member = cluster.membership()
        await member.start(role, node_id, node_id.encode(), ttl_s=TTL)
        members.append(member)
    return members


def expected(nodes=NODES, **values) -> dict:
    return {(r, n): values.get(n.replace("-", "_"), n.encode()) for r, n in nodes}


async def lease_alive(cluster, lease_id: int) -> bool:
    """Whether etcd still holds the lease (a revoked or expired one answers TTL -1)."""
    return (await cluster.client.get_lease_info(lease_id, keys=False)).TTL > 0


async def eventually(predicate, what: str) -> None:
    """wait_until with the hang guard as its bound; prints the seconds taken."""
    took = await wait_until(predicate, HANG_GUARD_S, what)
    print(f"{what}: {took:.2f}s")


def test_members_register_update_and_leave(etcd_server, run):
    async def scenario():
        async with EtcdCluster(config(etcd_server)) as cluster:
            changes = []
            view = cluster.member_view(on_change=changes.append)
            await view.start()
            members = await start_nodes(cluster)
            await eventually(lambda: view.members() == expected(), "4 members in the view")
            assert [(c.kind, c.node_id) for c in changes] == [(ChangeKind.ADDED, n) for _, n in NODES]

            assert await members[2].update(b"busy")
            await eventually(lambda: view.members()[("decode", "decode-0")] == b"busy", "update")
            assert changes[-1].kind == ChangeKind.UPDATED and changes[-1].value == b"busy"

            lease = members[0].lease_id
            assert await lease_alive(cluster, lease)
            await members[0].close()      # revokes: gone at once, not after the TTL
            assert not await lease_alive(cluster, lease)
            await eventually(lambda: ("prefill", "prefill-0") not in view.members(), "close")
            assert (changes[-1].kind, changes[-1].node_id, changes[-1].value) == \
                (ChangeKind.REMOVED, "prefill-0", b"prefill-0")
            for member in members[1:]:
                await member.close()
            await eventually(lambda: not view.members(), "empty view")
            assert (view.num_lists, view.num_watches) == (1, 1)
            await view.close()
    run(scenario)


def test_dead_member_disappears_when_its_lease_expires(etcd_server, run):
    async def scenario():
        async with EtcdCluster(config(etcd_server)) as cluster:
            view = cluster.member_view()
            await view.start()
            members = await start_nodes(cluster)
            await eventually(lambda: len(view.members()) == 4, "4 members")
            await members[3].abandon()    # the process died: no refresh, no revoke
            await eventually(lambda: ("decode", "decode-1") not in view.members(),
                             f"dead member removed (ttl {TTL}s)")
            assert view.members() == expected(NODES[:3])
            for member in members[:3]:
                await member.close()
            await view.close()
    run(scenario)


def test_member_registers_again_after_losing_its_lease(etcd_server, run):
    async def scenario():
        async with EtcdCluster(config(etcd_server)) as cluster, \
                EtcdCluster(config(etcd_server)) as other:
            changes = []
            view = cluster.member_view(on_change=changes.append)
            await view.start()
            [member] = await start_nodes(cluster, NODES[:1])
            await other.client.revoke_lease(member.lease_id)   # as if it expired meanwhile
            await eventually(lambda: member.num_registrations == 2 and len(view.members()) == 1,
                             "registered again")
            assert [c.kind for c in changes] == [ChangeKind.ADDED, ChangeKind.REMOVED, ChangeKind.ADDED]
            await member.close()
            await view.close()
    run(scenario)


def test_etcd_restart_keeps_view_and_recovers(etcd_server, run):
    async def scenario():
        async with EtcdCluster(config(etcd_server)) as cluster:
            view = cluster.member_view()
            await view.start()
            members = await start_nodes(cluster)
            admin = cluster.admin_store()
            await admin.put("policy", b"least_load")
            election = cluster.election()
            await election.campaign("meta-0", ttl_s=TTL)
            assert election.is_leader
            await eventually(lambda: len(view.members()) == 4, "4 members")

            etcd_server.stop()
            down_since = time.monotonic()
            while time.monotonic() - down_since < 6.0:     # served unchanged, nothing raises
                assert view.members() == expected()
                await asyncio.sleep(0.25)
            assert not await members[0].update(b"updated while down")
            with pytest.raises(StoreUnavailableError):
                await admin.get("policy")
            assert not election.is_leader                   # lease unconfirmed for > TTL ...
            assert election.was_leader                      # ... but etcd is down: no one else leads

            etcd_server.start()
            restarted = time.monotonic()
            want = expected(prefill_0=b"updated while down")
            await eventually(lambda: view.members() == want, "view current after the restart")
            assert await admin.get("policy") == b"least_load"
            assert await election.wait_leader(HANG_GUARD_S) and await election.leader() == "meta-0"
            assert not election.was_leader                  # etcd answers again
            print(f"leader again {time.monotonic() - restarted:.2f}s after the restart")

            [late] = await start_nodes(cluster, [("decode", "decode-9")])
            await eventually(lambda: ("decode", "decode-9") in view.members(), "new member")
            assert view.num_lists == 1 and view.num_watches >= 2     # re-watched, not re-listed
            await asyncio.sleep(TTL + 0.5)                           # every lease kept alive again
            assert view.members() == {**want, ("decode", "decode-9"): b"decode-9"}
            assert all(not m._task.done() for m in members) and not view._task.done()
            for member in members + [late]:
                await member.close()
            await election.resign()
            await view.close()
    run(scenario)


def test_start_while_etcd_is_down(etcd_server, run):
    etcd_server.stop()

    async def scenario():
        async with EtcdCluster(config(etcd_server)) as cluster:
            view = cluster.member_view()
            await view.start()
            [member] = await start_nodes(cluster, NODES[:1])
            election = cluster.election()
            await election.campaign("meta-0", ttl_s=TTL)
            assert view.members() == {} and not member.registered and not election.is_leader
            etcd_server.start()
            await eventually(lambda: view.members() == expected(NODES[:1]), "registered and seen after etcd came up")
            assert await election.wait_leader(HANG_GUARD_S)
            await member.close()
            await election.resign()
            await view.close()
    run(scenario)


def test_compacted_revision_lists_again(etcd_server, run):
    async def scenario():
        async with EtcdCluster(config(etcd_server)) as cluster:
            view = cluster.member_view()
            await view.start()
            members = await start_nodes(cluster, NODES[:2])
            await eventually(lambda: len(view.members()) == 2, "2 members")
            admin = cluster.admin_store()
            for i in range(5):             # revisions the view never sees (not under nodes/)
                await admin.put(f"scratch/{i}", b"x")
            status = await cluster.client.get(b"/pdmesh/test/admin/scratch/4")
            await cluster.client.compact(status.mod_revision)
            assert view.revision < status.mod_revision
            etcd_server.stop()
            await asyncio.sleep(0.3)
            etcd_server.start()
            await eventually(lambda: view.num_lists == 2, "re-listed after compaction")
            assert view.members() == expected(NODES[:2])
            [late] = await start_nodes(cluster, [("decode", "decode-9")])
            await eventually(lambda: len(view.members()) == 3, "watch resumed")
            for member in members + [late]:
                await member.close()
            await view.close()
    run(scenario)


def test_admin_store_survives_a_new_client(etcd_server, run):
    async def scenario():
        async with EtcdCluster(config(etcd_server)) as cluster:
            admin = cluster.admin_store()
            await admin.put("policy", b"cache_aware")
            await admin.put("drained/decode-0", b"")
            await admin.put("drained/decode-1", b"")
            assert await admin.delete("drained/decode-1")
            assert not await admin.delete("drained/decode-1")
            with pytest.raises(ValueError):
                await admin.put("/abs", b"")
        async with EtcdCluster(config(etcd_server)) as fresh:
            admin = fresh.admin_store()
            assert await admin.get("policy") == b"cache_aware"
            assert await admin.get("missing") is None
            assert await admin.list("drained/") == {"drained/decode-0": b""}
            assert await admin.list() == {"drained/decode-0": b"", "policy": b"cache_aware"}
        async with EtcdCluster(config(etcd_server, cluster="other")) as stranger:
            assert await stranger.admin_store().list() == {}
    run(scenario)


def test_leader_election_failover(etcd_server, run):
    async def scenario():
        async with EtcdCluster(config(etcd_server)) as ca, EtcdCluster(config(etcd_server)) as cb, \
                EtcdCluster(config(etcd_server)) as cc:
            seen_b = []
            a, b, c = ca.election(), cb.election(on_change=seen_b.append), cc.election()
            await a.campaign("meta-a", ttl_s=TTL)
            await b.campaign("meta-b", ttl_s=TTL)
            assert a.is_leader and not b.is_leader
            assert await a.leader() == await b.leader() == "meta-a"
            await asyncio.sleep(TTL * 1.2)          # keepalives hold the lead past one TTL
            assert a.is_leader and not b.is_leader

            await a.abandon()                       # the leader dies
            await eventually(lambda: b.is_leader, f"standby leads after the leader's keepalives ended (ttl {TTL}s)")
            assert not a.is_leader and await b.leader() == "meta-b" and seen_b == [True]
            assert not a.was_leader                 # its lease lapsed with etcd up: it must not act

            await c.campaign("meta-c", ttl_s=TTL)
            assert not c.is_leader
            lease = b._lease_id
            assert await lease_alive(cb, lease)
            await b.resign()                        # revoke: the next standby leads at once
            assert not await lease_alive(cb, lease)
            await eventually(lambda: c.is_leader, "next standby leads after resign")
            assert seen_b == [True, False] and await c.leader() == "meta-c"
            await c.resign()
            assert await c.leader() is None
    run(scenario)
