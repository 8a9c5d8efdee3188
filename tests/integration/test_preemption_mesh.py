"""A decode node short of KV blocks preempts requests whose prompt a prefill node
computed; each is recomputed on the decode node from prompt + generated tokens, so every
stream through a 1P+1D mesh still equals the offline engine's tokens."""
from __future__ import annotations

import asyncio
import random

from common.engine import LLM, SamplingParams
from tests.integration.conftest import ENGINE, engine_stats
from tests.integration.test_mesh import assert_no_blocks_in_use, request, stream

FEW_BLOCKS = {"num_blocks": 40, "max_num_seqs": 32, "max_model_len": 640}


def test_preempted_remote_prefills_give_the_offline_tokens(tiny_model, start_mesh):
    model = tiny_model("llama")
    rng = random.Random(41)
    prompts = [[rng.randrange(3, 1000) for _ in range(100)] for _ in range(16)]
    params = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(model), **ENGINE).generate(
        [{"prompt_token_ids": p} for p in prompts], params)]
    mesh = start_mesh(model, top={"engine": FEW_BLOCKS})

    async def run():
        return await asyncio.gather(*(stream(mesh.gateway_address, request(p, max_tokens=96)) for p in prompts))

    results = asyncio.run(run())
    decode = engine_stats(mesh.services["decode-0"].address, "decode")
    assert decode.preemptions > 0
    assert all(msgs[0].prefill_timing.remote for _, _, msgs in results)
    for i, ((tokens, _, _), expected) in enumerate(zip(results, want)):
        assert tokens == expected, f"stream {i}"
    assert_no_blocks_in_use(mesh)
    mesh.stop()
