"""The gateway's bounds on one public request and its public errors, exactly: a real
GatewayServicer and meta-server in one process over real gRPC, fake decode nodes (real
gRPC servers) that stream a token every TOKEN_S or fail as told (tests/gateway_mesh.py).

- Each limit (limits.*) refused with INVALID_ARGUMENT and the exact message naming the
  field and the limit; non-finite temperature/top_p and invalid UTF-8 (named field) too.
- No message to a client carries an address, a node id, a Python class name or gRPC core
  text; the mesh's failures come with an error id that the log has with the details.
- Tokenization runs off the event loop: a prompt over the limit never reaches the
  tokenizer; while a large allowed one is tokenized, concurrent streams keep getting
  tokens and a small prompt is served.
"""
from __future__ import annotations

import asyncio
import logging
import math
import re
import threading
import time

import grpc
import pytest

from common.config import LimitsConfig
from common.engine.sampling_params import SamplingParams
from common.engine.validation import validate_request
from common.model.tokenizer import Tokenizer
from protos.pdmesh.v1 import gateway_pb2
from services.gateway.servicer import GatewayServicer
from services.gateway.tokenizer_pool import TokenizerPool
from tests.gateway_mesh import FakeDecode, Mesh
from tests.gateway_requests import SMALL, request

pytestmark = pytest.mark.timeout(120)
HANG_GUARD_S = 30.0     # a wait's bound: only catches a hang, never a slow host
INTERNAL_TEXT = re.compile(r"ipv4:|ipv6:|127\.0\.0\.1|decode-\d|<class|Traceback|Error\b|Exception|"
                           r"StatusCode|debug_error_string|failed to connect|RpcError")
ERROR_ID = re.compile(r"\(error id ([0-9a-f]{8})\)$")


class TokenizerSpy:
    """Records the length of every text the gateway tokenizes (in its pool, or on the
    tokenizer itself); a text of hold_from characters or more is encoded again and again
    for MIN_WORK_S at least (a window long enough that a stream quiet through it means a
    blocked event loop, not a scheduler hiccup), timed (`window`: start and end of the
    tokenizer's work), then kept in the pool (`holding`) until `release` is set
    (HANG_GUARD_S at most)."""

    MIN_WORK_S = 2.0

    def __init__(self, gateway: GatewayServicer, hold_from: int | None = None):
        self.lengths: list[int] = []
        self.window: tuple[float, float] | None = None
        self.hold_from, self.holding = hold_from, False
        self.started, self.release = threading.Event(), threading.Event()
        pool, tokenizer = gateway.tokenizer_pool, gateway.tokenizer
        encode_in_pool, encode = pool._encode, tokenizer.encode

        def in_pool(text, add_special_tokens):
            self.lengths.append(len(text))
            if self.hold_from is None or len(text) < self.hold_from:
                return encode_in_pool(text, add_special_tokens)
            self.holding = True
            self.started.set()
            start = time.monotonic()
            ids = encode_in_pool(text, add_special_tokens)
            while time.monotonic() - start < self.MIN_WORK_S:
                encode_in_pool(text, add_special_tokens)
            self.window = (start, time.monotonic())
            self.release.wait(HANG_GUARD_S)
            self.holding = False
            return ids

        def on_tokenizer(text, *args, **kwargs):
            self.lengths.append(len(text))
            return encode(text, *args, **kwargs)

        pool._encode, tokenizer.encode = in_pool, on_tokenizer


def assert_public(details: str) -> None:
    """Fit for a public client: no address, node id, Python class or gRPC core text."""
    assert details and not INTERNAL_TEXT.search(details), details


async def refused(mesh: Mesh, req) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await mesh.generate(req)
    return err.value


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


