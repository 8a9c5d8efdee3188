"""Channels that carry credentials on every call.

    mesh_channel(address)                       a service dialling another (cluster secret
                                                and, with TLS, its own certificate)
    client_channel(address, bearer=KEY, ca=PEM) a client of the gateway or the admin API
    ... sync=True                               the same as a blocking grpc.Channel

The metadata is added by a thin proxy around the channel (the stubs' multicallables get
it merged into their `metadata=`): no interceptor on the per-message path, and the call
objects are grpc's own.
"""
from __future__ import annotations

import grpc

from services.security.credentials import MeshCredentials, TLSFiles, process_credentials
from services.security.server_auth import SECRET_METADATA


class _WithMetadata:
    """A multicallable whose calls (and .future / .with_call on sync channels) carry extra."""

    def __init__(self, inner, extra: tuple[tuple[str, str], ...]):
        self._inner, self._extra = inner, extra

    def _merged(self, kwargs: dict) -> dict:
        kwargs["metadata"] = (*(kwargs.get("metadata") or ()), *self._extra)
        return kwargs

    def __call__(self, request, **kwargs):
        return self._inner(request, **self._merged(kwargs))

    def future(self, request, **kwargs):
        return self._inner.future(request, **self._merged(kwargs))

    def with_call(self, request, **kwargs):
        return self._inner.with_call(request, **self._merged(kwargs))


class AuthChannel:
    """A grpc.aio.Channel (or grpc.Channel) whose stubs send `extra` metadata on every call."""

    def __init__(self, inner, extra: tuple[tuple[str, str], ...]):
        self._inner, self._extra = inner, extra

    def unary_unary(self, *args, **kwargs):
        return _WithMetadata(self._inner.unary_unary(*args, **kwargs), self._extra)

    def unary_stream(self, *args, **kwargs):
        return _WithMetadata(self._inner.unary_stream(*args, **kwargs), self._extra)

    def stream_unary(self, *args, **kwargs):
        return _WithMetadata(self._inner.stream_unary(*args, **kwargs), self._extra)

    def stream_stream(self, *args, **kwargs):
        return _WithMetadata(self._inner.stream_stream(*args, **kwargs), self._extra)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def __aenter__(self):
        await self._inner.__aenter__()
        return self

    async def __aexit__(self, *exc):
        return await self._inner.__aexit__(*exc)

    def __enter__(self):
        self._inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)


def _raw_channel(address: str, tls: TLSFiles | None, options: list, sync: bool):
    module = grpc if sync else grpc.aio
    if tls is None:
        return module.insecure_channel(address, options=options)
    creds = grpc.ssl_channel_credentials(root_certificates=tls.ca, private_key=tls.key,
                                         certificate_chain=tls.cert)
    return module.secure_channel(address, creds, options=options)


def mesh_channel(address: str, creds: MeshCredentials | None = None, options: list | None = None,
                 sync: bool = False):
    """A channel from one mesh service to another (creds: default the process's)."""
    creds = creds or process_credentials()
    extra = ((SECRET_METADATA, creds.cluster_secret.decode()),) if creds.cluster_secret else ()
    return AuthChannel(_raw_channel(address, creds.tls, options or [], sync), extra)


def client_channel(address: str, bearer: str | bytes | None = None, tls: TLSFiles | None = None,
                   options: list | None = None, sync: bool = False):
    """A channel of a client: `authorization: Bearer <bearer>` on every call when given;
    tls: at least the CA (server TLS), plus a certificate where the port asks for one."""
    if isinstance(bearer, bytes):
        bearer = bearer.decode()
    extra = (("authorization", f"Bearer {bearer}"),) if bearer else ()
    return AuthChannel(_raw_channel(address, tls, options or [], sync), extra)


def gateway_channel(address: str, options: list | None = None):
    """A grpc.aio channel to a gateway with the client credentials found as
    services/security/client_creds.py finds them (flags aside)."""
    from services.security.client_creds import api_key, client_tls
    return client_channel(address, bearer=api_key(address=address), tls=client_tls(address=address),
                          options=options)
