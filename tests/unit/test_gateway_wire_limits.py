"""The gateway's bounds read off a request's wire bytes before protobuf parses it
(services/gateway/wire_limits.py): sizes, counts of packed and unpacked ids, fields
past the walk's bound, a singular field sent many times, the ids against max_model_len."""
from __future__ import annotations

import pytest

from common.config import LimitsConfig
from common.transfer.grpc_wire import encode_varint
from protos.pdmesh.v1 import common_pb2, gateway_pb2
from services.gateway import wire_limits
from services.gateway.wire import BadRequest, tolerant_deserializer
from services.gateway.wire_limits import check_generate_wire, check_tokenize_wire
from tests.gateway_requests import SMALL, request


@pytest.fixture
def varints_read(monkeypatch) -> list[int]:
    """[n]: the varints the wire walk has read, keys and lengths (its work in Python);
    what it bounds without reading one by one, it counts in C."""
    reads = [0]
    read = wire_limits.read_varint

    def counted(data, pos):
        reads[0] += 1
        return read(data, pos)
    monkeypatch.setattr(wire_limits, "read_varint", counted)
    return reads


def test_the_wire_refuses_an_oversized_prompt_before_parsing_it():
    parse = tolerant_deserializer(gateway_pb2.GenerateRequest, lambda data: check_generate_wire(data, SMALL))
    over = request(prompt="x" * 1001).SerializeToString()
    message = "prompt is 1001 bytes; the limit is limits.max_prompt_bytes = 1000"
    assert isinstance(parse(over), BadRequest) and parse(over).message == message
    assert parse(over.replace(b"x", b"\xff", 1)).message == message   # never parsed: its size first
    assert parse(request(prompt="x" * 1000).SerializeToString()).prompt == "x" * 1000
    assert parse(over[:500]).message == "the request is not a valid pdmesh.v1.GenerateRequest message"


def _unpacked_ids(field_number: int, ids: list[int]) -> bytes:
    """ids as repeated varint fields (proto2's encoding; proto3 encoders pack them)."""
    return b"".join(bytes([field_number << 3, i]) for i in ids)


def test_huge_repeated_fields_are_refused_before_parsing(varints_read):
    """Parsing 10M ids holds the event loop ~0.4 s; read off the wire they are counted in C."""
    def check(req: bytes) -> str | None:
        return check_generate_wire(memoryview(req), LimitsConfig())

    ids = request(ids=[1000] * 10_000_000).SerializeToString()   # 20 MB
    assert check(ids) == "prompt_token_ids has 10000000 ids; the limit is limits.max_prompt_token_ids = 1048576"
    assert varints_read[0] < 10     # keys and lengths: none of the 10M ids read one by one
    stop_ids = request(stop_token_ids=[7] * 1_000_000).SerializeToString()
    assert check(stop_ids) == ("sampling.stop_token_ids has 1000000 ids; "
                               "the limit is limits.max_stop_token_ids = 256")
    unpacked = gateway_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=4)).SerializeToString()
    sampling = common_pb2.SamplingParams(max_tokens=4).SerializeToString() + _unpacked_ids(7, [1] * 300)
    assert check(b"\x22" + encode_varint(len(sampling)) + sampling) == (
        "sampling.stop_token_ids has more than 256 ids; the limit is limits.max_stop_token_ids = 256")
    token_ids = _unpacked_ids(1, [5] * 600_000)                   # over 1 MiB, unpacked
    assert check(b"\x1a" + encode_varint(len(token_ids)) + token_ids) == "prompt_token_ids has more than 64 fields"
    assert check(unpacked + b"\x38\x01" * 100) == "the request has more than 64 fields"   # unknown field 7
    stops = request(stop=["s"] * 10_000).SerializeToString()
    assert check(stops) == "sampling.stop has more than 16 strings; the limit is limits.max_stop_strings = 16"
    assert check(request(ids=[1000] * 100_000, stop=["s"] * 16, stop_token_ids=[3] * 256).SerializeToString()) is None


def test_a_singular_field_sent_many_times_is_refused_before_parsing(varints_read):
    """Protobuf merges or replaces repeated occurrences of a singular field, so 60 copies
    of 1 MiB of ids (63 MB, under the 64 MiB message cap) would each pass a per-copy check
    and cost the parser 63 MB; a second occurrence is refused off the wire at once."""
    def check(req: bytes, max_model_len=None) -> str | None:
        return check_generate_wire(memoryview(req), LimitsConfig(), max_model_len)

    one = request(ids=[1] * ((1 << 20) - 1)).SerializeToString()
    assert check(one) is None
    per_copy, varints_read[0] = varints_read[0], 0
    assert check(one * 60) == "prompt_token_ids appears more than once in the request"
    assert varints_read[0] <= 2 * per_copy     # it stopped in the second copy: the other 58 never read
    assert check(request(prompt="x" * 1000).SerializeToString() * 3) == "prompt appears more than once in the request"
    sampling = gateway_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(stop=["s"] * 16)).SerializeToString()
    assert check(sampling * 4) == "sampling appears more than once in the request"
    assert check(one, max_model_len=2048) == (
        f"prompt_token_ids has {(1 << 20) - 1} ids; a prompt must be shorter than max_model_len (2048)")
    model = gateway_pb2.GenerateRequest(model="m" * 2000, prompt="hi").SerializeToString()
    assert check(model) == "model is 2000 bytes; a model id is at most 1024"
    tokenize = gateway_pb2.TokenizeRequest(text="hello").SerializeToString()
    assert check_tokenize_wire(memoryview(tokenize * 2), LimitsConfig()) == "text appears more than once in the request"
