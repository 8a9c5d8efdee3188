"""What an evaluation asks of a model: tokenize a text, and score token windows
(teacher-forced: the log-probability of each token after the first, given the tokens
before it), in this process or through a running mesh.

    scorer = EngineScorer(LLM(model))           # or GatewayScorer("host:port", api_key=...)
    ids = scorer.encode(text)                   # the tokenizer's own special tokens only
    rows = scorer.score([[5, 6, 7], [8, 9]])    # [[logp(6|5), logp(7|5 6)], [logp(9|8)]]

Both go through the engine's prompt logprobs (SamplingParams.prompt_logprobs=0, one
greedy token sampled and dropped): in-process through LLM.generate, over the mesh in a
Generate request whose first message carries them (the decode node computes the prompt
itself). A window needs len + 1 <= max_model_len (`max_window`).
Not thread-safe; GatewayScorer opens a channel per call (asyncio.run).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Encoded:
    """A text's token ids, and the ids the tokenizer's post-processor added (e.g. a BOS):
    what encode(add_special_tokens=True) has beyond encode(add_special_tokens=False)."""

    token_ids: list[int]
    special_ids: list[int]


def _special(with_special: list[int], plain: list[int]) -> list[int]:
    """The ids with_special has around plain (a prefix and/or a suffix)."""
    for start in range(len(with_special) - len(plain) + 1):
        if with_special[start:start + len(plain)] == plain:
            return with_special[:start] + with_special[start + len(plain):]
    return list(with_special)


class EngineScorer:
    """Scores through an LLM in this process, `batch` windows a generate call."""

    def __init__(self, llm, batch: int = 8):
        self.llm, self.batch = llm, batch
        engine = llm.engine
        self.model = str(Path(engine.config.model))
        self.model_id = engine.model_id
        self.dtype = str(engine.dtype).removeprefix("torch.")
        self.max_window = engine.max_model_len - 1
        self.tokenizer = f"{self.model}/tokenizer.json"

    def encode(self, text: str) -> Encoded:
        ids = self.llm.tokenizer.encode(text, add_special_tokens=True)
        return Encoded(ids, _special(ids, self.llm.tokenizer.encode(text, add_special_tokens=False)))

    def score(self, windows: list[list[int]]) -> list[list[float]]:
        from common.engine import SamplingParams
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
        rows: list[list[float]] = []
        for at in range(0, len(windows), self.batch):
            group = windows[at:at + self.batch]
            outs = self.llm.generate([{"prompt_token_ids": w} for w in group], params)
            rows.extend(_actual(w, out.prompt_logprobs) for w, out in zip(group, outs))
        return rows


class GatewayScorer:
    """Scores through a mesh's gateway: Tokenize, then one Generate a window,
    `concurrency` at a time. api_key / tls: as services/security/client_creds.py finds them."""

    def __init__(self, address: str, api_key: str | None = None, tls=None, concurrency: int = 4,
                 timeout_s: float = 600.0):
        self.address, self.api_key, self.tls = address, api_key, tls
        self.concurrency, self.timeout_s = concurrency, timeout_s
        info = asyncio.run(self._call(self._list_models))
        self.model = f"gateway {address}"
        self.model_id = info.id
        self.dtype = "the mesh's"
        self.max_window = info.max_model_len - 1
        self.tokenizer = f"the gateway's ({info.id})"

    def _channel(self):
        from services.security.client_auth import client_channel
        return client_channel(self.address, bearer=self.api_key, tls=self.tls)

    async def _call(self, fn, *args):
        from protos.pdmesh.v1 import gateway_pb2_grpc
        async with self._channel() as channel:
            return await fn(gateway_pb2_grpc.GatewayStub(channel), *args)

    async def _list_models(self, stub):
        from protos.pdmesh.v1 import gateway_pb2
        reply = await stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=self.timeout_s)
        return reply.models[0]

    def encode(self, text: str) -> Encoded:
        async def both(stub):
            from protos.pdmesh.v1 import gateway_pb2
            ids = [list((await stub.Tokenize(gateway_pb2.TokenizeRequest(text=text, add_special_tokens=special),
                                             timeout=self.timeout_s)).token_ids) for special in (True, False)]
            return Encoded(ids[0], _special(ids[0], ids[1]))
        return asyncio.run(self._call(both))

    def score(self, windows: list[list[int]]) -> list[list[float]]:
        return asyncio.run(self._call(self._score_all, windows))

    async def _score_all(self, stub, windows: list[list[int]]) -> list[list[float]]:
        from protos.pdmesh.v1 import common_pb2, gateway_pb2
        from services.convert import prompt_logprobs_from_proto
        gate = asyncio.Semaphore(self.concurrency)

        async def one(window: list[int]) -> list[float]:
            sampling = common_pb2.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
            req = gateway_pb2.GenerateRequest(sampling=sampling)
            req.prompt_token_ids.ids.extend(window)
            async with gate:
                msgs = [m async for m in stub.Generate(req, timeout=self.timeout_s)]
            return _actual(window, prompt_logprobs_from_proto(msgs[0].prompt_logprobs))

        return list(await asyncio.gather(*(one(w) for w in windows)))


def _actual(window: list[int], prompt_logprobs: list[dict[int, float] | None] | None) -> list[float]:
    """logp of window[i + 1] for each i, from a prompt_logprobs list; ValueError when it
    does not cover the window."""
    if prompt_logprobs is None or len(prompt_logprobs) != len(window):
        got = None if prompt_logprobs is None else len(prompt_logprobs)
        raise ValueError(f"prompt_logprobs has {got} entries for a window of {len(window)} tokens")
    return [prompt_logprobs[i][t] for i, t in enumerate(window) if i > 0]
