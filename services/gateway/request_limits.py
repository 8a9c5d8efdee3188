"""The bounds of one public request (common.config.LimitsConfig), checked on the parsed
message before any work: sizes are read with len() of the fields as they are, nothing is
converted, tokenized or copied first. Each check raises ValueError naming the field and
the limit ("prompt is 10485760 bytes; the limit is limits.max_prompt_bytes = 1048576").
The prompt's tokens are bounded afterwards by max_model_len (common/engine/validation.py).
"""
from __future__ import annotations

from common.config import LimitsConfig
from protos.pdmesh.v1 import gateway_pb2


def check_generate(request: gateway_pb2.GenerateRequest, limits: LimitsConfig) -> None:
    _check_bytes("request_id", request.request_id, "max_request_id_bytes", limits.max_request_id_bytes)
    which = request.WhichOneof("input")
    if which == "prompt":
        _check_bytes("prompt", request.prompt, "max_prompt_bytes", limits.max_prompt_bytes)
    elif which == "prompt_token_ids":
        _check_count("prompt_token_ids", len(request.prompt_token_ids.ids), "ids",
                     "max_prompt_token_ids", limits.max_prompt_token_ids)
    sampling = request.sampling
    _check_count("sampling.stop", len(sampling.stop), "strings", "max_stop_strings", limits.max_stop_strings)
    for i, stop in enumerate(sampling.stop):
        _check_bytes(f"sampling.stop[{i}]", stop, "max_stop_string_bytes", limits.max_stop_string_bytes)
    _check_count("sampling.stop_token_ids", len(sampling.stop_token_ids), "ids",
                 "max_stop_token_ids", limits.max_stop_token_ids)


def check_tokenize(request: gateway_pb2.TokenizeRequest, limits: LimitsConfig) -> None:
    _check_bytes("text", request.text, "max_prompt_bytes", limits.max_prompt_bytes)


def _check_bytes(field: str, value: str, limit_name: str, limit: int) -> None:
    if len(value) * 4 <= limit:   # n characters are at most 4n bytes of UTF-8
        return
    num_bytes = len(value) if value.isascii() else len(value.encode("utf-8"))   # isascii: O(1)
    if num_bytes > limit:
        raise ValueError(bytes_over_limit(field, num_bytes, limit_name, limit))


def bytes_over_limit(field: str, num_bytes: int, limit_name: str, limit: int) -> str:
    return f"{field} is {num_bytes} bytes; the limit is limits.{limit_name} = {limit}"


def _check_count(field: str, count: int, unit: str, limit_name: str, limit: int) -> None:
    if count > limit:
        raise ValueError(count_over_limit(field, count, unit, limit_name, limit))


def count_over_limit(field: str, count: int, unit: str, limit_name: str, limit: int) -> str:
    return f"{field} has {count} {unit}; the limit is limits.{limit_name} = {limit}"
