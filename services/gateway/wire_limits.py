"""The bounds of one public request, read off its wire bytes before protobuf parses it.

Parsing runs on the event loop and costs it about 35 ns per repeated id and 1 ms per MB
of string (UTF-8 check and copy): a 64 MB request of token ids would hold every stream
of the gateway for a second. So the deserializer first walks the request's fields, keys
and lengths only, and refuses what is over a limit, with request_limits' messages:

    GenerateRequest   request_id, prompt: bytes
                      prompt_token_ids.ids: count (a packed run counted by numpy: one
                        byte below 0x80 ends each varint; 20 MB in ~10 ms)
                      sampling.stop: count, and bytes of each
                      sampling.stop_token_ids: count
    TokenizeRequest   text: bytes

                      model: bytes (MAX_MODEL_BYTES)

A singular field (request_id, model, prompt, prompt_token_ids, sampling, text) may come
once: protobuf would merge or replace repeated occurrences, so 60 prompts of 1 MB each
would pass a per-occurrence check and still cost the parser 60 MB; proto3 encoders
never send one twice, so a second occurrence is refused. The ids are bounded by
max_model_len too (a prompt cannot be longer), so a request the model could never serve
is not parsed. A count refused while walking entry by entry (stop strings, unpacked stop
ids) stops at the first entry over the limit: "has more than N". Every other field is
bounded in number: MAX_OTHER_FIELDS a message (prompt_token_ids is walked only when its
bytes exceed the id limit, and then its ids must come packed, as proto3 encoders write
them), so the walk itself costs a millisecond at most. Bytes that are not a message are
left to the parser, which refuses them. What passes is checked again, with every other
bound, on the parsed message (request_limits.py).
"""
from __future__ import annotations

import numpy as np

from common.config import LimitsConfig
from common.transfer import grpc_wire
from protos.pdmesh.v1 import common_pb2, gateway_pb2
from services.gateway.request_limits import bytes_over_limit, count_over_limit

MAX_OTHER_FIELDS = 64
MAX_MODEL_BYTES = 1024      # the servicer bounds model ids at 256 characters

_GEN = gateway_pb2.GenerateRequest.DESCRIPTOR.fields_by_name
_SAMPLING = common_pb2.SamplingParams.DESCRIPTOR.fields_by_name
REQUEST_ID, PROMPT, MODEL = _GEN["request_id"].number, _GEN["prompt"].number, _GEN["model"].number
PROMPT_TOKEN_IDS, SAMPLING = _GEN["prompt_token_ids"].number, _GEN["sampling"].number
IDS = common_pb2.TokenIds.DESCRIPTOR.fields_by_name["ids"].number
STOP, STOP_TOKEN_IDS = _SAMPLING["stop"].number, _SAMPLING["stop_token_ids"].number
TEXT = gateway_pb2.TokenizeRequest.DESCRIPTOR.fields_by_name["text"].number
TOKENIZE_MODEL = gateway_pb2.TokenizeRequest.DESCRIPTOR.fields_by_name["model"].number
SINGULAR = {REQUEST_ID: "request_id", MODEL: "model", PROMPT: "prompt", PROMPT_TOKEN_IDS: "prompt_token_ids",
            SAMPLING: "sampling"}
VARINT, FIXED64, LENGTH, FIXED32 = 0, 1, 2, 5


class NotMessage(Exception):
    """The bytes are not a protobuf message: the parser says so."""


class TooManyFields(Exception):
    """A message with more fields than a real client sends: refused with this message."""


def check_generate_wire(data: memoryview, limits: LimitsConfig, max_model_len: int | None = None) -> str | None:
    """The message for the first bound `data` (a GenerateRequest) exceeds; None if none."""
    try:
        return _generate(data, limits, max_model_len)
    except TooManyFields as e:
        return str(e)
    except NotMessage:
        return None


def check_tokenize_wire(data: memoryview, limits: LimitsConfig) -> str | None:
    """The message for a TokenizeRequest over limits.max_prompt_bytes; None if not."""
    try:
        seen = set()
        for number, wire_type, start, end in _fields(data, "the request"):
            if number in (TEXT, TOKENIZE_MODEL) and wire_type == LENGTH:
                name = "text" if number == TEXT else "model"
                if number in seen:
                    return f"{name} appears more than once in the request"
                seen.add(number)
            if number == TEXT and wire_type == LENGTH and end - start > limits.max_prompt_bytes:
                return bytes_over_limit("text", end - start, "max_prompt_bytes", limits.max_prompt_bytes)
            if number == TOKENIZE_MODEL and wire_type == LENGTH and end - start > MAX_MODEL_BYTES:
                return f"model is {end - start} bytes; a model id is at most {MAX_MODEL_BYTES}"
    except TooManyFields as e:
        return str(e)
    except NotMessage:
        return None
    return None


