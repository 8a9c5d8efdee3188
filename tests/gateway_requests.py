"""GenerateRequests for the gateway's limit tests, and limits small enough to pass in them."""
from __future__ import annotations

from common.config import LimitsConfig
from protos.pdmesh.v1 import common_pb2, gateway_pb2

SMALL = LimitsConfig(max_prompt_bytes=1000, max_prompt_token_ids=100, max_stop_strings=4,
                     max_stop_string_bytes=16, max_stop_token_ids=8, max_request_id_bytes=32)


def request(ids=None, prompt=None, max_tokens=4, request_id="", **sampling) -> gateway_pb2.GenerateRequest:
    req = gateway_pb2.GenerateRequest(request_id=request_id,
                                      sampling=common_pb2.SamplingParams(max_tokens=max_tokens, **sampling))
    if prompt is not None:
        req.prompt = prompt
    else:
        req.prompt_token_ids.ids.extend([5, 6, 7] if ids is None else ids)
    return req
