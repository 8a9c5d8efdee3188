"""OpenAI's error body, from the same failures the gRPC path reports.

    {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}

    gRPC status (PublicError)                    HTTP  type
    INVALID_ARGUMENT                             400   invalid_request_error (param: the field)
      ... reason UNKNOWN_MODEL                   404   invalid_request_error, code model_not_found
    UNAUTHENTICATED (missing / unknown key)      401   invalid_request_error, code invalid_api_key
    PERMISSION_DENIED                            403   permission_error
    RESOURCE_EXHAUSTED (mesh full, tokenizer)    429   rate_limit_error
    UNAVAILABLE (no decode node, node failed)    503   service_unavailable_error
    DEADLINE_EXCEEDED                            504   timeout_error
    INTERNAL and anything else                   500   server_error
The message is the PublicError's own (fit for a public client: no address, node id or
class name; the mesh's failures carry an error id that the gateway's log has too).
`param` is the request field a 400 is about, read from the start of the gRPC path's
message ("max_tokens must be ...", "sampling.stop[0] is ... bytes") and renamed to the
HTTP field (`prompt_token_ids` -> `prompt`, or `messages` on the chat endpoint).
"""
from __future__ import annotations

import re

import grpc
from fastapi.responses import JSONResponse

from services.gateway import public_errors
from services.gateway.public_errors import PublicError

STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error",
         404: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable_error",
         504: "timeout_error"}
# the gRPC path's field names -> the HTTP API's
FIELDS = {"prompt": "prompt", "prompt_token_ids": "prompt", "max_tokens": "max_tokens",
          "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed",
          "sampling.stop": "stop", "stop": "stop", "sampling.stop_token_ids": "stop_token_ids",
          "stop_token_ids": "stop_token_ids", "model": "model", "messages": "messages",
          "logprobs": "logprobs"}
CHAT_RENAMES = {"prompt": "messages"}   # the chat endpoint's prompt is its messages
_LEADING_NAME = re.compile(r"[a-z_]+(?:\.[a-z_]+)*")


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 error_type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = error_type or TYPES.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None) -> OpenAIError:
    return OpenAIError(400, message, param)


def param_of(message: str, renames: dict[str, str] | None = None) -> str | None:
    """The HTTP field a gRPC-path message starts with, or None."""
    m = _LEADING_NAME.match(message)
    if m is None:
        return None
    name = m.group(0)
    if name == "prompt" and "max_tokens" in message:   # "prompt length (n) + max_tokens (m) ..."
        name = "max_tokens"
    field = FIELDS.get(name)
    return (renames or {}).get(field, field) if field else None


def from_public(error: PublicError, renames: dict[str, str] | None = None) -> OpenAIError:
    """The HTTP error for what the gRPC path would have ended the call with. renames:
    HTTP field renames for this endpoint (the chat endpoint: {"prompt": "messages"})."""
    if error.reason == public_errors.UNKNOWN_MODEL:
        return OpenAIError(404, error.details, "model", "model_not_found")
    status = STATUS.get(error.code, 500)
    param = param_of(error.details, renames) if status == 400 else None
    return OpenAIError(status, error.details, param)


def unauthenticated() -> OpenAIError:
    return OpenAIError(401, "missing or unknown API key: send the header `Authorization: Bearer KEY`",
                       None, "invalid_api_key")