def _generate(data: memoryview, limits: LimitsConfig, max_model_len: int | None) -> str | None:
    seen = set()
    for number, wire_type, start, end in _fields(data, "the request"):
        if wire_type != LENGTH:
            continue
        if number in SINGULAR:
            if number in seen:
                return f"{SINGULAR[number]} appears more than once in the request"
            seen.add(number)
        size = end - start
        if number == MODEL and size > MAX_MODEL_BYTES:
            return f"model is {size} bytes; a model id is at most {MAX_MODEL_BYTES}"
        if number == REQUEST_ID and size > limits.max_request_id_bytes:
            return bytes_over_limit("request_id", size, "max_request_id_bytes", limits.max_request_id_bytes)
        if number == PROMPT and size > limits.max_prompt_bytes:
            return bytes_over_limit("prompt", size, "max_prompt_bytes", limits.max_prompt_bytes)
        id_limit = min(limits.max_prompt_token_ids, max_model_len or limits.max_prompt_token_ids)
        if number == PROMPT_TOKEN_IDS and size > id_limit:   # else ids <= bytes
            refused = _token_ids(data[start:end], limits.max_prompt_token_ids, max_model_len)
            if refused is not None:
                return refused
        if number == SAMPLING:
            refused = _sampling(data[start:end], limits)
            if refused is not None:
                return refused
    return None


def _token_ids(data: memoryview, limit: int, max_model_len: int | None) -> str | None:
    count = 0
    for number, wire_type, start, end in _fields(data, "prompt_token_ids"):
        if number == IDS:
            count += _num_varints(data[start:end]) if wire_type == LENGTH else 1
    if count > limit:
        return count_over_limit("prompt_token_ids", count, "ids", "max_prompt_token_ids", limit)
    if max_model_len is not None and count > max_model_len:
        return (f"prompt_token_ids has {count} ids; a prompt must be shorter than max_model_len "
                f"({max_model_len})")
    return None


def _sampling(data: memoryview, limits: LimitsConfig) -> str | None:
    num_stop = num_stop_ids = 0
    more = limits.max_stop_strings + limits.max_stop_token_ids   # entries beyond the other fields
    for number, wire_type, start, end in _fields(data, "sampling", more):
        if number == STOP and wire_type == LENGTH:
            num_stop += 1
            if num_stop > limits.max_stop_strings:
                return (f"sampling.stop has more than {limits.max_stop_strings} strings; "
                        f"the limit is limits.max_stop_strings = {limits.max_stop_strings}")
            if end - start > limits.max_stop_string_bytes:
                return bytes_over_limit(f"sampling.stop[{num_stop - 1}]", end - start, "max_stop_string_bytes",
                                        limits.max_stop_string_bytes)
        elif number == STOP_TOKEN_IDS:
            num_stop_ids += _num_varints(data[start:end]) if wire_type == LENGTH else 1
            if num_stop_ids > limits.max_stop_token_ids and wire_type != LENGTH:
                return (f"sampling.stop_token_ids has more than {limits.max_stop_token_ids} ids; "
                        f"the limit is limits.max_stop_token_ids = {limits.max_stop_token_ids}")
    if num_stop_ids > limits.max_stop_token_ids:
        return count_over_limit("sampling.stop_token_ids", num_stop_ids, "ids", "max_stop_token_ids",
                                limits.max_stop_token_ids)
    return None


def _num_varints(packed: memoryview) -> int:
    """Varints in a packed run: its bytes below 0x80 (each ends one). No copy."""
    return int(np.count_nonzero(np.frombuffer(packed, np.uint8) < 0x80))


def _fields(data: memoryview, where: str, more: int = 0):
    """(number, wire type, start, end) of each field of `data`, [start, end) the value of
    a length-delimited one; TooManyFields past MAX_OTHER_FIELDS + more fields."""
    pos, end, num_fields = 0, len(data), 0
    while pos < end:
        num_fields += 1
        if num_fields > MAX_OTHER_FIELDS + more:
            raise TooManyFields(f"{where} has more than {MAX_OTHER_FIELDS + more} fields")
        key, pos = read_varint(data, pos)
        number, wire_type = key >> 3, key & 7
        start = pos
        if wire_type == VARINT:
            _, pos = read_varint(data, pos)
        elif wire_type == FIXED64:
            pos += 8
        elif wire_type == FIXED32:
            pos += 4
        elif wire_type == LENGTH:
            size, start = read_varint(data, pos)
            pos = start + size
        else:
            raise NotMessage
        if pos > end:
            raise NotMessage
        yield number, wire_type, start, pos


def read_varint(data: memoryview, pos: int) -> tuple[int, int]:
    """(the varint at data[pos], the position after it); NotMessage if it is not one."""
    try:
        return grpc_wire.read_varint(data, pos)
    except (ValueError, IndexError):
        raise NotMessage from None
