"""hypothesis strategies of the RPC fuzz test: GenerateRequests valid and not, any message
of a descriptor, raw bytes (invalid UTF-8, garbage, truncation), requests coherent enough
to reach the deeper paths, and the calls of each service."""
from __future__ import annotations

from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor as F
from hypothesis import strategies as st

from protos.pdmesh.v1 import common_pb2, engine_pb2, gateway_pb2, kv_store_pb2, weights_pb2
from tests.fuzz_mesh import CREDENTIALS, LIMITS, MAX_MODEL_LEN, MODEL_ID, Mesh, SEEN, SERVICES, VOCAB


# ---- strategies ---------------------------------------------------------------------
WEIRD = st.sampled_from(["\x00", "\u202e\u202d", "\ufeff", "\U0001f600" * 8, "a\u0301" * 20, "\U0010ffff",
                         "\r\n\t", "\u0085\u2028", "<|endoftext|>", "</s>", "\\xff"])
TEXT = st.one_of(st.text(st.characters(exclude_categories=("Cs",)), max_size=40), WEIRD)
LONG_TEXT = st.integers(33, 5000).map(lambda n: ("zé" * n)[:n])
INT32 = st.one_of(st.integers(-3, 70), st.sampled_from([-2**31, 2**31 - 1, VOCAB - 1, VOCAB, 4096]),
                  st.integers(-2**31, 2**31 - 1))
FLOAT = st.one_of(st.sampled_from([0.0, 0.5, 1.0, 2.0, -0.5, -1.0, 1e-45, 3.4e38, 1e39]), st.floats(width=32))
MAX_TOKENS = st.one_of(st.integers(1, 4), st.sampled_from([0, -1, -2**31, 2**31 - 1, 10**6, MAX_MODEL_LEN]))
NAMES = ["", "both-0", "prefill-0", "fuzz-0", MODEL_ID, "both", "decode", "prefill", "root", "fake", "grpc",
         "round_robin", "least_load", "cache_aware", "float32", "127.0.0.1:1", "fake:1", "a" * 257]
STRING = st.one_of(st.sampled_from(NAMES), TEXT, LONG_TEXT.map(lambda s: s[:400]),
                   st.integers(1, 64).map(lambda i: SEEN[-i] if len(SEEN) >= i else ""))


def token_ids(valid: bool = False):
    good = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=60)
    if valid:
        return good
    out = st.sampled_from([-1, -2**31, VOCAB, VOCAB + 1, 2**31 - 1])
    return st.one_of(good, st.lists(st.one_of(st.integers(0, VOCAB - 1), out), max_size=60),
                     st.integers(MAX_MODEL_LEN, 400).map(lambda n: [7] * n))


def picker(draw, valid: bool):
    """pick(good, bad): a value of good when valid, else of either."""
    return lambda good, bad: draw(good if valid else st.one_of(good, bad))


@st.composite
def sampling_params(draw, valid: bool) -> common_pb2.SamplingParams:
    pick = picker(draw, valid)
    s = common_pb2.SamplingParams(max_tokens=pick(st.integers(1, 4), MAX_TOKENS),
                                  temperature=pick(st.floats(0, 2, width=32), FLOAT),
                                  top_p=pick(st.one_of(st.just(0.0), st.floats(0.125, 1, width=32)), FLOAT),
                                  top_k=pick(st.one_of(st.sampled_from([0, -1]), st.integers(1, 2 * VOCAB)), INT32),
                                  ignore_eos=draw(st.booleans()))
    if draw(st.booleans()):
        s.seed = draw(st.integers(0, 2**64 - 1))
    s.stop.extend(pick(st.lists(st.text(min_size=1, max_size=8), max_size=LIMITS.max_stop_strings),
                       st.lists(st.one_of(TEXT, LONG_TEXT.map(lambda t: t[:100])), max_size=6)))
    s.stop_token_ids.extend(pick(st.lists(st.integers(0, VOCAB - 1), max_size=LIMITS.max_stop_token_ids),
                                 st.lists(st.one_of(st.integers(0, VOCAB - 1), INT32), max_size=20)))
    return s


@st.composite
def generate_requests(draw) -> tuple[gateway_pb2.GenerateRequest, bool]:
    """(request, valid): a valid one has every field inside its bounds (and must succeed);
    the others have each field inside or outside them."""
    valid = draw(st.booleans())
    pick = picker(draw, valid)
    req = gateway_pb2.GenerateRequest(model=pick(st.sampled_from(["", MODEL_ID]), st.one_of(st.just("m" * 5000), TEXT)),
                                      request_id=pick(st.text(max_size=16), st.one_of(TEXT, LONG_TEXT)))
    which = pick(st.sampled_from(["prompt", "ids"]), st.just("none"))
    if which == "prompt":   # <= 20 characters: at most 81 tokens, so max_tokens fits in max_model_len
        req.prompt = pick(st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=20),
                          st.one_of(st.just(""), TEXT, LONG_TEXT))
    elif which == "ids":
        req.prompt_token_ids.SetInParent()
        req.prompt_token_ids.ids.extend(draw(token_ids(valid)))
    if valid or draw(st.booleans()):
        req.sampling.CopyFrom(draw(sampling_params(valid)))
    return req, valid


