"""Who may call which RPC: one server interceptor on every pdmesh gRPC server.

    method                                 caller must prove
    grpc.health.v1, reflection             nothing (probes; the protos are public)
    pdmesh.v1.Gateway/*                    a client API key, when the gateway has keys
    pdmesh.v1.MetaAdmin/*                  the admin token
    everything else (internal)             the mesh's identity: the cluster secret, or a
                                           mesh-CA certificate whose CN is `service:NAME`
    ... of them the read-only stats        also the admin token (`pdmesh kv-store stats`)

Credentials travel as call metadata: `authorization: Bearer KEY` (API key, admin token)
and `x-pdmesh-cluster-secret` (services/security/client_auth.py adds it); certificates in
the TLS handshake (services/security/tls.py). Missing or wrong: UNAUTHENTICATED; a valid
credential of another kind (a client key on an admin or internal call, the admin
certificate on an internal call): PERMISSION_DENIED. Secrets are compared in constant
time and never logged; the refusal names what is missing, nothing about the mesh. A
refused call's request bytes are never parsed.
"""
from __future__ import annotations

import hmac
import inspect
import logging
import time

import grpc

from services.security.credentials import MeshCredentials

log = logging.getLogger("pdmesh.security")

SECRET_METADATA = "x-pdmesh-cluster-secret"
OPEN, PUBLIC, ADMIN, INTERNAL = "open", "public", "admin", "internal"
SERVICE_CN_PREFIX, ADMIN_CN_PREFIX = b"service:", b"admin:"
_OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
ADMIN_READABLE = frozenset({"/pdmesh.v1.KVStore/Stats", "/pdmesh.v1.Decode/GetEngineStats",
                            "/pdmesh.v1.Prefill/GetEngineStats"})


def method_kind(method: str) -> str:
    if method.startswith(_OPEN_PREFIXES):
        return OPEN
    if method.startswith("/pdmesh.v1.Gateway/"):
        return PUBLIC
    if method.startswith("/pdmesh.v1.MetaAdmin/"):
        return ADMIN
    return INTERNAL


def _matches(value: bytes | None, secret: bytes | None) -> bool:
    return value is not None and secret is not None and hmac.compare_digest(value, secret)


def _matches_any(value: bytes | None, secrets: tuple[bytes, ...]) -> bool:
    found = False
    for s in secrets:   # no early exit: the time does not tell which key matched
        found |= _matches(value, s)
    return found


def _metadata(details) -> tuple[bytes | None, bytes | None]:
    """(bearer token, cluster secret) from the call's metadata."""
    bearer = secret = None
    for key, value in details.invocation_metadata or ():
        if isinstance(value, str):
            value = value.encode("utf-8", "replace")
        if key == "authorization" and value[:7].lower() == b"bearer ":
            bearer = bearer_token(value)
        elif key == SECRET_METADATA:
            secret = value
    return bearer, secret


def public_caller_allowed(creds: MeshCredentials, bearer: bytes | None) -> bool:
    """Whether a caller of the public API (gRPC Gateway, OpenAI HTTP) holding `bearer`
    may call: the gateway has no API keys, or bearer is one of them or the admin token."""
    return not creds.api_keys or _matches_any(bearer, creds.api_keys) or _matches(bearer, creds.admin_token)


def bearer_token(authorization: bytes | None) -> bytes | None:
    """KEY of an `authorization: Bearer KEY` value (metadata or HTTP header), else None."""
    if authorization is None or authorization[:7].lower() != b"bearer ":
        return None
    return authorization[7:].strip()