# ---- each limit ------------------------------------------------------------------------
OVER_LIMITS = [
    (request(prompt="x" * 1001), "prompt is 1001 bytes; the limit is limits.max_prompt_bytes = 1000"),
    (request(prompt="é" * 501), "prompt is 1002 bytes; the limit is limits.max_prompt_bytes = 1000"),
    (request(ids=[5] * 101), "prompt_token_ids has 101 ids; the limit is limits.max_prompt_token_ids = 100"),
    (request(stop=["a", "b", "c", "d", "e"]), {   # the wire stops counting at the first one over
        "wire": "sampling.stop has more than 4 strings; the limit is limits.max_stop_strings = 4",
        "generated": "sampling.stop has 5 strings; the limit is limits.max_stop_strings = 4"}),
    (request(stop=["a", "b" * 17]), "sampling.stop[1] is 17 bytes; the limit is limits.max_stop_string_bytes = 16"),
    (request(stop_token_ids=list(range(9))),
     "sampling.stop_token_ids has 9 ids; the limit is limits.max_stop_token_ids = 8"),
    (request(request_id="r" * 33), "request_id is 33 bytes; the limit is limits.max_request_id_bytes = 32"),
    (request(temperature=math.inf), "temperature must be a finite number, got inf"),
    (request(temperature=1e39), "temperature must be a finite number, got inf"),   # float32 on the wire
    (request(temperature=math.nan), "temperature must be a finite number, got nan"),
    (request(top_p=math.nan), "top_p must be a finite number, got nan"),
    (request(top_p=math.inf), "top_p must be a finite number, got inf"),
    (request(top_p=-math.inf), "top_p must be a finite number, got -inf"),
]


@pytest.mark.parametrize("register", ["wire", "generated"])
def test_each_limit_is_invalid_argument_naming_the_field_and_the_limit(model, register):
    async def scenario():
        async with Mesh(model, SMALL, FakeDecode(), register=register) as mesh:
            got = [(await refused(mesh, req)) for req, _ in OVER_LIMITS]
            at_limits = request(prompt="x" * 1000, request_id="r" * 32, stop=["a" * 16] * 4,
                                stop_token_ids=list(range(8)))
            ok = await mesh.generate(at_limits)   # exactly at every limit: served
            ok_ids = await mesh.generate(request(ids=[5] * 100))
            return got, ok, ok_ids

    got, ok, ok_ids = asyncio.run(scenario())
    for err, (_, message) in zip(got, OVER_LIMITS):
        message = message[register] if isinstance(message, dict) else message
        assert (err.code(), err.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)
        assert_public(err.details())
    assert [t for m in ok for t in m.token_ids] == [10, 11, 12, 13] and ok[-1].finish_reason == "length"
    assert ok_ids[-1].usage.prompt_tokens == 100


@pytest.mark.parametrize("register", ["wire", "generated"])
def test_a_10_mb_prompt_and_tokenize_text_are_refused_by_the_default_limits(model, register):
    async def scenario():
        async with Mesh(model, LimitsConfig(), FakeDecode(), register=register) as mesh:
            spy = TokenizerSpy(mesh.gateway)
            gen = await refused(mesh, request(prompt="x" * (10 << 20)))
            with pytest.raises(grpc.aio.AioRpcError) as tok:
                await mesh.stub.Tokenize(gateway_pb2.TokenizeRequest(text="y" * (10 << 20)), timeout=30)
            tokenized_before_small = list(spy.lengths)
            small = await mesh.stub.Tokenize(gateway_pb2.TokenizeRequest(text="hello world"))
            return gen, tok.value, list(small.token_ids), tokenized_before_small, spy.lengths

    gen, tok, small, tokenized_before_small, tokenized = asyncio.run(scenario())
    assert gen.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert gen.details() == "prompt is 10485760 bytes; the limit is limits.max_prompt_bytes = 1048576"
    assert tokenized_before_small == []   # neither reached the tokenizer (the old gateway's took 14-27 s)
    assert len("hello world") in tokenized   # what does reach it, the spy sees
    assert tok.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert tok.details() == "text is 10485760 bytes; the limit is limits.max_prompt_bytes = 1048576"
    assert small == Tokenizer.from_dir(model).encode("hello world", add_special_tokens=False)


def test_a_long_model_name_is_not_echoed_whole(model):
    async def scenario():
        async with Mesh(model, LimitsConfig(), FakeDecode()) as mesh:
            req = request()
            req.model = "m" * 100_000
            return await refused(mesh, req)

    err = asyncio.run(scenario())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "model is 100000 bytes; a model id is at most 1024"   # read off the wire


def test_an_unknown_model_is_echoed_cut_short(model):
    async def scenario():
        async with Mesh(model, LimitsConfig(), FakeDecode()) as mesh:
            req = request()
            req.model = "m" * 200
            return await refused(mesh, req)

    err = asyncio.run(scenario())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == f"model {'m' * 64!r}... (200 bytes) is not served here; available: ['tiny']"