def _length_delimited(number: int, payload: bytes) -> bytes:
    def varint(n: int) -> bytes:
        out = bytearray()
        while True:
            out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
            n >>= 7
            if not n:
                return bytes(out)
    return varint(number << 3 | 2) + varint(len(payload)) + payload


BAD_UTF8 = st.tuples(st.binary(max_size=8), st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xc0\xaf",
                                                             b"\xf4\x90\x80\x80", b"\x80"])).map(b"".join)


def string_paths(descriptor, depth: int = 0) -> list[tuple[int, ...]]:
    """Field-number paths of every string field of a message, nested ones included."""
    paths = []
    for f in descriptor.fields:
        if f.type == F.TYPE_STRING:
            paths.append((f.number,))
        elif f.type == F.TYPE_MESSAGE and depth < 3:
            paths.extend((f.number, *p) for p in string_paths(f.message_type, depth + 1))
    return paths


def raw_bytes(messages: st.SearchStrategy, descriptor) -> st.SearchStrategy[bytes]:
    """Bytes that are not a valid message: a valid one followed by a string field (maybe
    nested) of invalid UTF-8, garbage, or a valid one truncated or with a byte changed."""
    def spliced(args):
        msg, path, payload = args
        for number in reversed(path):
            payload = _length_delimited(number, payload)
        return msg.SerializeToString() + payload

    def damaged(args):
        msg, cut, flip = args
        data = msg.SerializeToString() or b"\x0a"
        i = cut % len(data)
        return data[:i] if flip is None else data[:i] + bytes([data[i] ^ flip]) + data[i + 1:]

    strategies = [st.binary(max_size=64),
                  st.tuples(messages, st.integers(0, 10**6), st.one_of(st.none(), st.integers(1, 255))).map(damaged)]
    if string_paths(descriptor):
        strategies.append(st.tuples(messages, st.sampled_from(string_paths(descriptor)), BAD_UTF8).map(spliced))
    return st.one_of(*strategies)


def scalar(field) -> st.SearchStrategy:
    t = field.type
    if t == F.TYPE_STRING:
        return STRING
    if t == F.TYPE_BYTES:
        return st.one_of(st.binary(max_size=40), st.binary(min_size=16, max_size=16))
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_FLOAT:
        return FLOAT
    if t == F.TYPE_DOUBLE:
        return st.one_of(st.sampled_from([0.0, 1.0, -1.0, 1e308]), st.floats())
    if t in (F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32):
        return INT32
    bits = 64 if t in (F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64, F.TYPE_UINT64, F.TYPE_FIXED64) else 32
    low = -2**(bits - 1) if t in (F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64) else 0
    high = 2**(bits - 1) - 1 if low else 2**bits - 1
    assert t in (F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64, F.TYPE_UINT64, F.TYPE_FIXED64,
                 F.TYPE_UINT32, F.TYPE_FIXED32), f"no strategy for {field.full_name} (type {t})"
    return st.one_of(st.integers(max(low, -3), 70), st.sampled_from([low, high]), st.integers(low, high))


def messages(descriptor, overrides: dict | None = None, path: str = "", depth: int = 0):
    """Any message of `descriptor`: each field unset or drawn by its type, repeated ones as
    short lists, nested messages likewise. overrides: "a.b" -> a strategy of that field's
    whole value, None for unset (keeps costly fields cheap, or aims them at the mesh)."""
    overrides = overrides or {}
    fields = []
    for f in descriptor.fields:
        name = path + f.name
        if name in overrides:
            fields.append((f, True, overrides[name]))
            continue
        if f.type == F.TYPE_MESSAGE:
            value = messages(f.message_type, overrides, name + ".", depth + 1) if depth < 3 else \
                st.just(message_factory.GetMessageClass(f.message_type)())
        else:
            value = scalar(f)
        fields.append((f, False, st.lists(value, max_size=4) if f.is_repeated else value))
    cls = message_factory.GetMessageClass(descriptor)

    @st.composite
    def build(draw):
        msg = cls()
        for f, overridden, strategy in fields:
            if not overridden and not draw(st.booleans()):
                continue
            value, target = draw(strategy), getattr(msg, f.name)
            if value is None:
                continue
            if f.is_repeated and f.type == F.TYPE_MESSAGE:
                for v in value:
                    target.add().CopyFrom(v)
            elif f.is_repeated:
                target.extend(value)
            elif f.type == F.TYPE_MESSAGE:
                target.SetInParent()
                target.MergeFrom(value)
            else:
                setattr(msg, f.name, value)
        return msg
    return build()


