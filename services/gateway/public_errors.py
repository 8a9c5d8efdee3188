"""What a public client of pdmesh.v1.Gateway is told when its call fails.

Three kinds of failure, three kinds of message:
  its own request: INVALID_ARGUMENT naming the field and the limit, made where the check
    is (services/gateway/request_limits.py, common/engine/validation.py);
  the mesh: a decode node or the meta-server refused, failed or ran out of time. The
    client gets a plain sentence and a short random error id ("no decode node is
    available now; retry later (error id 3f2a9c1e)"); the log gets the same id with what
    happened inside (node ids, addresses, gRPC core text), so an operator finds the one
    from the other: `mesh_error`;
  a bug in the gateway: INTERNAL "internal error (error id ...)", the traceback in the
    log only: `internal_error`.
A client's message never carries an internal address, a node id, a Python class name or
gRPC core text, and never echoes more than a short prefix of what the client sent.
"""
from __future__ import annotations

import logging
import secrets

import grpc

log = logging.getLogger("pdmesh.gateway")

NO_DECODE_NODE = "no decode node is available now; retry later"
MESH_FULL = "every decode node is busy now; retry later"
NO_ROUTE = "the mesh cannot route requests now; retry later"
NODE_FAILED = "the decode node serving the request failed; retry later"
DEADLINE_PASSED = "the request's deadline passed"
ECHO_CHARS = 64


UNKNOWN_MODEL = "model_not_found"


class PublicError(Exception):
    """End the client's call with `code` and `details`; details are fit for a public client.
    reason: what the HTTP API needs beyond the gRPC code ("" or UNKNOWN_MODEL: the
    request named a model this mesh does not serve, INVALID_ARGUMENT on gRPC, 404 on
    HTTP)."""

    def __init__(self, code: grpc.StatusCode, details: str, reason: str = ""):
        super().__init__(details)
        self.code, self.details, self.reason = code, details, reason


def new_error_id() -> str:
    """8 random hex digits: the key between a client's message and the gateway's log."""
    return secrets.token_hex(4)


def mesh_error(code: grpc.StatusCode, public: str, internal: str, client_request_id: str = "") -> PublicError:
    """Log `internal` (WARNING) under a new error id; the client's error says `public`
    and the id."""
    error_id = new_error_id()
    log.warning("error id %s: %s to the client (client id %r): %s", error_id, code.name,
                client_request_id, internal)
    return PublicError(code, f"{public} (error id {error_id})")


def internal_error(what: str, client_request_id: str = "") -> PublicError:
    """INTERNAL for an unexpected exception; call it inside the `except` block, so that
    the traceback goes to the log (ERROR) under the error id."""
    error_id = new_error_id()
    log.exception("error id %s: unexpected error in %s (client id %r)", error_id, what, client_request_id)
    return PublicError(grpc.StatusCode.INTERNAL, f"internal error (error id {error_id})")


def echo(value: str) -> str:
    """repr of a client's string, cut to ECHO_CHARS characters, for a message."""
    if len(value) <= ECHO_CHARS:
        return repr(value)
    return f"{value[:ECHO_CHARS]!r}... ({len(value.encode('utf-8', 'surrogatepass'))} bytes)"
