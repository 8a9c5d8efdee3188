"""RefBackend rms_norm and rotary against transformers' Llama modules, bit-exact in float32."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (LlamaRMSNorm, LlamaRotaryEmbedding,
                                                      apply_rotary_pos_emb)

from kernels import rope_cos_sin, rope_inv_freq
from kernels.ref import RefBackend

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 256}


def test_rms_norm_matches_llama_exactly():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(13, 96, generator=gen) * 3
    norm = LlamaRMSNorm(96, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=gen))
        expected = norm(x)
    assert torch.equal(RefBackend().rms_norm(x, norm.weight.detach(), 1e-5), expected)


def test_rms_norm_bfloat16_rounds_once():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 64, generator=gen).bfloat16()
    weight = torch.randn(64, generator=gen).bfloat16()
    out = RefBackend().rms_norm(x, weight, 1e-6)
    xf = x.double()
    expected = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, atol=0, rtol=2 ** -8)


@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3])
def test_rotary_matches_llama_exactly(rope_scaling):
    head_dim, num_heads, num_kv_heads, max_pos = 64, 4, 2, 1024
    config = LlamaConfig(hidden_size=num_heads * head_dim, num_attention_heads=num_heads,
                         num_key_value_heads=num_kv_heads, head_dim=head_dim, rope_theta=50000.0,
                         rope_scaling=dict(rope_scaling or {}) or None,
                         max_position_embeddings=max_pos)
    gen = torch.Generator().manual_seed(2)
    positions = torch.randint(0, max_pos, (37,), generator=gen)
    q = torch.randn(37, num_heads, head_dim, generator=gen) * 2
    k = torch.randn(37, num_kv_heads, head_dim, generator=gen) * 2
    cos_hf, sin_hf = LlamaRotaryEmbedding(config)(q, positions[None])
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos_hf, sin_hf)
    cos, sin = rope_cos_sin(rope_inv_freq(head_dim, 50000.0, rope_scaling), max_pos)
    assert torch.equal(cos[positions], cos_hf[0, :, :head_dim // 2])
    assert torch.equal(sin[positions], sin_hf[0, :, head_dim // 2:])
    q_out, k_out = RefBackend().rotary(positions, q, k, cos, sin)
    assert torch.equal(q_out, q_hf[0].transpose(0, 1))
    assert torch.equal(k_out, k_hf[0].transpose(0, 1))


def test_rotary_bfloat16_in_float32():
    gen = torch.Generator().manual_seed(3)
    positions = torch.tensor([0, 5, 4095, 17])
    q = torch.randn(4, 2, 32, generator=gen).bfloat16()
    k = torch.randn(4, 1, 32, generator=gen).bfloat16()
    cos, sin = rope_cos_sin(rope_inv_freq(32, 10000.0), 4096)
    q_out, k_out = RefBackend().rotary(positions, q, k, cos, sin)
    q32, k32 = RefBackend().rotary(positions, q.float(), k.float(), cos, sin)
    assert q_out.dtype == k_out.dtype == torch.bfloat16
    assert torch.equal(q_out, q32.bfloat16()) and torch.equal(k_out, k32.bfloat16())