# ---- invalid UTF-8 -----------------------------------------------------------------------
def _with_bad_byte(msg, marker: bytes) -> bytes:
    """msg serialized, with the one occurrence of `marker` changed to invalid UTF-8."""
    data = msg.SerializeToString()
    assert data.count(marker) == 1
    return data.replace(marker, b"\xff" + marker[1:])


@pytest.mark.parametrize("method,msg,marker,field", [
    ("Generate", request(prompt="MARK here"), b"MARK", "prompt"),
    ("Generate", request(stop=["fine", "MARK"]), b"MARK", "sampling.stop[1]"),
    ("Generate", request(request_id="MARK-1"), b"MARK", "request_id"),
    ("Generate", gateway_pb2.GenerateRequest(model="MARK", prompt="hi"), b"MARK", "model"),
    ("Tokenize", gateway_pb2.TokenizeRequest(text="some MARK text"), b"MARK", "text"),
])
def test_invalid_utf8_is_invalid_argument_naming_the_field(model, method, msg, marker, field):
    async def scenario():
        async with Mesh(model, LimitsConfig(), FakeDecode()) as mesh:
            err = await mesh.raw(method, _with_bad_byte(msg, marker))
            garbage = await mesh.raw(method, b"\x0a\xff\xff\xff\xff\x0f")   # a length past the end
            ok = await mesh.generate(request())   # the gateway goes on
            return err, garbage, ok

    err, garbage, ok = asyncio.run(scenario())
    assert (err.code(), err.details()) == (grpc.StatusCode.INVALID_ARGUMENT, f"{field} is not valid UTF-8")
    assert garbage.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert garbage.details() == f"the request is not a valid pdmesh.v1.{type(msg).__name__} message"
    assert ok[-1].finish_reason == "length"


