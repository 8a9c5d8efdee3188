"""services/gateway/openai_http/errors.py: the gRPC path's failures in OpenAI's error
shape, with the HTTP status, the field a 400 is about, and nothing internal."""
from __future__ import annotations

import grpc
import pytest

from services.gateway import public_errors
from services.gateway.openai_http.errors import from_public, param_of, unauthenticated
from services.gateway.public_errors import PublicError

S = grpc.StatusCode


@pytest.mark.parametrize("code,status,error_type", [
    (S.INVALID_ARGUMENT, 400, "invalid_request_error"),
    (S.UNAUTHENTICATED, 401, "invalid_request_error"),
    (S.NOT_FOUND, 404, "invalid_request_error"),
    (S.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
    (S.UNAVAILABLE, 503, "service_unavailable_error"),
    (S.DEADLINE_EXCEEDED, 504, "timeout_error"),
    (S.INTERNAL, 500, "server_error"),
    (S.UNKNOWN, 500, "server_error"),
])
def test_status_codes_map_to_http(code, status, error_type):
    error = from_public(PublicError(code, "what the client is told"))
    assert (error.status, error.type) == (status, error_type)
    assert error.body() == {"error": {"message": "what the client is told", "type": error_type,
                                      "param": None, "code": None}}


def test_unknown_model_is_404_model_not_found():
    error = from_public(PublicError(S.INVALID_ARGUMENT, "model 'gpt-4' is not served here; available: ['m']",
                                    public_errors.UNKNOWN_MODEL))
    assert (error.status, error.param, error.code) == (404, "model", "model_not_found")


@pytest.mark.parametrize("message,param", [
    ("max_tokens must be an integer >= 1, got 0", "max_tokens"),
    ("prompt length (2) + max_tokens (5000) = 5002 must be <= max_model_len (2048)", "max_tokens"),
    ("prompt must not be empty", "prompt"),
    ("prompt is 2000000 bytes; the limit is limits.max_prompt_bytes = 1048576", "prompt"),
    ("prompt_token_ids[1]=999999 is outside the vocabulary [0, 1024)", "prompt"),
    ("sampling.stop[0] is 1000 bytes; the limit is limits.max_stop_string_bytes = 256", "stop"),
    ("sampling.stop has 20 strings; the limit is limits.max_stop_strings = 16", "stop"),
    ("temperature must be a finite number, got inf", "temperature"),
    ("top_p must be in (0, 1], got 1.5", "top_p"),
    ("stop_token_ids[0]=5000 is outside the vocabulary [0, 1024)", "stop_token_ids"),
    ("request_id is 300 bytes; the limit is limits.max_request_id_bytes = 256", None),
    ("one of prompt or prompt_token_ids is required", None),
])
def test_a_400_names_the_http_field(message, param):
    assert param_of(message) == param
    error = from_public(PublicError(S.INVALID_ARGUMENT, message))
    assert (error.status, error.param, error.message) == (400, param, message)


def test_the_chat_endpoint_names_messages_for_the_prompt():
    renames = {"prompt": "messages", "max_tokens": "max_completion_tokens"}
    assert param_of("prompt_token_ids[3]=9 is outside the vocabulary [0, 4)", renames) == "messages"
    assert param_of("prompt length (9) + max_tokens (4000) = 4009 must be <= max_model_len (2048)",
                    renames) == "max_completion_tokens"


def test_mesh_and_internal_errors_carry_only_the_public_sentence(caplog):
    mesh = public_errors.mesh_error(S.UNAVAILABLE, public_errors.NO_DECODE_NODE,
                                    "decode node decode-0 at 10.0.0.7:50071: UNAVAILABLE Socket closed")
    body = from_public(mesh).body()["error"]
    assert body["message"].startswith(public_errors.NO_DECODE_NODE + " (error id ")
    assert "10.0.0.7" not in str(body) and "decode-0" not in str(body)
    try:
        raise KeyError("internal detail")
    except KeyError:
        internal = public_errors.internal_error("test")
    body = from_public(internal).body()["error"]
    assert body["type"] == "server_error" and "KeyError" not in str(body) and "internal detail" not in str(body)


def test_unauthenticated_is_401_invalid_api_key():
    error = unauthenticated()
    assert (error.status, error.code) == (401, "invalid_api_key")
    assert "Authorization: Bearer" in error.message
