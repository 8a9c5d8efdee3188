"""Protobuf <-> internal types, at the edge of every servicer."""
from __future__ import annotations

from common.engine.sampling_params import SamplingParams
from protos.pdmesh.v1 import common_pb2


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Zero values mean defaults (see common.proto); the result is validated by the
    caller (SamplingParams.validate raises ValueError naming the field)."""
    return SamplingParams(
        max_tokens=msg.max_tokens,
        temperature=msg.temperature,
        top_p=msg.top_p if msg.top_p != 0.0 else 1.0,
        top_k=msg.top_k if msg.top_k != 0 else -1,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=list(msg.stop),
        stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
    )


def logprobs_to_proto(entry: dict[int, float]) -> common_pb2.TokenLogprobs:
    """The engine's logprobs of one position (sampled token first, then the top ones)."""
    return common_pb2.TokenLogprobs(token_ids=list(entry), logprobs=list(entry.values()))


def logprobs_from_proto(msg: common_pb2.TokenLogprobs) -> dict[int, float]:
    """Inverse of logprobs_to_proto; ValueError when the two lists differ in length."""
    if len(msg.token_ids) != len(msg.logprobs) or not msg.token_ids:
        raise ValueError(f"TokenLogprobs has {len(msg.token_ids)} token_ids and {len(msg.logprobs)} "
                         "logprobs; they must be as many, at least one")
    return dict(zip(msg.token_ids, msg.logprobs))


def prompt_logprobs_to_proto(entries: list[dict[int, float] | None]) -> list[common_pb2.TokenLogprobs]:
    """The engine's prompt logprobs (None at position 0, then one entry a position) as the
    wire's list: entry i is prompt position i + 1."""
    return [logprobs_to_proto(entry) for entry in entries[1:]]


def prompt_logprobs_from_proto(msgs) -> list[dict[int, float] | None]:
    """Inverse of prompt_logprobs_to_proto (None put back at position 0); ValueError as
    logprobs_from_proto."""
    return [None, *(logprobs_from_proto(m) for m in msgs)]


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> common_pb2.Usage:
    return common_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                            cached_prompt_tokens=cached)
