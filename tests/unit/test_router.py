"""Router: exact choices of each policy, drained/excluded nodes skipped, cache_aware
prefix affinity (and its load limit), conditional disaggregation, the prefix index."""
from __future__ import annotations

import pytest

from common.hashing import hash_block_chain
from protos.pdmesh.v1 import common_pb2
from services.meta_server.prefix_index import PrefixIndex
from services.meta_server.registry import Member
from services.meta_server.router import NoNodeError, Router, RouteRequest

BLOCK = 16


def member(node_id: str, role: str, running: int = 0, waiting: int = 0, model: str = "m") -> Member:
    info = common_pb2.NodeInfo(node_id=node_id, role=role, address=f"{node_id}:1", model_id=model,
                               kv_layout=common_pb2.KVLayout(block_size=BLOCK, num_blocks=512),
                               load=common_pb2.NodeLoad(running=running, waiting=waiting,
                                                        free_blocks=512, total_blocks=512))
    return Member(info, ttl_s=3.0, last_seen=0.0)


def heartbeat(m: Member, running: int = 0, waiting: int = 0) -> None:
    m.info.load.running, m.info.load.waiting = running, waiting
    m.routed_since_heartbeat = m.local_prefills_since_heartbeat = 0


def mesh():
    return [member("p0", "prefill"), member("p1", "prefill"), member("d0", "decode"), member("d1", "decode")]


def req(tokens: int = 100, hashes=(), exclude=()) -> RouteRequest:
    return RouteRequest("m", tokens, tuple(hashes), frozenset(exclude))


def ids(decision) -> tuple[str, str | None]:
    return decision.decode.node_id, decision.prefill.node_id if decision.prefill else None


def test_round_robin_takes_turns_per_tier():
    router, members = Router(), mesh()
    got = [ids(router.route(members, req(), "round_robin")) for _ in range(4)]
    assert got == [("d0", "p0"), ("d1", "p1"), ("d0", "p0"), ("d1", "p1")]
    assert dict(router.routed_by_node) == {"d0": 2, "d1": 2, "p0": 2, "p1": 2}
    assert router.num_routed == 4 and router.num_local_prefill == 0


def test_least_load_counts_requests_routed_since_the_heartbeat():
    router, members = Router(), mesh()
    p0, p1, d0, d1 = members
    heartbeat(d0, running=2)
    heartbeat(p1, waiting=1)
    got = [ids(router.route(members, req(), "least_load")) for _ in range(4)]
    assert got == [("d1", "p0"), ("d1", "p0"), ("d0", "p1"), ("d1", "p0")]


@pytest.mark.parametrize("policy", ["round_robin", "least_load", "cache_aware"])
def test_drained_and_excluded_nodes_are_never_chosen(policy):
    router, members = Router(), mesh()
    for _ in range(5):
        assert ids(router.route(members, req(), policy, drained=frozenset({"d0", "p1"}))) == ("d1", "p0")
    assert ids(router.route(members, req(exclude={"d1"}), policy, drained=frozenset({"p0"}))) == ("d0", "p1")
    with pytest.raises(NoNodeError):
        router.route(members, req(exclude={"d1"}), policy, drained=frozenset({"d0"}))
    assert router.routed_by_node["d0"] == 1 and router.routed_by_node["p1"] == 1


def test_model_filter_and_unknown_policy():
    router = Router()
    with pytest.raises(NoNodeError, match="other"):
        router.route(mesh(), RouteRequest("other", 10), "least_load")
    with pytest.raises(ValueError, match=r"\['cache_aware', 'least_load', 'round_robin'\]"):
        router.route(mesh(), req(), "random")


def prompt(prefix_seed: int, suffix_seed: int, prefix_len: int = 512, suffix_len: int = 88) -> list[int]:
    return ([(prefix_seed * 7919 + i) % 1000 + 3 for i in range(prefix_len)]
            + [(suffix_seed * 104729 + i) % 1000 + 3 for i in range(suffix_len)])


