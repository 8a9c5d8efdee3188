"""The Gateway's method handlers, with request parsing that answers INVALID_ARGUMENT.

A proto3 `string` field must be valid UTF-8: protobuf refuses to parse a message with
one that is not (DecodeError), and gRPC answers a request_deserializer that raises with
UNKNOWN "Unexpected <class 'google.protobuf.message.DecodeError'>: ..." before the
servicer sees the call. Here the deserializer never raises: a request that does not
parse becomes a BadRequest, whose message names the field ("sampling.stop[2] is not
valid UTF-8"), and the servicer ends the call with INVALID_ARGUMENT and that message.

Before parsing, the deserializer reads the request's sizes off the wire
(services/gateway/wire_limits.py): one over its limit is a BadRequest with
request_limits' message, so a 10 MB prompt is refused without being parsed, checked for
UTF-8 or copied into a str. (request_limits checks them again on the parsed message, with
every other bound, for a servicer registered without this module.)

`add_gateway_to_server(servicer, server)` registers the servicer as
gateway_pb2_grpc.add_GatewayServicer_to_server does, with these deserializers and the
servicer's limits.
"""
from __future__ import annotations

import functools
from typing import Callable

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from protos.pdmesh.v1 import gateway_pb2
from services.gateway.wire_limits import NotMessage, check_generate_wire, check_tokenize_wire, read_varint

SERVICE = "pdmesh.v1.Gateway"
MAX_UTF8_WALK_FIELDS = 10_000   # ~10 ms of walking at most; beyond: "not a valid message"


class BadRequest:
    """Stands in for a request refused before it was parsed; `message` is for the client."""

    __slots__ = ("message",)

    def __init__(self, message: str):
        self.message = message


def tolerant_deserializer(message_cls, precheck: Callable[[memoryview], str | None] | None = None
                          ) -> Callable[[bytes], object]:
    """message_cls.FromString, or a BadRequest instead of raising; precheck(bytes) -> the
    message refusing them before they are parsed, or None."""
    def deserialize(data: bytes):
        if precheck is not None:
            refused = precheck(memoryview(data))
            if refused is not None:
                return BadRequest(refused)
        try:
            return message_cls.FromString(data)
        except Exception:   # DecodeError, or whatever else hostile bytes make the parser raise
            field = bad_utf8_field(memoryview(data), message_cls.DESCRIPTOR)
            if field is not None:
                return BadRequest(f"{field} is not valid UTF-8")
            return BadRequest(f"the request is not a valid {message_cls.DESCRIPTOR.full_name} message")
    deserialize.never_raises = True   # services/node/malformed_requests.py leaves it alone
    return deserialize


def bad_utf8_field(data: memoryview, descriptor: Descriptor) -> str | None:
    """The path of the first string field of `data` (a serialized `descriptor` message)
    whose bytes are not UTF-8, e.g. "sampling.stop[2]"; None if there is none, the bytes
    are not a message, or they have more than MAX_UTF8_WALK_FIELDS fields (in messages
    with strings: TokenIds is skipped whole)."""
    try:
        return _bad_utf8_field(data, descriptor, "", [MAX_UTF8_WALK_FIELDS])
    except NotMessage:
        return None


def _bad_utf8_field(data: memoryview, descriptor: Descriptor, prefix: str, budget: list[int]) -> str | None:
    pos, end, seen = 0, len(data), {}
    while pos < end:
        budget[0] -= 1
        if budget[0] < 0:
            raise NotMessage
        key, pos = read_varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, pos = read_varint(data, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == 2:
            size, pos = read_varint(data, pos)
            chunk, pos = data[pos:pos + size], pos + size
            field = descriptor.fields_by_number.get(number)
            if field is None:
                continue
            name = prefix + field.name
            if field.is_repeated:
                seen[number] = seen.get(number, -1) + 1
                name += f"[{seen[number]}]"
            if field.type == FieldDescriptor.TYPE_STRING:
                try:
                    str(chunk, "utf-8")
                except UnicodeDecodeError:
                    return name
            elif field.type == FieldDescriptor.TYPE_MESSAGE and _has_strings(field.message_type):
                found = _bad_utf8_field(chunk, field.message_type, name + ".", budget)
                if found is not None:
                    return found
        else:
            raise NotMessage   # groups (proto2 only) or garbage
    return None


@functools.cache
def _has_strings(descriptor: Descriptor) -> bool:
    """Whether a message of this type can hold a string (the protos have no recursive type)."""
    return any(f.type == FieldDescriptor.TYPE_STRING
               or (f.type == FieldDescriptor.TYPE_MESSAGE and _has_strings(f.message_type))
               for f in descriptor.fields)


def add_gateway_to_server(servicer, server: grpc.aio.Server) -> None:
    """Register `servicer` (a GatewayServicer: its .limits) for pdmesh.v1.Gateway on `server`."""
    limits, max_model_len = servicer.limits, servicer.max_model_len

    def generate(data: memoryview) -> str | None:
        return check_generate_wire(data, limits, max_model_len)

    def tokenize(data: memoryview) -> str | None:
        return check_tokenize_wire(data, limits)

    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=tolerant_deserializer(gateway_pb2.GenerateRequest, generate),
            response_serializer=gateway_pb2.GenerateResponse.SerializeToString),
        "Tokenize": grpc.unary_unary_rpc_method_handler(
            servicer.Tokenize, request_deserializer=tolerant_deserializer(gateway_pb2.TokenizeRequest, tokenize),
            response_serializer=gateway_pb2.TokenizeResponse.SerializeToString),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            servicer.ListModels, request_deserializer=tolerant_deserializer(gateway_pb2.ListModelsRequest),
            response_serializer=gateway_pb2.ListModelsResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
