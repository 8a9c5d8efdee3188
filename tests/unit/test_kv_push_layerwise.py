"""Layerwise KV push (services/prefill/kv_push.py) against a real PrefillServicer and the
decode node's RemotePrefill (tests/prefill_pair.py, fake transfer), prefill chunks of 32
tokens: each layer's write is submitted on the step thread right after that layer wrote
its KV, before the layer's MLP and the step's end (order observed, not timed), one write
per layer at the backend; the decode node gets byte-identical blocks and tokens in both
modes; a cancel mid-push lets no write start after it, answers unsettled while writes are
in flight, and leaks no block once they end."""
from __future__ import annotations

import asyncio
import random
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from common.config import EngineConfig, TransferConfig
from common.engine import SamplingParams
from common.engine.llm_engine import LLMEngine
from services.prefill.kv_destination import OneRankWrites
from services.prefill.kv_push import KVPusher
from tests import prefill_pair
from tests.conftest import assert_no_blocks_in_use
from tests.prefill_pair import PrefillPair

CHUNK = 32
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


@pytest.fixture
def chunked(monkeypatch):
    """PrefillPair engines that prefill in chunks of CHUNK tokens."""
    def engine(model, num_blocks):
        return LLMEngine(EngineConfig(str(model), num_blocks=num_blocks, max_num_batched_tokens=CHUNK,
                                      max_model_len=min(256, 16 * num_blocks)))
    monkeypatch.setattr(prefill_pair, "_engine", engine)


async def collect(pair, rid, p, params=GREEDY) -> list[int]:
    remote = pair.remote(rid, p, params)
    return [t async for out in pair.decode.generate(rid, p, params, remote=remote) for t in out.new_token_ids]


