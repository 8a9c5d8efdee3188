"""Logprobs across a remote prefill: the prefill node samples the first token and sends
its logprobs (PrefillResponse.first_token_logprobs); the decode node emits them with the
token and computes the rest itself. A first token whose logprobs are missing or cannot
be the request's is refused (commit_remote: ValueError), and the decode node then
computes the prompt itself: the client still gets every token's logprobs."""
from __future__ import annotations

import asyncio

import pytest

from common.engine import SamplingParams
from tests.prefill_pair import PrefillPair
from tests.unit.test_remote_prefill import model, prompt, reference  # noqa: F401  (fixtures: tiny llama, its offline engine)
from tests.unit.test_request_lifecycle import assert_idle, engine_of

NUM_TOP = 3
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=NUM_TOP)
TOL = 1e-4


def expect(reference, p):
    out = reference.generate({"prompt_token_ids": p}, PARAMS)[0].outputs[0]
    return out.token_ids, out.logprobs


def assert_near(got: list[dict[int, float]], want: list[dict[int, float]]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert list(g) == list(w), "same tokens, the sampled one first"
        assert all(abs(g[t] - w[t]) <= TOL for t in w), (g, w)


async def collect(pair: PrefillPair, rid: str, p: list[int], remote) -> tuple[list[int], list[dict]]:
    tokens, logprobs = [], []
    async for out in pair.decode.generate(rid, p, PARAMS, remote=remote):
        tokens += out.new_token_ids
        logprobs += out.new_logprobs or []
    return tokens, logprobs


def test_first_token_logprobs_come_from_the_prefill_node(model, reference):
    p = prompt(1)
    want_tokens, want = expect(reference, p)

    async def scenario():
        pair = await PrefillPair(model).start()
        try:
            remote = pair.remote("a", p, PARAMS)
            got = await collect(pair, "a", p, remote)
            assert_idle(pair.decode_engine)
            assert remote.reply is not None and remote.reply.HasField("first_token_logprobs")
            sent = remote.reply.first_token_logprobs
            return got, dict(zip(sent.token_ids, sent.logprobs))
        finally:
            await pair.close()

    (tokens, logprobs), sent = asyncio.run(scenario())
    assert tokens == want_tokens
    assert_near(logprobs, want)
    assert_near([sent], want[:1])


def test_a_prefill_reply_without_logprobs_is_computed_here(model, reference, monkeypatch, caplog):
    """The prefill node's logprobs are lost (an older node, say): the decode node refuses
    its first token and prefills the prompt itself; the tokens and logprobs are the same."""
    import services.decode.remote_prefill as remote_prefill
    p = prompt(2)
    want_tokens, want = expect(reference, p)
    monkeypatch.setattr(remote_prefill, "logprobs_from_proto", lambda msg: None)

    async def scenario():
        pair = await PrefillPair(model).start()
        try:
            remote = pair.remote("b", p, PARAMS)
            got = await collect(pair, "b", p, remote)
            assert remote.reply is not None, "the prefill node answered"
            assert_idle(pair.decode_engine)
            return got
        finally:
            await pair.close()

    tokens, logprobs = asyncio.run(scenario())
    assert "remote KV of b is unusable (the request asked for logprobs and the prefill node sent none)" \
        in caplog.text, "the decode node refused the first token and computed the prompt"
    assert tokens == want_tokens
    assert_near(logprobs, want)


@pytest.mark.parametrize("bad,why", [
    (None, "sent none"),
    ({7: -0.5, 8: -1.0, 9: -2.0}, "expected 5 first"),                     # another token first
    ({5: -0.5, 8: -1.0}, "expected 5 first"),                              # fewer than NUM_TOP
    ({5: -0.5, 6: -0.6, 7: -0.7, 8: -0.8, 9: -0.9}, "expected 5 first"),   # more than NUM_TOP + 1
    ({5: -0.5, 6: -0.6, 99999: -0.7}, "outside the vocabulary"),
    ({5: 0.5, 6: -0.6, 7: -0.7}, "above 0"),
])
def test_commit_remote_refuses_logprobs_that_are_not_the_requests(model, bad, why):
    engine = engine_of(model, 16)
    engine.add_request("r", prompt(3), PARAMS, kv_remote=True)
    engine.admit_remote()
    with pytest.raises(ValueError, match=why):
        engine.commit_remote("r", 5, bad)
    assert engine.take_outputs() == []
    good = {5: -0.5, 6: -0.6, 7: -0.7}
    assert engine.commit_remote("r", 5, good)
    [out] = engine.take_outputs()
    assert (out.new_token_ids, out.new_logprobs) == ([5], [good])
    engine.abort("r")
    assert_idle(engine)
