"""The fault matrix's workload and its bookkeeping: 32 concurrent streaming requests
through the gateway (half greedy, half seeded at temperature 0.8; prompts of 20-300
tokens; max_tokens 64-200), each compared with the offline engine's tokens.

Every case owns its prompts: the lengths and sampling parameters are the same in every
case (so a case's latencies compare with the baseline's, request by request), but the
token ids are drawn from the case's salt, so no prompt of a case shares even its first
block with a prompt an earlier case sent. No node holds a case's prefixes when it
starts: the prefill node computes every prompt the router sends it, and what the case
asserts about its path cannot depend on what earlier cases left in the caches.

    work = Workload(offline_llm, salt="decode kill")   # prompts, params, expected tokens
    base = asyncio.run(baseline.run(gateway))          # uninterrupted: per-request seconds
    run = asyncio.run(work.run(gateway, fault))        # fault(progress) is awaited mid-run
    row = work.row("decode kill -9", run, base)        # the table's line; asserts exact tokens
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import grpc

from common.engine import SamplingParams
from protos.pdmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.channels import operator_channel

NUM_REQUESTS = 32
ENGINE = {"num_blocks": 1024, "max_num_seqs": 32, "max_model_len": 1024}
CLIENT_DEADLINE_S = 90.0    # a stream still open past this hangs: the case fails
SHAPE_SEED = 2026           # prompt lengths and sampling parameters, the same in every case
TOKEN_IDS = (3, 1000)       # prompt token ids are drawn from this range (no special token)


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""
    migrations: int = 0
    error: grpc.StatusCode | None = None
    details: str = ""
    seconds: float = 0.0
    remote_prefill: bool = False      # the first message's: a prefill node computed the prompt
    usage: tuple[int, int] = (0, 0)   # the last message's (prompt_tokens, completion_tokens)
    first_token_s: float | None = None  # since the request was sent


@dataclass
class Progress:
    """What the clients have seen so far (read by a fault to pick its moment)."""
    tokens: list[int] = field(default_factory=lambda: [0] * NUM_REQUESTS)
    finished: list[bool] = field(default_factory=lambda: [False] * NUM_REQUESTS)

    @property
    def total(self) -> int:
        return sum(self.tokens)

    @property
    def num_open(self) -> int:
        """Streams not finished yet (their last message not received)."""
        return self.finished.count(False)


class Workload:
    def __init__(self, llm, salt: str):
        """llm: the offline engine (common.engine.LLM) the expected tokens come from;
        salt: the case's name; two workloads of different salts share no prompt block."""
        shape = random.Random(SHAPE_SEED)
        lengths = [shape.randrange(20, 301) for _ in range(NUM_REQUESTS)]
        self.params = [SamplingParams(max_tokens=shape.randrange(64, 201), ignore_eos=True,
                                      temperature=0.0 if i % 2 == 0 else 0.8,
                                      seed=None if i % 2 == 0 else 1000 + i)
                       for i in range(NUM_REQUESTS)]
        ids = random.Random(f"{SHAPE_SEED}/{salt}")   # str seeds hash with sha512: no PYTHONHASHSEED
        self.salt = salt
        self.prompts = [[ids.randrange(*TOKEN_IDS) for _ in range(n)] for n in lengths]
        outs = llm.generate([{"prompt_token_ids": p} for p in self.prompts], self.params)
        self.expected = [o.outputs[0].token_ids for o in outs]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    def _request(self, i: int) -> gateway_pb2.GenerateRequest:
        p = self.params[i]
        sampling = common_pb2.SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature,
                                             ignore_eos=True)
        if p.seed is not None:
            sampling.seed = p.seed
        req = gateway_pb2.GenerateRequest(sampling=sampling, request_id=f"fault-{i}")
        req.prompt_token_ids.ids.extend(self.prompts[i])
        return req

    async def _one(self, stub, i: int, progress: Progress) -> Outcome:
        out, start = Outcome(), time.monotonic()
        try:
            async for msg in stub.Generate(self._request(i), timeout=CLIENT_DEADLINE_S):
                if not out.tokens:
                    out.remote_prefill = msg.prefill_timing.remote
                    out.first_token_s = time.monotonic() - start
                out.tokens.extend(msg.token_ids)
                progress.tokens[i] = len(out.tokens)
                if msg.finish_reason:
                    out.finish_reason, out.migrations = msg.finish_reason, msg.migrations
                    out.usage = (msg.usage.prompt_tokens, msg.usage.completion_tokens)
        except grpc.aio.AioRpcError as e:
            out.error, out.details = e.code(), e.details()
        progress.finished[i] = True
        out.seconds = time.monotonic() - start
        return out

    async def run(self, gateway: str, fault: Callable[[Progress], Awaitable] | None = None
                  ) -> tuple[list[Outcome], object]:
        """Every request at once; `fault(progress)` runs alongside (its result is returned)."""
        progress = Progress()
        async with operator_channel(gateway) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            streams = [asyncio.ensure_future(self._one(stub, i, progress)) for i in range(NUM_REQUESTS)]
            injected = await fault(progress) if fault is not None else None
            outcomes = await asyncio.gather(*streams)
        return outcomes, injected

    async def run_one(self, gateway: str, i: int) -> Outcome:
        """Request i alone."""
        async with operator_channel(gateway) as ch:
            return await self._one(gateway_pb2_grpc.GatewayStub(ch), i, Progress())

    def row(self, case: str, outcomes: list[Outcome], baseline: list[Outcome],
            may_fail: bool = False) -> dict:
        """The case's line of the table. Asserts: no request ran past its deadline; every
        one completed with exactly the offline tokens, or, only when may_fail (the mesh
        truly cannot serve it), failed UNAVAILABLE."""
        failed = []
        for i, (out, want) in enumerate(zip(outcomes, self.expected)):
            assert out.seconds < CLIENT_DEADLINE_S, f"{case}: request {i} hung"
            if out.error is not None:
                assert may_fail and out.error == grpc.StatusCode.UNAVAILABLE, \
                    f"{case}: request {i} failed {out.error.name}: {out.details}"
                failed.append(i)
                continue
            if out.tokens != want:
                at = next((k for k, (a, b) in enumerate(zip(out.tokens, want)) if a != b), min(len(out.tokens), len(want)))
                raise AssertionError(f"{case}: request {i} ({'greedy' if self.params[i].seed is None else 'seeded'}, "
                                     f"prompt {len(self.prompts[i])}, {len(out.tokens)} of {len(want)} tokens, "
                                     f"migrations {out.migrations}, remote prefill {out.remote_prefill}) differs "
                                     f"from the offline engine from token {at}")
            assert out.finish_reason == "length", f"{case}: request {i} ended {out.finish_reason!r}"
            assert out.usage == (len(self.prompts[i]), len(want)), f"{case}: request {i} usage {out.usage}"
        extra = [o.seconds - b.seconds for o, b in zip(outcomes, baseline) if o.error is None]
        return {"case": case, "requests": len(outcomes), "completed": len(outcomes) - len(failed),
                "migrated": sum(o.migrations > 0 for o in outcomes),
                "migrations": sum(o.migrations for o in outcomes), "failed": len(failed),
                "remote_prefills": sum(o.remote_prefill for o in outcomes if o.error is None),
                "max_extra_latency_s": round(max(extra, default=0.0), 2)}