async def wait_for(predicate, timeout_s: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def prompt_kv(blocks: torch.Tensor, n: int) -> torch.Tensor:
    """KV of the first n token slots of blocks [L, 2, num_blocks, block_size, heads, dim]."""
    L, two, nb, bs, h, d = blocks.shape
    return blocks.reshape(L, two, nb * bs, h, d)[:, :, :n]


def snapshot_both_sides(pair) -> tuple[dict, dict]:
    """(source, destination): request id -> its blocks' KV on the prefill node when it
    releases them (every write ended) and on the decode node when the first token is
    committed (the moment the decode node starts using them)."""
    source, dest = {}, {}
    pe, de = pair.prefill_engine, pair.decode_engine
    release, commit = pe.release, de.commit_remote

    def on_release(rid):
        seq = pe.scheduler.held.get(rid)
        if seq is not None:
            source[rid] = pe.kv_cache[:, :, seq.block_ids].clone()
        return release(rid)

    def on_commit(rid, token, logprobs=None):
        seq = de._remote_seq(rid)
        if seq is not None:
            dest[rid] = de.kv_cache[:, :, seq.block_ids].clone()
        return commit(rid, token, logprobs)

    pe.release, de.commit_remote = on_release, on_commit
    return source, dest


def record_layers_written(pair) -> list[set[int]]:
    """The layers of the destination each write at the backend touches, in call order."""
    calls: list[set[int]] = []
    write, layout = pair.prefill_transfer.write, pair.decode_node.layout

    def recording(peer, batch, timeout_s=None):
        calls.append({(remote - layout.base_address) // layout.strides[0] for _, remote, _ in batch})
        return write(peer, batch, timeout_s)

    pair.prefill_transfer.write = recording
    return calls


class RecordingExecutor(ThreadPoolExecutor):
    """Logs each KV write submitted, with its layers (KVPusher._send's last argument)."""

    def __init__(self, events: list, max_workers: int = 4):
        super().__init__(max_workers)
        self.events = events

    def submit(self, fn, *args, **kwargs):
        self.events.append(("submit", args[-1]))
        return super().submit(fn, *args, **kwargs)


def record_step_order(pair, events: list) -> None:
    """Log on the step thread: each layer's KV written, each layer's MLP, each step's end."""
    engine = pair.prefill_engine
    for i, layer in enumerate(engine.model.layers):
        attention, mlp = layer.self_attn.forward, layer.mlp.forward

        def logged_attention(*args, _f=attention, _i=i, **kwargs):
            out = _f(*args, **kwargs)
            events.append(("kv", _i))
            return out

        def logged_mlp(*args, _f=mlp, _i=i, **kwargs):
            events.append(("mlp", _i))
            return _f(*args, **kwargs)

        layer.self_attn.forward, layer.mlp.forward = logged_attention, logged_mlp
    execute = engine.runner.execute

    def logged_execute(sched, between_layers=None):
        out = execute(sched, between_layers)
        events.append(("step_end",))
        return out

    engine.runner.execute = logged_execute


@pytest.mark.parametrize("mode", ["layerwise", "chunk"])
def test_each_layer_is_written_inside_the_forward_pass_right_after_its_kv(model, chunked, monkeypatch, mode):
    """60 tokens in chunks of 32: [0, 32) completes blocks 0-1, [32, 60) blocks 2-3 (the
    last one partial). Layerwise, layer l's write is submitted between its KV write and
    its MLP, in both steps; per chunk, after the step, all layers in one write."""
    p = prompt(1, 60)

    async def scenario():
        pair = PrefillPair(model, kv_push=mode)
        events: list = []
        pair.prefill_node.executor = RecordingExecutor(events)
        record_step_order(pair, events)
        calls = record_layers_written(pair)
        await pair.start()
        try:
            got = await collect(pair, "a", p)
            return got, events, calls, pair
        finally:
            await pair.close()

    got, events, calls, pair = asyncio.run(scenario())
    layers = range(pair.prefill_engine.model_config.num_layers)
    if mode == "layerwise":
        step = [e for i in layers for e in (("kv", i), ("submit", (i,)), ("mlp", i))] + [("step_end",)]
        assert calls == [{i} for i in layers] * 2
    else:
        step = [e for i in layers for e in (("kv", i), ("mlp", i))] + [("step_end",), ("submit", None)]
        assert calls == [set(layers)] * 2
    assert events == step * 2
    assert len(got) == GREEDY.max_tokens
    assert_no_blocks_in_use(pair.decode_engine)
    assert_no_blocks_in_use(pair.prefill_engine)


def test_layerwise_and_per_chunk_push_give_the_decode_node_identical_blocks_and_tokens(
        model, chunked, monkeypatch, llm_factory):
    """One request after another (the same chunks in both modes): the decode node's blocks
    at commit are byte-identical to the prefill node's and across modes, the tokens equal
    the in-process engine's. Then two requests batched in the same steps (each with its
    own pusher, layerwise): still byte-identical to the source."""
    prompts = {"a": prompt(2, 60), "b": prompt(3, 45), "c": prompt(4, 17)}
    reference = llm_factory(model, max_model_len=256, max_num_batched_tokens=CHUNK)
    want = {rid: reference.generate({"prompt_token_ids": p}, GREEDY)[0].outputs[0].token_ids
            for rid, p in prompts.items()}

    async def run(mode: str, batched: bool):
        pair = await PrefillPair(model, kv_push=mode).start()
        source, dest = snapshot_both_sides(pair)
        try:
            if batched:
                got = dict(zip(prompts, await asyncio.gather(*(collect(pair, r, p) for r, p in prompts.items()))))
            else:
                got = {rid: await collect(pair, rid, p) for rid, p in prompts.items()}
            await wait_for(lambda: len(source) == len(prompts), what="the prefill node's releases")
            return got, source, dest, pair
        finally:
            await pair.close()

    results = {mode: asyncio.run(run(mode, batched=False)) for mode in ("chunk", "layerwise")}
    for mode, (got, source, dest, pair) in results.items():
        assert got == want, mode
        for rid, p in prompts.items():
            assert torch.equal(prompt_kv(dest[rid], len(p)), prompt_kv(source[rid], len(p))), (mode, rid)
        assert_no_blocks_in_use(pair.decode_engine)
        assert_no_blocks_in_use(pair.prefill_engine)
    for rid, p in prompts.items():
        assert torch.equal(prompt_kv(results["chunk"][2][rid], len(p)),
                           prompt_kv(results["layerwise"][2][rid], len(p))), rid

    got, source, dest, pair = asyncio.run(run("layerwise", batched=True))
    for rid, p in prompts.items():
        assert torch.equal(prompt_kv(dest[rid], len(p)), prompt_kv(source[rid], len(p))), rid
        assert len(got[rid]) == GREEDY.max_tokens
    assert_no_blocks_in_use(pair.decode_engine)
    assert_no_blocks_in_use(pair.prefill_engine)


def test_a_cancel_mid_layerwise_push_starts_no_more_writes_and_leaks_no_block(model, monkeypatch):
    """One 60-token chunk, 4 layers, 2 transfer threads: layers 0-1 are in flight (held),
    2-3 queued when the client leaves. The cancel cannot be confirmed (writes in flight):
    the decode node quarantines the blocks; once the held writes land, the queued ones
    start nothing, the prefill node confirms, and every block on both nodes is free."""
    p = prompt(5, 60)

    async def scenario():
        pair = PrefillPair(model, decode_blocks=16)
        pair.prefill_node.executor = ThreadPoolExecutor(2)
        calls = record_layers_written(pair)
        await pair.start()
        try:
            pair.prefill_transfer.hold()
            task = asyncio.ensure_future(collect(pair, "a", p))
            await wait_for(lambda: pair.prefill_transfer.num_held == 2, what="two held writes")
            await wait_for(lambda: "a" in pair.prefill_engine.scheduler.held, what="the prefill's first token")
            pusher = pair.servicer.inflight["a"][0]
            blocks = list(pair.decode_engine.scheduler.remote["a"].block_ids)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            quarantined = pair.decode_engine.stats()["quarantined_blocks"]
            assert (pusher.stopped, pusher.settled, pusher.num_writes) == (True, False, 4)
            pair.prefill_transfer.release_held()
            await wait_for(lambda: pair.decode_engine.stats()["quarantined_blocks"] == 0,
                           what="the prefill node's confirmation")
            await wait_for(lambda: not pair.prefill_engine.scheduler.held, what="the source blocks' release")
            return blocks, quarantined, pusher, calls, pair
        finally:
            await pair.close()

    blocks, quarantined, pusher, calls, pair = asyncio.run(scenario())
    assert quarantined == len(blocks) == 4
    assert pusher.settled
    assert sorted(calls, key=min) == [{0}, {1}]     # the queued layers 2-3 never started
    assert pair.prefill_transfer.num_writes == 2
    assert_no_blocks_in_use(pair.decode_engine)
    assert_no_blocks_in_use(pair.prefill_engine)


class RecordingSender:
    def __init__(self):
        self.calls = []

    def send_blocks(self, peer, layout, src, dst, layers=None, last_block_tokens=None, timeout_s=None):
        self.calls.append((list(src), list(dst), layers, last_block_tokens))
        return 100


def pusher_for(sender, executor, layerwise=True) -> KVPusher:
    return KVPusher(OneRankWrites(sender, "peer", None), executor, [10, 11, 12, 13], 0, 16, 60,
                    time.monotonic() + 10, 1.0, layerwise=layerwise)


def test_without_layer_hooks_a_layerwise_pusher_writes_per_chunk():
    """An engine that calls no on_layer for a chunk: on_computed sends its blocks, all
    layers in one write; a chunk whose layers were hooked is not sent again."""
    seq = SimpleNamespace(block_ids=[0, 1, 2, 3])

    async def scenario():
        sender, executor = RecordingSender(), ThreadPoolExecutor(1)
        pusher = pusher_for(sender, executor)
        pusher.on_computed(seq, 0, 32)
        for layer in range(2):
            pusher.on_computed.on_layer(seq, layer, 32, 60)
        pusher.on_computed(seq, 32, 60)
        nbytes = await pusher.finish()
        executor.shutdown()
        return sender.calls, nbytes, pusher

    calls, nbytes, pusher = asyncio.run(scenario())
    assert calls == [([0, 1], [10, 11], None, None), ([2, 3], [12, 13], (0,), 12), ([2, 3], [12, 13], (1,), 12)]
    assert nbytes == 300 and pusher.settled


def test_a_stopped_pusher_submits_no_layer_write():
    seq = SimpleNamespace(block_ids=[0, 1, 2, 3])

    async def scenario():
        sender, executor = RecordingSender(), ThreadPoolExecutor(1)
        pusher = pusher_for(sender, executor)
        pusher.on_computed.on_layer(seq, 0, 0, 60)
        pusher.stopped = True
        pusher.on_computed.on_layer(seq, 1, 0, 60)
        pusher.on_computed(seq, 0, 60)
        settled = await pusher.stop()
        executor.shutdown()
        return sender.calls, pusher.num_writes, settled

    calls, num_writes, settled = asyncio.run(scenario())
    assert num_writes == 1 and settled
    assert len(calls) <= 1      # the one write submitted before stop may have started or not


def test_kv_push_mode_is_checked_in_the_config():
    assert TransferConfig().kv_push == "layerwise"
    with pytest.raises(ValueError, match=r"transfer.kv_push must be one of \('layerwise', 'chunk'\), got 'layer'"):
        TransferConfig(kv_push="layer")