def overrides_for(mesh: Mesh) -> dict[str, dict]:
    """Per method: fields kept cheap or aimed at the real mesh. A decode node dials a
    DecodeRequest's prefill address: only the real prefill node, a port that refuses at
    once, or none (an address that does not resolve leaves the request's blocks
    quarantined until its deadline, by design)."""
    both = mesh.both.node.node_info()
    address = st.sampled_from([mesh.addresses["prefill"], "127.0.0.1:1", ""])
    engine_request = {"sampling": st.one_of(sampling_params(True), sampling_params(False),
                                            messages(common_pb2.SamplingParams.DESCRIPTOR)),
                      "prompt_token_ids": st.one_of(token_ids(True), token_ids()),
                      "resume_position": st.one_of(st.just(0), st.integers(0, 50))}
    node_info = st.builds(
        lambda node_id, role, address, layout: common_pb2.NodeInfo(node_id=node_id, role=role, address=address,
                                                                   model_id=MODEL_ID, kv_layout=layout),
        st.one_of(st.sampled_from(["fuzz-0", "fuzz-1", "both-0", "prefill-0"]), STRING),
        st.sampled_from(["prefill", "decode", "both", "root", ""]), st.sampled_from(["127.0.0.1:1", "", "x"]),
        st.one_of(st.just(both.kv_layout), messages(common_pb2.KVLayout.DESCRIPTOR)))
    space = st.one_of(st.just(kv_store_pb2.KeySpace(model_id=MODEL_ID, layout=both.kv_layout)),
                      messages(kv_store_pb2.KeySpace.DESCRIPTOR))
    return {
        "Decode.Generate": {**engine_request, "prefill.address": address, "prefill_fallbacks.address": address},
        "Prefill.Prefill": engine_request,
        "MetaServer.Register": {"node": st.one_of(node_info, messages(common_pb2.NodeInfo.DESCRIPTOR))},
        "KVStore.Lookup": {"space": space},
        "KVStore.ReservePut": {"space": space},
        "KVStore.PinGet": {"space": space},
    }


STORE_HASHES = [bytes([i]) * 16 for i in range(4)]   # block i holds 16 tokens i


def coherent_requests(mesh: Mesh) -> dict[str, st.SearchStrategy]:
    """Per method: requests that pass its checks, to reach what lies behind them: a
    prefill into the real decode node's registered destination (it writes into that
    node's blocks, as any mesh member may), kv-store puts and gets of the real space."""
    both = mesh.both.node.node_info()
    space = kv_store_pb2.KeySpace(model_id=MODEL_ID, layout=both.kv_layout)
    blocks = st.lists(st.integers(0, len(STORE_HASHES) - 1), max_size=4)
    prompts = st.integers(1, 64).flatmap(lambda n: st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))

    def prefill(prompt, sampling, block_ids, rid):
        dest = engine_pb2.KVDestination(node_id="both-0", transfer_endpoint=both.transfer_endpoint,
                                        layout=both.kv_layout, block_ids=block_ids[:(len(prompt) + 15) // 16])
        return engine_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling, destination=dest)

    def store(cls, ids):
        msg = cls(space=space, block_hashes=[STORE_HASHES[i] for i in ids])
        if "token_ids" in cls.DESCRIPTOR.fields_by_name:
            msg.token_ids.extend(i for i in ids for _ in range(16))
        return msg

    return {
        "Prefill.Prefill": st.builds(prefill, prompts, sampling_params(True),
                                     st.lists(st.integers(0, 7), min_size=4, max_size=4), STRING),
        "KVStore.Lookup": blocks.map(lambda ids: store(kv_store_pb2.LookupRequest, ids)),
        "KVStore.ReservePut": blocks.map(lambda ids: store(kv_store_pb2.ReservePutRequest, ids)),
        "KVStore.PinGet": blocks.map(lambda ids: store(kv_store_pb2.PinGetRequest, ids)),
        "WeightSeed.OpenWeights": st.builds(
            lambda loader: weights_pb2.OpenWeightsRequest(identity=mesh.both.node.weight_seed.identity,
                                                          tensor_parallel_size=1, loader_node_id=loader), STRING),
    }


def calls_of(mesh: Mesh, service: str):
    """(method, request bytes) for any method of the service but Gateway.Generate: a third
    generic messages, a third coherent ones (where there are), a third raw bytes."""
    overrides, coherent = overrides_for(mesh), coherent_requests(mesh)
    per_method = []
    for method in SERVICES[service][0].methods:
        if method.full_name != "pdmesh.v1.Gateway.Generate":
            name = f"{service}.{method.name}"
            msgs = messages(method.input_type, overrides.get(name))
            data = st.one_of(msgs.map(lambda m: m.SerializeToString()),
                             coherent.get(name, msgs).map(lambda m: m.SerializeToString()),
                             raw_bytes(msgs, method.input_type))
            per_method.append(st.tuples(st.just(method), data))
    return st.one_of(*per_method)


def credentials_for(service: str):
    """Every credential, the one the service admits most often."""
    best = {"Gateway": "client_key", "MetaAdmin": "admin_token"}.get(service, "cluster_secret")
    return st.one_of(st.just(best), st.sampled_from(CREDENTIALS))


