"""common/cluster pure logic, no etcd: key layout, names, TTLs, backoff, view diffs."""
from __future__ import annotations

import logging
import random

import pytest

from common.cluster.base import (ETCD_EXPIRY_CHECK_S, Backoff, ChangeKind, ClusterKeys, MemberChange,
                                 MemberView, RetryLog, diff_members, election_ttl_seconds,
                                 lease_backoff, lease_ttl_seconds, refresh_interval)


def test_key_layout():
    keys = ClusterKeys("prod")
    assert keys.nodes_prefix == "/pdmesh/prod/nodes/"
    assert keys.node_key("decode", "decode-0") == "/pdmesh/prod/nodes/decode/decode-0"
    assert keys.admin_key("drained/decode-0") == "/pdmesh/prod/admin/drained/decode-0"
    assert keys.admin_key("policy") == "/pdmesh/prod/admin/policy"
    assert keys.leader_key == "/pdmesh/prod/leader"
    assert keys.node_key("prefill", "10.0.0.7:50061") == "/pdmesh/prod/nodes/prefill/10.0.0.7:50061"


def test_parse_node_key():
    keys = ClusterKeys("prod")
    assert keys.parse_node_key(b"/pdmesh/prod/nodes/decode/decode-0") == ("decode", "decode-0")
    assert keys.parse_node_key("/pdmesh/prod/nodes/both/n.1") == ("both", "n.1")
    for bad in (b"/pdmesh/prod2/nodes/decode/d", b"/pdmesh/prod/nodes/decode", b"/pdmesh/prod/nodes/decode/d/x",
                b"/pdmesh/prod/nodes//d", b"/pdmesh/prod/admin/policy", b"/pdmesh/prod/nodes/decode/-d"):
        assert keys.parse_node_key(bad) is None, bad


@pytest.mark.parametrize("role,node_id", [("", "d"), ("decode", ""), ("de/code", "d"), ("decode", "a/b"),
                                          ("decode", "-d"), ("decode", "d e")])
def test_bad_names_are_rejected(role, node_id):
    with pytest.raises(ValueError, match="letters, digits"):
        ClusterKeys("prod").node_key(role, node_id)


@pytest.mark.parametrize("name", ["", "/policy", "policy/", "drained//d"])
def test_bad_admin_names_are_rejected(name):
    with pytest.raises(ValueError, match="admin key"):
        ClusterKeys("prod").admin_key(name)


def test_bad_cluster_name():
    with pytest.raises(ValueError, match="cluster"):
        ClusterKeys("a/b")


def test_lease_ttl_rounds_up_to_whole_seconds():
    assert [lease_ttl_seconds(t) for t in (0.2, 1, 1.5, 2.0, 5)] == [1, 1, 2, 2, 5]
    assert refresh_interval(6) == 2.0
    for bad in (0, -1, float("nan")):
        with pytest.raises(ValueError, match="ttl_s"):
            lease_ttl_seconds(bad)


def test_election_lease_lets_a_standby_lead_within_one_membership_ttl():
    assert [election_ttl_seconds(t) for t in (1, 2, 2.5, 3, 4, 5, 10)] == [1, 1, 1, 1, 2, 2, 5]
    for ttl in (2, 2.5, 3, 4, 5, 7, 10, 30):      # worst takeover, with 0.5 s to spare
        assert election_ttl_seconds(ttl) + ETCD_EXPIRY_CHECK_S <= ttl - 0.5
    with pytest.raises(ValueError, match="ttl_s"):
        election_ttl_seconds(0)


def test_backoff_grows_caps_and_resets():
    backoff = Backoff(initial_s=0.1, max_s=1.0, factor=2.0, rng=random.Random(0))
    caps = []
    for _ in range(6):
        caps.append(backoff.peek())
        delay = backoff.next()
        assert caps[-1] / 2 <= delay <= caps[-1]
    assert caps == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    backoff.reset()
    assert backoff.peek() == pytest.approx(0.1)


def test_lease_backoff_retries_within_the_refresh_interval():
    assert lease_backoff(1, 1.0).max_s == pytest.approx(1 / 3)
    assert lease_backoff(6, 1.0).max_s == 1.0
    assert lease_backoff(0.2, 1.0).max_s == 0.1


