"""Killing the prefill process while requests are in flight: each request completes by
local prefill on the decode node (with the offline engine's tokens) or fails with
UNAVAILABLE within 5 s; none hangs, and the decode node ends with no block in use."""
from __future__ import annotations

import asyncio
import signal
import time

import grpc

from common.engine import LLM, SamplingParams
from tests.integration.conftest import ENGINE, mixed_prompts
from tests.integration.test_mesh import assert_no_blocks_in_use, request, stream


def test_kill_prefill_mid_flight(tiny_model, start_mesh):
    model = tiny_model("llama")
    mesh = start_mesh(model)
    prompts = [p * 4 for p in mixed_prompts(n=12, seed=21)]
    prompts = [p[:1500] for p in prompts]
    expected = [o.outputs[0].token_ids for o in LLM(str(model), **ENGINE).generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))]

    async def one(ids):
        start = time.monotonic()
        try:
            tokens, _, _ = await stream(mesh.gateway_address, request(ids, max_tokens=12))
            return tokens, None, time.monotonic() - start
        except grpc.aio.AioRpcError as e:
            return None, e.code(), time.monotonic() - start

    async def scenario():
        tasks = [asyncio.create_task(one(p)) for p in prompts]
        await asyncio.sleep(0.3)
        killed_at = time.monotonic()
        mesh.kill("prefill-0", signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
        return results, killed_at

    results, _ = asyncio.run(scenario())
    completed = 0
    for (tokens, code, elapsed), want in zip(results, expected):
        if code is None:
            assert tokens == want
            completed += 1
        else:
            assert code == grpc.StatusCode.UNAVAILABLE
            assert elapsed < 5.0 + 0.3
    assert completed >= 1
    assert_no_blocks_in_use(mesh)
    # new requests keep being served once the meta-server has expired the dead node
    time.sleep(2.5)
    tokens, _, _ = asyncio.run(stream(mesh.gateway_address, request(prompts[0], max_tokens=12)))
    assert tokens == expected[0]
    mesh.stop()