def chain(tokens: list[int]) -> list[bytes]:
    return hash_block_chain(tokens, BLOCK, "m", "layout")


def test_cache_aware_follows_a_shared_512_token_prefix_unless_overloaded():
    router, members = Router(), mesh()
    p0, p1, d0, d1 = members
    heartbeat(d0, running=1)
    heartbeat(p0, running=1)
    first = chain(prompt(1, 1))
    assert ids(router.route(members, req(600, first), "cache_aware")) == ("d1", "p1")
    # the earlier request still runs on d1/p1; the others are idle now
    heartbeat(d0), heartbeat(p0), heartbeat(d1, running=1), heartbeat(p1, running=1)
    second = chain(prompt(1, 2))                  # same 512-token prefix, other suffix
    assert first[:32] == second[:32] and first[32] != second[32]
    assert d0.load_score() < d1.load_score() and p0.load_score() < p1.load_score()
    decision = router.route(members, req(600, second), "cache_aware")
    assert ids(decision) == ("d1", "p1") and decision.num_hit_blocks == 32
    # cost = missing blocks + 4 * load: 5 + 4 * 9 = 41 on d1 against 37 + 0 on d0
    heartbeat(d1, running=9)
    heartbeat(p1, running=9)
    heartbeat(d0), heartbeat(p0)
    third = chain(prompt(1, 3))
    assert router.cost(d1, tuple(third)) == 5 + 4 * 9 and router.cost(d0, tuple(third)) == 37
    assert ids(router.route(members, req(600, third), "cache_aware")) == ("d0", "p0")
    # an unrelated prompt goes to the least loaded node, like least_load
    heartbeat(d0, running=1), heartbeat(d1, running=0), heartbeat(p0, running=1), heartbeat(p1)
    assert ids(router.route(members, req(600, chain(prompt(9, 9))), "cache_aware")) == ("d1", "p1")


def test_cache_aware_counts_kv_store_hits_on_every_prefill_node():
    router, members = Router(), mesh()
    p0, p1, d0, d1 = members
    first = chain(prompt(1, 1))
    assert ids(router.route(members, req(600, first), "cache_aware")) == ("d0", "p0")
    heartbeat(p0, running=1)
    second = tuple(chain(prompt(1, 2)))
    # without the store, p0's prefix hit (32 blocks) outweighs its load: 5 + 4 < 37
    assert ids(router.route(members, req(600, second), "cache_aware"))[1] == "p0"
    heartbeat(p0, running=1), heartbeat(p1)
    # the store holds the prefix: both prefill nodes miss only 5 blocks, p1 is idle
    third = tuple(chain(prompt(1, 3)))
    assert router.cost(p1, third, shared_hit_blocks=32) == 5
    assert router.cost(p0, third, shared_hit_blocks=32) == 5 + 4
    decision = router.route(members, RouteRequest("m", 600, third, store_hit_blocks=32), "cache_aware")
    assert decision.prefill.node_id == "p1"


def test_conditional_disaggregation():
    router, members = Router(local_prefill_max_tokens=64, prefill_queue_threshold=2), mesh()
    p0, p1, d0, d1 = members
    assert router.route(members, req(63), "least_load").local_prefill
    assert not router.route(members, req(64), "least_load").local_prefill
    heartbeat(p0, waiting=3)
    heartbeat(p1, waiting=5)
    heartbeat(d0), heartbeat(d1)
    decision = router.route(members, req(1000), "least_load")
    assert decision.local_prefill and decision.decode.node_id in ("d0", "d1")
    heartbeat(p1, waiting=2)                      # one prefill node at the threshold: remote
    assert router.route(members, req(1000), "least_load").prefill.node_id == "p1"
    assert router.num_local_prefill == 2 and router.num_routed == 4
    assert router.route([p0, member("b0", "both")], req(1000), "least_load").local_prefill
    assert router.route([d0], req(1000), "least_load").local_prefill
    assert router.route(members, req(1000), "least_load", drained=frozenset({"p0", "p1"})).local_prefill


