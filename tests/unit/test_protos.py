"""The committed generated code matches protos/*.proto, and the public API keeps its shape."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh():
    result = subprocess.run([sys.executable, "protos/compile.py", "--check"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_public_messages_have_the_documented_fields():
    from protos.pdmesh.v1 import common_pb2, gateway_pb2
    req = gateway_pb2.GenerateRequest.DESCRIPTOR
    assert [f.name for f in req.oneofs_by_name["input"].fields] == ["prompt", "prompt_token_ids"]
    assert {"request_id", "sampling"} <= set(req.fields_by_name)
    sampling = common_pb2.SamplingParams.DESCRIPTOR.fields_by_name
    assert list(sampling) == ["max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                              "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs"]
    assert sampling["seed"].has_presence and sampling["logprobs"].has_presence
    assert sampling["prompt_logprobs"].has_presence
    resp = gateway_pb2.GenerateResponse.DESCRIPTOR.fields_by_name
    assert {"token_ids", "text", "finish_reason", "usage", "logprobs", "prompt_logprobs"} <= set(resp)
    assert list(common_pb2.TokenLogprobs.DESCRIPTOR.fields_by_name) == ["token_ids", "logprobs"]
    usage = common_pb2.Usage.DESCRIPTOR.fields_by_name
    assert list(usage) == ["prompt_tokens", "completion_tokens", "cached_prompt_tokens"]
    service = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"]
    assert service.full_name == "pdmesh.v1.Gateway"
    assert [m.name for m in service.methods] == ["Generate", "Tokenize", "ListModels"]
    assert service.methods_by_name["Generate"].server_streaming