@pytest.mark.parametrize("fail,code,message", [
    (None, grpc.StatusCode.UNAVAILABLE, "no decode node is available now; retry later"),
    ((grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: UNKNOWN: "
      "ipv4:127.0.0.1:51060: Failed to connect to remote host: Connection refused"),
     grpc.StatusCode.UNAVAILABLE, "no decode node is available now; retry later"),
    ((grpc.StatusCode.RESOURCE_EXHAUSTED, "decode node decode-0 has 64 requests waiting; retry later"),
     grpc.StatusCode.RESOURCE_EXHAUSTED, "every decode node is busy now; retry later"),
    ((grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"),
     grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed"),
    ((grpc.StatusCode.INTERNAL, "Unexpected <class 'KeyError'>: 'ipv4:127.0.0.1:9'"),
     grpc.StatusCode.UNAVAILABLE, "the decode node serving the request failed; retry later"),
])
def test_mesh_errors_are_plain_words_with_an_error_id_the_log_has(model, caplog, fail, code, message):
    async def scenario():
        decode = None if fail is None else FakeDecode(fail)
        async with Mesh(model, LimitsConfig(), decode) as mesh:
            return await refused(mesh, request(request_id="client-7"))

    with caplog.at_level(logging.WARNING, logger="pdmesh.gateway"):
        err = asyncio.run(scenario())
    assert err.code() == code
    found = ERROR_ID.search(err.details())
    assert found and err.details() == f"{message} (error id {found.group(1)})"
    assert_public(err.details())
    logged = [r.getMessage() for r in caplog.records if found.group(1) in r.getMessage()]
    assert len(logged) == 1 and "'client-7'" in logged[0]
    if fail is not None:
        assert fail[1] in logged[0] and "decode-0" in logged[0]   # the details, for the operator


def test_an_unexpected_exception_is_internal_with_the_traceback_only_in_the_log(model, caplog):
    async def scenario():
        async with Mesh(model, LimitsConfig(), FakeDecode()) as mesh:
            async def broken(ids, deadline=None):
                raise KeyError("ipv4:127.0.0.1:1 <class 'x'>")
            mesh.gateway._block_hashes = broken
            return await refused(mesh, request())

    with caplog.at_level(logging.WARNING, logger="pdmesh.gateway"):
        err = asyncio.run(scenario())
    assert err.code() == grpc.StatusCode.INTERNAL
    found = ERROR_ID.search(err.details())
    assert found and err.details() == f"internal error (error id {found.group(1)})"
    records = [r for r in caplog.records if found.group(1) in r.getMessage()]
    assert len(records) == 1 and records[0].exc_info is not None
    assert records[0].exc_info[0] is KeyError


# ---- tokenization off the event loop ------------------------------------------------------
def test_streams_keep_their_tokens_while_huge_prompts_are_refused_and_tokenized(model):
    """4 streams run while (a) a 10 MB prompt is refused by limits.max_prompt_bytes, never
    tokenized, and (b) a 3 MB prompt within a raised limit is tokenized (then refused by
    max_model_len): every stream gets tokens while the tokenizer works on it (on the event
    loop, as the old gateway did, or holding the GIL, none could), and a small text prompt
    is served while the big one is still in the pool (held there until then)."""
    limits = LimitsConfig(max_prompt_bytes=6 << 20, tokenizer_threads=2)
    big = ("the quick brown fox jumps over the lazy dog; " * 80_000)[: 3 << 20]

    async def scenario():
        async with Mesh(model, limits, FakeDecode(), max_model_len=100_000) as mesh:
            spy = TokenizerSpy(mesh.gateway, hold_from=len(big))
            arrivals: list[list[float]] = [[] for _ in range(4)]

            async def stream(i):
                call = mesh.stub.Generate(request(max_tokens=50_000), timeout=120)
                async for _ in call:
                    arrivals[i].append(time.monotonic())

            streams = [asyncio.ensure_future(stream(i)) for i in range(4)]
            while not all(arrivals):
                await asyncio.sleep(0.01)
            huge = await refused(mesh, request(prompt="x" * (10 << 20)))
            huge_tokenized = (10 << 20) in spy.lengths

            tokenized = asyncio.ensure_future(refused(mesh, request(prompt=big)))
            try:
                assert await asyncio.to_thread(spy.started.wait, HANG_GUARD_S), "the big prompt never reached the pool"
                small_msgs = await mesh.generate(request(prompt="hello world", max_tokens=3),
                                                 timeout=2 * HANG_GUARD_S)   # queued behind: the hold ends first
                small_while_big_held = spy.holding
            finally:
                spy.release.set()
            allowed = await tokenized
            for s in streams:
                s.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
            start, end = spy.window
            middle = (start + 0.1 * (end - start), end - 0.1 * (end - start))   # inside the tokenizer's call
            during = [sum(middle[0] < t < middle[1] for t in ts) for ts in arrivals]
            return huge, huge_tokenized, allowed, small_msgs, small_while_big_held, during, end - start

    huge, huge_tokenized, allowed, small_msgs, small_while_big_held, during, tokenize_s = asyncio.run(scenario())
    print(f"tokenizing the big prompt took {tokenize_s:.2f} s; tokens each stream got meanwhile: {during}")
    assert huge.code() == grpc.StatusCode.INVALID_ARGUMENT and "limits.max_prompt_bytes" in huge.details()
    assert not huge_tokenized
    assert allowed.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_model_len (100000)" in allowed.details()
    assert small_msgs[-1].finish_reason == "length" and small_while_big_held
    assert all(during), f"a stream got no token while the tokenizer ran ({tokenize_s:.2f} s): {during}"


def test_the_pool_tokenizes_exactly_as_the_tokenizer(model):
    tok = Tokenizer.from_dir(model)
    texts = ["hello world", "  leading spaces and\ttabs\n", "héllo wörld 中文 🙂 ünïcödé", "x" * 5000, "a"]

    async def scenario():
        pool = TokenizerPool(tok, 2)
        try:
            return [await pool.encode(t, special) for t in texts for special in (True, False)]
        finally:
            pool.close()

    assert asyncio.run(scenario()) == [tok.encode(t, add_special_tokens=s) for t in texts for s in (True, False)]


@pytest.mark.parametrize("params,message", [
    (SamplingParams(temperature=math.inf), "temperature must be a finite number, got inf"),
    (SamplingParams(top_p=math.nan), "top_p must be a finite number, got nan"),
])
def test_engine_validation_refuses_non_finite_sampling_too(params, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_request([5, 6], params, 1024, 512)