def test_a_burst_splits_between_the_prefill_node_and_the_decode_node_by_backlog():
    # no heartbeat during the burst: the router counts what it sent each way itself
    router = Router(prefill_queue_threshold=1)
    p0, d0 = member("p0", "prefill"), member("d0", "decode")
    local = [router.route([p0, d0], req(1000), "least_load").local_prefill for _ in range(9)]
    # remote while p0's backlog is at most d0's + 1, then by turns
    assert local == [False, False, True, False, True, False, True, False, True]
    assert (p0.prefill_backlog(), d0.local_prefill_backlog()) == (5, 4)
    # the next heartbeats: p0 still has 4 prompts, d0 has drained its own
    heartbeat(p0, running=1, waiting=3)
    heartbeat(d0, running=9)
    assert [router.route([p0, d0], req(1000), "least_load").local_prefill for _ in range(3)] == [True, True, True]
    heartbeat(p0)                                 # light load: everything remote again
    assert not router.route([p0, d0], req(1000), "least_load").local_prefill


def test_prefix_index_counts_leading_hits_and_evicts_tails_first():
    index = PrefixIndex()
    a, b = chain(prompt(1, 1, 64, 0)), chain(prompt(2, 2, 64, 0))   # 4 blocks each
    index.record("n", a, capacity=6)
    assert index.prefix_hit("n", a) == 4 and index.prefix_hit("n", a[1:]) == 3
    index.record("n", b, capacity=6)              # evicts a's last two blocks first
    assert index.prefix_hit("n", b) == 4 and index.prefix_hit("n", a) == 2
    assert index.num_blocks("n") == 6 and index.prefix_hit("other", a) == 0
    index.forget("n")
    assert index.prefix_hit("n", b) == 0


def test_restart_and_forget_reset_what_the_router_knows():
    router, members = Router(), mesh()
    hashes = chain(prompt(1, 1))
    router.route(members, req(600, hashes), "cache_aware")
    assert router.index.prefix_hit("d0", hashes) == 37
    router.node_restarted("d0")
    assert router.index.prefix_hit("d0", hashes) == 0 and router.routed_by_node["d0"] == 1
    router.forget("d0")
    assert "d0" not in router.routed_by_node and "d0" not in router.node_roles


@pytest.mark.parametrize("field", ["local_prefill_max_tokens", "prefill_queue_threshold"])
@pytest.mark.parametrize("value", [-1, "2", 1.5, True])
def test_conditional_disaggregation_fields_are_integers_of_at_least_zero(field, value):
    from common.config import MetaConfig
    with pytest.raises(ValueError, match=rf"^meta_server\.{field} must be an integer >= 0 \(0 = off\), got "):
        MetaConfig(**{field: value})


def tp_member(node_id: str, role: str, tp: int, heads_per_rank: int, kind: str = "") -> Member:
    m = member(node_id, role)
    m.info.tensor_parallel_size = tp
    m.info.kv_layout.num_kv_heads = heads_per_rank
    m.info.kv_layout.kind = kind
    return m


@pytest.mark.parametrize("prefill_kind,decode_kind,served", [
    ("latent", "latent", True), ("latent_split", "latent_split", True), ("kv", "latent", False),
    ("", "latent", False), ("latent_split", "latent", False), ("latent", "kv", False)])
def test_a_latent_prefill_node_of_lower_tp_pushes_into_a_latent_decode_node(prefill_kind, decode_kind, served):
    """MLA nodes hold the same latent on every rank: prefill TP 1 into decode TP 2 is served
    when both caches are latent of one kind (one plane, or split), refused as for GQA
    otherwise."""
    router = Router()
    nodes = [tp_member("p0", "prefill", 1, 1, prefill_kind), tp_member("d0", "decode", 2, 1, decode_kind)]
    assert ids(router.route(nodes, req(), "least_load")) == ("d0", "p0" if served else None)
    same_tp = [tp_member("p0", "prefill", 1, 1, prefill_kind), tp_member("d0", "decode", 1, 1, decode_kind)]
    same_kind = (prefill_kind or "kv") == decode_kind
    assert ids(router.route(same_tp, req(), "least_load")) == ("d0", "p0" if same_kind else None)


