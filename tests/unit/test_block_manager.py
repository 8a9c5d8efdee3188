"""Block manager: exact block ids and free-queue order."""
from common.engine.block_manager import BlockManager
from common.engine.sampling_params import SamplingParams
from common.engine.sequence import Sequence
from common.hashing import block_hash, hash_block_chain
from common.transfer import block_runs


def make_seq(tokens, rid="r"):
    return Sequence(rid, list(tokens), SamplingParams(), 0)


def computed(bm, seq):
    """Pretend the model computed every token of seq."""
    seq.num_computed_tokens = len(seq)
    bm.cache_full_blocks(seq)


def test_allocate_takes_lowest_free_ids_in_order():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(range(10))
    assert bm.allocate(a)
    assert a.block_ids == [0, 1, 2]
    assert a.num_computed_tokens == 0
    b = make_seq(range(100, 105))
    assert bm.allocate(b)
    assert b.block_ids == [3, 4]
    assert list(bm.free_queue) == [5, 6, 7]
    assert bm.num_used_blocks == 5


def test_free_keeps_hashed_blocks_in_lru_order_tail_first():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = make_seq(range(10))        # 2 full blocks + 2 tokens
    bm.allocate(a)
    computed(bm, a)
    bm.free(a)
    # the partial (unhashed) block goes to the front; hashed blocks to the back, tail first
    assert list(bm.free_queue) == [2, 3, 4, 5, 1, 0]
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert len(bm.hash_to_block) == 2


def test_prefix_hit_reuses_cached_blocks_and_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(range(12))
    bm.allocate(a)
    computed(bm, a)
    bm.free(a)
    b = make_seq(range(12), rid="b")        # identical prompt: last block must be recomputed
    assert bm.allocate(b)
    assert b.block_ids[:2] == [0, 1]
    assert b.num_computed_tokens == 8
    assert b.block_ids == [0, 1, 3]         # the last block is recomputed into a new one
    c = make_seq(list(range(8)) + [99, 98, 97, 96, 95], rid="c")
    assert bm.allocate(c)
    assert c.block_ids[:2] == [0, 1]
    assert [bm.blocks[i].ref_count for i in (0, 1)] == [2, 2]
    bm.free(b)
    bm.free(c)
    assert bm.num_used_blocks == 0


def test_hit_checks_tokens_not_only_hash():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2, 3, 4, 5])
    bm.allocate(a)
    computed(bm, a)
    bm.blocks[0].token_ids = (7, 7)          # simulate a hash collision
    bm.free(a)
    b = make_seq([1, 2, 3, 4, 5], rid="b")
    bm.allocate(b)
    assert b.num_computed_tokens == 0


def test_eviction_drops_oldest_cached_block_first():
    bm = BlockManager(num_blocks=5, block_size=2)
    a = make_seq([1, 2, 3, 4])
    bm.allocate(a)
    computed(bm, a)
    bm.free(a)
    assert list(bm.free_queue) == [2, 3, 4, 1, 0]
    b = make_seq([9] * 8, rid="b")
    assert bm.allocate(b)
    assert b.block_ids == [1, 2, 3, 4]       # takes 2, 3, 4 and a's tail block 1, keeps its prefix 0
    assert bm.blocks[1].hash is None
    assert bm.hash_to_block == {hash_block_chain([1, 2], 2)[0]: 0}
    bm.free(b)                               # never computed: unhashed, to the front
    assert list(bm.free_queue) == [1, 2, 3, 4, 0]
    c = make_seq([1, 2, 5], rid="c")
    assert bm.allocate(c)
    assert c.block_ids == [0, 1]
    assert c.num_computed_tokens == 2
    bm.free(c)
    assert bm.num_used_blocks == 0


def test_no_room_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = make_seq(range(9))
    bm.allocate(a)
    b = make_seq(range(50, 55), rid="b")
    assert not bm.can_allocate(b)
    assert not bm.allocate(b)
    assert b.block_ids == [] and list(bm.free_queue) == []
    bm.free(a)
    assert bm.allocate(b) and b.block_ids == [0, 1]


def test_append_slots_grows_one_block_at_a_boundary():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_seq(range(4))
    bm.allocate(a)
    assert a.block_ids == [0]
    a.token_ids.append(4)
    assert bm.can_append(a)
    bm.append_slots(a)
    assert a.block_ids == [0, 1]
    bm.free(a)


def test_cached_block_shared_by_two_sequences_frees_once_both_done():
    bm = BlockManager(num_blocks=6, block_size=2)
    a = make_seq([1, 2, 3, 4, 5])
    bm.allocate(a)
    computed(bm, a)
    b = make_seq([1, 2, 3, 4, 6], rid="b")
    bm.allocate(b)
    assert b.block_ids[:2] == [0, 1] and b.num_computed_tokens == 4
    bm.free(a)
    assert 0 not in bm.free_queue and 1 not in bm.free_queue
    bm.free(b)
    assert bm.num_used_blocks == 0


def test_hash_chain_is_stable_and_depends_on_model_and_layout():
    h = hash_block_chain(list(range(8)), 4, "m", "L")
    assert [x.hex() for x in h] == ["7c66375c7cfa2228b53e5f1bffcbee5b", "30fe8127ef43e2486c959dc38b175c55"]
    assert h[1] == block_hash(h[0], list(range(4, 8)), "m", "L")
    assert h[0].hex() == block_hash(None, [0, 1, 2, 3], "m", "L").hex()
    assert hash_block_chain(list(range(8)), 4, "other", "L") != h
    assert hash_block_chain(list(range(8)), 4, "m", "L2") != h
    assert hash_block_chain(list(range(7)), 4) == hash_block_chain(list(range(4)), 4)


def test_new_blocks_of_an_allocation_ascend_so_reused_blocks_form_one_run():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(range(16))                 # blocks 0-3, all full
    bm.allocate(a)
    computed(bm, a)
    b = make_seq(range(100, 116), rid="b")  # blocks 4-7
    bm.allocate(b)
    bm.free(a)
    assert list(bm.free_queue) == [3, 2, 1, 0]      # LRU: the tail is evicted first
    c = make_seq(range(200, 212), rid="c")
    assert bm.allocate(c)
    assert c.block_ids == [1, 2, 3]                 # the same blocks 3, 2, 1, ascending
    assert block_runs([0, 1, 2], c.block_ids) == [(0, 1, 3)]
    assert list(bm.free_queue) == [0]
    bm.free(b)
    bm.free(c)
    assert bm.num_used_blocks == 0
