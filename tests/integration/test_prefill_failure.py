"""Killing the prefill node while prefills are provably in progress: the node is frozen
(SIGSTOP) once the decode node reports requests waiting on it for their KV (KV_REMOTE),
then killed. Every request completes with the offline engine's tokens, prefilled on the
decode node in fresh blocks; the blocks the dead node might still have written stay
quarantined until its lease lapsed plus timeouts.transfer_s, then every block is free."""
from __future__ import annotations

import asyncio
import os
import signal
import time

from common.engine import LLM, SamplingParams
from tests.integration.conftest import ENGINE, engine_stats, mixed_prompts
from tests.integration.test_mesh import assert_no_blocks_in_use, request, stream

TIMEOUTS = {"transfer_s": 1.0, "cancel_ack_s": 3.0}


def test_kill_prefill_mid_flight(tiny_model, start_mesh):
    model = tiny_model("llama")
    mesh = start_mesh(model, top={"timeouts": TIMEOUTS})
    prompts = [(p * 4)[:1500] for p in mixed_prompts(n=12, seed=21)]
    expected = [o.outputs[0].token_ids for o in LLM(str(model), **ENGINE).generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))]
    decode = mesh.services["decode-0"].address

    async def scenario():
        tasks = [asyncio.create_task(stream(mesh.gateway_address, request(p, max_tokens=12))) for p in prompts]
        pid = mesh.services["prefill-0"].process.pid
        deadline = time.monotonic() + 30
        while True:   # freeze the prefill node while the decode node waits on it for KV
            assert time.monotonic() < deadline, "no request ever waited on the prefill node"
            if engine_stats(decode, "decode").kv_remote >= 1:
                os.killpg(pid, signal.SIGSTOP)
                waiting = engine_stats(decode, "decode").kv_remote   # frozen mid-prefill
                if waiting >= 1:
                    break
                os.killpg(pid, signal.SIGCONT)  # it had just finished: try again
            await asyncio.sleep(0.005)
        mesh.kill("prefill-0", signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
        return results, waiting

    results, waiting = asyncio.run(scenario())
    assert waiting >= 1
    for i, ((tokens, _, msgs), want) in enumerate(zip(results, expected)):
        assert tokens == want, f"request {i}"
    assert sum(not msgs[0].prefill_timing.remote for _, _, msgs in results) >= 1   # the fallback ran
    # quarantined blocks are freed once the lease (ttl 2 s) lapsed plus 2 x transfer_s
    assert_no_blocks_in_use(mesh, timeout_s=2.0 + 2 * TIMEOUTS["transfer_s"] + 5.0)
    # new requests keep being served once the meta-server has expired the dead node
    tokens, _, _ = asyncio.run(stream(mesh.gateway_address, request(prompts[0], max_tokens=12)))
    assert tokens == expected[0]
    mesh.stop()