def test_backoff_validates():
    with pytest.raises(ValueError, match="initial_s"):
        Backoff(initial_s=2.0, max_s=1.0)
    with pytest.raises(ValueError, match="factor"):
        Backoff(factor=0.5)


def test_diff_members_exact_order():
    old = {("decode", "d0"): b"a", ("decode", "d1"): b"b", ("prefill", "p0"): b"c"}
    new = {("decode", "d1"): b"B", ("prefill", "p0"): b"c", ("prefill", "p1"): b"d", ("both", "x"): b"e"}
    assert diff_members(old, new) == [
        MemberChange(ChangeKind.REMOVED, "decode", "d0", b"a"),
        MemberChange(ChangeKind.ADDED, "both", "x", b"e"),
        MemberChange(ChangeKind.UPDATED, "decode", "d1", b"B"),
        MemberChange(ChangeKind.ADDED, "prefill", "p1", b"d"),
    ]
    assert diff_members(new, new) == []


class _View(MemberView):
    async def start(self):
        pass

    async def close(self):
        pass


def test_member_view_state_and_callbacks():
    changes = []
    view = _View(on_change=changes.append)
    view._replace_all({("decode", "d0"): b"a", ("prefill", "p0"): b"b"})
    view._set(("decode", "d0"), b"a")            # put again, same value: a refresh
    view._set(("decode", "d0"), b"a2")
    view._remove(("prefill", "p0"))
    view._remove(("prefill", "p0"))              # unknown: no event
    view._replace_all({("decode", "d0"): b"a2", ("decode", "d1"): b"c"})   # a re-list: changes only
    assert [(c.kind, c.node_id, c.value) for c in changes] == [
        (ChangeKind.ADDED, "d0", b"a"), (ChangeKind.ADDED, "p0", b"b"), (ChangeKind.UPDATED, "d0", b"a"),
        (ChangeKind.UPDATED, "d0", b"a2"), (ChangeKind.REMOVED, "p0", b"b"), (ChangeKind.ADDED, "d1", b"c")]
    snapshot = view.members()
    snapshot.clear()                             # a copy: the view is unchanged
    assert view.members() == {("decode", "d0"): b"a2", ("decode", "d1"): b"c"}


def test_member_view_survives_a_failing_callback(caplog):
    def boom(change):
        raise RuntimeError("callback bug")

    view = _View(on_change=boom)
    with caplog.at_level(logging.ERROR):
        view._set(("decode", "d0"), b"a")
    assert view.members() == {("decode", "d0"): b"a"}
    assert "on_change callback failed" in caplog.text


def test_retry_log_warns_once_then_reports_recovery(caplog):
    logger = logging.getLogger("test.retrylog")
    retry = RetryLog(logger, "watch")
    with caplog.at_level(logging.DEBUG, logger="test.retrylog"):
        for _ in range(3):
            retry.failure(ConnectionError("down"), 0.1)
        retry.success()
        retry.success()
    levels = [r.levelno for r in caplog.records]
    assert levels == [logging.WARNING, logging.DEBUG, logging.DEBUG, logging.INFO]
    assert "recovered after 3 failed tries" in caplog.records[-1].getMessage()


def test_etcd_config_validation():
    etcd = pytest.importorskip("common.cluster.etcd")
    assert etcd.parse_endpoint("127.0.0.1:2379") == ("127.0.0.1", 2379)
    assert etcd.parse_endpoint("http://etcd:2379/") == ("etcd", 2379)
    for bad in ("127.0.0.1", "https://e:2379", "a:1,b:2", "e:0", "e:70000", ":2379", "e:x"):
        with pytest.raises(ValueError, match="etcd endpoint"):
            etcd.parse_endpoint(bad)
    cfg = etcd.EtcdConfig(endpoint="e:2379", retry_max_s=0.5)
    assert cfg.grpc_options()["grpc.max_reconnect_backoff_ms"] == 500
    with pytest.raises(ValueError, match="retry_max_s"):
        etcd.EtcdConfig(retry_max_s=0.01)
    with pytest.raises(ValueError, match="username and password"):
        etcd.EtcdConfig(username="u")
    with pytest.raises(ValueError, match="cluster"):
        etcd.EtcdConfig(cluster="")