class Refusal(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def _unauthenticated(what: str) -> Refusal:
    return Refusal(grpc.StatusCode.UNAUTHENTICATED, what)


def _denied(what: str) -> Refusal:
    return Refusal(grpc.StatusCode.PERMISSION_DENIED, what)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """creds: what this server checks against. tls_peers: the port asks for client
    certificates (mTLS), so an internal call may prove itself by its certificate."""

    def __init__(self, creds: MeshCredentials, tls_peers: bool = False):
        self.creds, self.tls_peers = creds, tls_peers
        self.num_refused = 0
        self._last_log = 0.0

    def _decide(self, kind: str, bearer: bytes | None, secret: bytes | None, method: str = "") -> bool:
        """True: allowed now; False: allowed if the peer's certificate says so. Raises
        Refusal."""
        c = self.creds
        is_client_key = _matches_any(bearer, c.api_keys)
        if kind == PUBLIC:
            if public_caller_allowed(c, bearer):
                return True
            raise _unauthenticated("missing or unknown API key: send metadata `authorization: Bearer KEY`")
        if kind == ADMIN:
            if c.admin_token is None:
                raise _unauthenticated("the admin API is off: this meta-server has no admin token configured")
            if _matches(bearer, c.admin_token):
                return True
            if is_client_key or _matches(secret, c.cluster_secret):
                raise _denied("this credential may not call the admin API; use the admin token")
            raise _unauthenticated("missing or wrong admin token: send metadata `authorization: Bearer TOKEN`")
        if _matches(secret, c.cluster_secret):
            return True
        if method in ADMIN_READABLE and _matches(bearer, c.admin_token):
            return True
        if self.tls_peers:
            return False
        if is_client_key or _matches(bearer, c.admin_token):
            raise _denied("internal RPC: only services of this mesh may call it")
        raise _unauthenticated("internal RPC: the mesh's identity is required")

    def _log_refusal(self, method: str, refusal: Refusal) -> None:
        self.num_refused += 1
        now = time.monotonic()
        if now - self._last_log > 10.0:   # one line per 10 s: a flood must not fill the disk
            self._last_log = now
            log.warning("refused %s: %s (%d refused so far)", method, refusal.code.name, self.num_refused)

    async def intercept_service(self, continuation, details):
        kind = method_kind(details.method)
        if kind == OPEN:
            return await continuation(details)
        try:
            allowed = self._decide(kind, *_metadata(details), details.method)
        except Refusal as refusal:
            self._log_refusal(details.method, refusal)
            handler = await continuation(details)
            return None if handler is None else _refusing(handler, refusal)
        handler = await continuation(details)
        if allowed or handler is None:
            return handler
        return _peer_checked(handler, self._check_peer, details.method)

    def _check_peer(self, context, method: str) -> Refusal | None:
        names = context.auth_context().get("x509_common_name") or []
        if any(n.startswith(SERVICE_CN_PREFIX) for n in names):
            return None
        refusal = (_denied("internal RPC: only services of this mesh may call it")
                   if any(n.startswith(ADMIN_CN_PREFIX) for n in names)
                   else _unauthenticated("internal RPC: the mesh's identity is required"))
        self._log_refusal(method, refusal)
        return refusal


SHARED_SERVICE_NAME = "service"   # the one certificate a whole mesh may share (`pdmesh certs init` without names)


def peer_service_name(context) -> str | None:
    """NAME of the caller's `service:NAME` certificate; None when the call came without
    one (cluster-secret mode) or with the shared one (it names no single service)."""
    for cn in context.auth_context().get("x509_common_name") or []:
        if cn.startswith(SERVICE_CN_PREFIX):
            name = cn[len(SERVICE_CN_PREFIX):].decode("utf-8", "replace")
            return None if name == SHARED_SERVICE_NAME else name
    return None


def _handler_like(handler, behavior, deserializer):
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(behavior, deserializer, handler.response_serializer)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(behavior, deserializer, handler.response_serializer)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(behavior, deserializer, handler.response_serializer)
    return grpc.stream_stream_rpc_method_handler(behavior, deserializer, handler.response_serializer)


def _refusing(handler, refusal: Refusal):
    """A handler of the same shape that aborts at once (request bytes left unparsed)."""
    async def refuse(request, context):
        await context.abort(refusal.code, refusal.message)
    return _handler_like(handler, refuse, None)


def _peer_checked(handler, check, method: str):
    """The handler, run only once check(context, method) finds the peer's certificate good."""
    inner = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream

    async def enforce(context) -> None:
        refusal = check(context, method)
        if refusal is not None:
            await context.abort(refusal.code, refusal.message)

    if inspect.isasyncgenfunction(inner):
        async def behavior(request, context):
            await enforce(context)
            async for reply in inner(request, context):
                yield reply
    else:
        async def behavior(request, context):
            await enforce(context)
            return await inner(request, context)
    return _handler_like(handler, behavior, handler.request_deserializer)


def _sync_refuser(refusal: Refusal):
    def refuse(request, context):
        context.abort(refusal.code, refusal.message)
    return refuse


class SyncAuthInterceptor(grpc.ServerInterceptor):
    """The same rules for a blocking grpc.Server (the `grpc` transfer backend's receiver)."""

    def __init__(self, creds: MeshCredentials, tls_peers: bool = False):
        self._rules = AuthInterceptor(creds, tls_peers)

    def intercept_service(self, continuation, details):
        kind = method_kind(details.method)
        if kind == OPEN:
            return continuation(details)
        try:
            allowed = self._rules._decide(kind, *_metadata(details), details.method)
        except Refusal as refusal:
            self._rules._log_refusal(details.method, refusal)
            handler = continuation(details)
            return None if handler is None else _handler_like(handler, _sync_refuser(refusal), None)
        handler = continuation(details)
        if allowed or handler is None:
            return handler
        inner = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
        check, method = self._rules._check_peer, details.method

        def enforce(context) -> None:
            refusal = check(context, method)
            if refusal is not None:
                context.abort(refusal.code, refusal.message)

        if inspect.isgeneratorfunction(inner) or handler.unary_stream or handler.stream_stream:
            def behavior(request, context):
                enforce(context)
                yield from inner(request, context)
        else:
            def behavior(request, context):
                enforce(context)
                return inner(request, context)
        return _handler_like(handler, behavior, handler.request_deserializer)
