"""`pdmesh bench profile`: measure what one node does on this hardware with the mesh's
model and engine settings, as the NodeProfile the planner sizes pools with
(services/meta_server/planner.py; the file: services/meta_server/profile_file.py).

One engine in this process (the node's engine config, its TP ranks included), idle but for
the requests below; prompts are random token ids (seeded), the prefix cache reset before
each measurement so nothing hits:

    prefill TTFT at L        one L-token prompt, max_tokens 1: add -> its token
    prefill rate at L        enough L-token prompts to fill `FILL_STEPS` steps of
                             max_num_batched_tokens (at least 2, at most max_num_seqs),
                             added at once: prompt tokens / the time until the last token
    decode ITL at (C, B)     B prompts of C tokens added at once, run until each made
                             enough tokens that `decode_steps` steps have all B decoding
                             (and nothing else): the mean time of those steps

A point the engine cannot run (a prompt past max_model_len, B past max_num_seqs, or B
sequences of C + decode_steps tokens past the KV cache) is skipped and named in
`skipped`; ValueError when no prefill or no decode point is left. Every measured point
runs once after a warm-up request (the first step of an engine pays for allocation).

Not thread-safe; owns the engine while it runs (its requests are all finished after it).
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable

from common.engine.sampling_params import SamplingParams
from services.meta_server.planner import NodeProfile

FILL_STEPS = 4          # a throughput run spans this many full steps: one step's ramp is noise


@dataclass(frozen=True)
class ProfilePlan:
    prompt_lens: tuple[int, ...] = (128, 512, 2048)
    contexts: tuple[int, ...] = (256, 2048)
    batches: tuple[int, ...] = (1, 8, 32)
    decode_steps: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("prompt_lens", "contexts", "batches"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"{name} must be one or more integers >= 1, got {values!r}")
        if not isinstance(self.decode_steps, int) or self.decode_steps < 2:
            raise ValueError(f"decode_steps must be an integer >= 2, got {self.decode_steps!r}")


@dataclass
class ProfileResult:
    profile: NodeProfile
    skipped: list[str] = field(default_factory=list)     # points not run, and why
    seconds: float = 0.0                                  # the whole measurement


class _Runner:
    def __init__(self, engine, seed: int):
        self.engine = engine
        self.rng = random.Random(seed)
        self.num_requests = 0

    def prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(self.engine.vocab_size) for _ in range(n)]

    def add(self, prompt: list[int], max_tokens: int) -> str:
        self.num_requests += 1
        request_id = f"profile-{self.num_requests}"
        self.engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                   ignore_eos=True))
        return request_id

    def run(self, request_ids: list[str]) -> list[tuple[float, int, int]]:
        """Step until every request finished; per step, its time, how many of the requests
        got a token in it, and how many had one before it (all: the step only decoded)."""
        waiting, started = set(request_ids), set()
        steps = []
        while waiting:
            start = time.perf_counter()
            outputs = self.engine.step()
            took = time.perf_counter() - start
            got = {out.request_id for out in outputs if out.request_id in waiting and out.new_token_ids}
            steps.append((took, len(got), len(started)))
            started |= got
            for out in outputs:
                if out.finished:
                    waiting.discard(out.request_id)
            if self.engine.last_step_empty and waiting:
                raise RuntimeError(f"the engine cannot run {len(waiting)} profiling requests (no room)")
        return steps

    def fresh(self) -> None:
        self.engine.block_manager.reset_prefix_cache()


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_profile(engine, plan: ProfilePlan = ProfilePlan(), say: Callable[[str], None] = lambda _: None
                    ) -> ProfileResult:
    """engine: an idle LLMEngine (common/engine/llm_engine.py). say: one line a point."""
    started = time.perf_counter()
    r = _Runner(engine, plan.seed)
    cfg = engine.config
    skipped: list[str] = []
    r.run([r.add(r.prompt(min(16, engine.max_model_len - 1)), 2)])     # warm-up
    prefill = []
    for length in sorted(set(plan.prompt_lens)):
        if length + 1 > engine.max_model_len:
            skipped.append(f"prefill at {length} tokens: past max_model_len {engine.max_model_len}")
            continue
        r.fresh()
        ttft = _timed(lambda: r.run([r.add(r.prompt(length), 1)]))
        count = min(max(2, math.ceil(FILL_STEPS * cfg.max_num_batched_tokens / length)), cfg.max_num_seqs)
        r.fresh()
        prompts = [r.prompt(length) for _ in range(count)]
        elapsed = _timed(lambda: r.run([r.add(p, 1) for p in prompts]))
        prefill.append((length, ttft, count * length / elapsed))
        say(f"prefill {length:>6} tokens: TTFT {ttft * 1e3:8.2f} ms, {count * length / elapsed:10.0f} tokens/s "
            f"({count} prompts)")
    decode = []
    for context in sorted(set(plan.contexts)):
        for batch in sorted(set(plan.batches)):
            why = _decode_refusal(engine, context, batch, plan.decode_steps)
            if why:
                skipped.append(f"decode at context {context}, batch {batch}: {why}")
                continue
            r.fresh()
            ids = [r.add(r.prompt(context), _decode_tokens(engine, context, batch, plan.decode_steps))
                   for _ in range(batch)]
            full = [took for took, n, before in r.run(ids) if n == before == batch][:plan.decode_steps]
            if len(full) < plan.decode_steps:   # the scheduler kept the batch apart: no clean point
                skipped.append(f"decode at context {context}, batch {batch}: only {len(full)} steps had "
                               f"all {batch} sequences decoding")
                continue
            itl = sum(full) / len(full)
            decode.append((context, batch, itl))
            say(f"decode context {context:>6}, batch {batch:>4}: ITL {itl * 1e3:8.2f} ms, "
                f"{batch / itl:10.0f} tokens/s")
    r.fresh()
    if not prefill or not decode:
        raise ValueError("no " + ("prefill" if not prefill else "decode") + " point fits this engine: "
                         + "; ".join(skipped))
    return ProfileResult(NodeProfile(prefill=tuple(prefill), decode=tuple(decode)), skipped,
                         time.perf_counter() - started)


def _decode_tokens(engine, context: int, batch: int, steps: int) -> int:
    """max_tokens of a decode point's requests: `steps` full-batch steps after the steps the
    batch's prompts take (during which the first ones already decode)."""
    return steps + 1 + math.ceil(batch * context / engine.config.max_num_batched_tokens) + 1


def _decode_refusal(engine, context: int, batch: int, steps: int) -> str:
    """Why the engine cannot decode `batch` sequences of a context-token prompt at once, or ""."""
    length = context + _decode_tokens(engine, context, batch, steps)
    if length > engine.max_model_len:
        return f"{length} tokens is past max_model_len {engine.max_model_len}"
    if batch > engine.config.max_num_seqs:
        return f"past max_num_seqs {engine.config.max_num_seqs}"
    blocks = batch * math.ceil(length / engine.block_size)
    if blocks > engine.num_blocks:
        return f"needs {blocks} KV blocks, the engine has {engine.num_blocks}"
    return ""