@pytest.mark.parametrize("p,heads_p,d,heads_d,served", [
    (1, 8, 1, 8, True), (2, 4, 2, 4, True), (2, 4, 1, 8, True), (4, 2, 2, 4, True), (4, 2, 1, 8, True),
    (1, 8, 2, 4, False),    # p < d
    (3, 2, 2, 3, False),    # not a multiple
    (2, 1, 1, 1, False),    # a model with 1 KV head at prefill TP 2: replicated heads
    (2, 2, 1, 8, False),    # head counts that do not add up (another model's layout)
])
def test_prefill_nodes_whose_tp_cannot_push_into_the_decode_node_are_never_routed(p, heads_p, d, heads_d, served,
                                                                                   caplog):
    from common.transfer.tp_pairing import pairing_refusal, rank_writes
    router = Router()
    nodes = [tp_member("p0", "prefill", p, heads_p), tp_member("d0", "decode", d, heads_d)]
    for _ in range(2):
        decision = router.route(nodes, req(), "least_load")
    assert ids(decision) == ("d0", "p0" if served else None)
    assert (pairing_refusal(p, heads_p, d, heads_d) is None) == served
    assert router.num_tp_refused == (0 if served else 2)
    warnings = [r.getMessage() for r in caplog.records if "cannot push into" in r.getMessage()]
    assert len(warnings) == (0 if served else 1), "said once per pair of shapes"
    if served:
        writes = rank_writes(p, heads_p, d, heads_d)
        assert [(w.src, w.dst) for w in writes] == [(i, i * d // p) for i in range(p)]
        assert sorted((w.dst, w.head_offset) for w in writes) == [
            (j, o) for j in range(d) for o in range(0, heads_d, heads_p)], "every decode head written once"
    else:
        with pytest.raises(ValueError, match=f"prefill TP {p}"):
            rank_writes(p, heads_p, d, heads_d)


def test_a_fitting_prefill_node_is_chosen_over_a_less_loaded_one_that_does_not_fit():
    nodes = [tp_member("p0", "prefill", 1, 8), tp_member("p1", "prefill", 2, 4), tp_member("d0", "decode", 2, 4)]
    heartbeat(nodes[1], running=5)
    decision = Router().route(nodes, req(), "least_load")
    assert ids(decision) == ("d0", "p1") and decision.prefill_fallbacks == []


def test_the_planner_s_hit_tokens_count_the_prefilling_node_s_hit_or_the_store_s():
    """num_hit_tokens_routed: the prefilling node's predicted hit, or the kv-store's leading
    blocks when a prefill node prefills (any of them reads those), in tokens, at most the prompt."""
    router, members = Router(), mesh()
    hashes = hash_block_chain(list(range(100)), BLOCK, "m", "layout")          # 6 full blocks of 16
    router.route(members, req(100, hashes), "cache_aware")                   # cold: no hit
    router.route(members, req(100, hashes), "cache_aware")                   # p0 holds the 6 blocks
    assert (router.num_prompt_tokens_routed, router.num_hit_tokens_routed) == (200, 96)
    other = hash_block_chain(list(range(200, 300)), BLOCK, "m", "layout")
    router.route(members, RouteRequest("m", 100, tuple(other), store_hit_blocks=4), "cache_aware")
    assert (router.num_prompt_tokens_routed, router.num_hit_tokens_routed) == (300, 96 + 64)
    local = Router(local_prefill_max_tokens=1000)                              # the decode node prefills
    local.route(members, RouteRequest("m", 100, tuple(other), store_hit_blocks=4), "cache_aware")
    assert (local.num_prompt_tokens_routed, local.num_hit_tokens_routed) == (100, 0)
