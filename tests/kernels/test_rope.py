"""rope_inv_freq against transformers' rope init functions (bit-exact), and its errors."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from kernels import rope_cos_sin, rope_inv_freq

LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def _hf_inv_freq(head_dim: int, theta: float, rope_scaling: dict | None):
    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                         rope_theta=theta, rope_scaling=dict(rope_scaling or {}) or None)
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope_type](config)


@pytest.mark.parametrize("head_dim,theta", [(64, 10000.0), (128, 500000.0), (96, 1e6)])
@pytest.mark.parametrize("rope_scaling", [
    None, {"rope_type": "default"}, {"rope_type": "linear", "factor": 2.0},
    {"type": "linear", "factor": 8.0}, LLAMA3,
    dict(LLAMA3, factor=8.0, original_max_position_embeddings=256)])
def test_inv_freq_matches_transformers(head_dim, theta, rope_scaling):
    expected, attention_scaling = _hf_inv_freq(head_dim, theta, rope_scaling)
    got = rope_inv_freq(head_dim, theta, rope_scaling)
    assert attention_scaling == 1.0
    assert got.dtype == torch.float32 and torch.equal(got, expected)


def test_cos_sin_tables():
    inv_freq = rope_inv_freq(64, 10000.0)
    cos, sin = rope_cos_sin(inv_freq, 4096, dtype=torch.bfloat16)
    assert cos.shape == sin.shape == (4096, 32) and cos.dtype == torch.bfloat16
    freqs = torch.arange(4096, dtype=torch.float64)[:, None] * inv_freq.double()[None]
    torch.testing.assert_close(cos.double(), freqs.cos(), atol=4e-3, rtol=0)
    torch.testing.assert_close(sin.double(), freqs.sin(), atol=4e-3, rtol=0)


@pytest.mark.parametrize("rope_scaling,match", [
    ({"rope_type": "yarn", "factor": 4.0}, "rope_type='yarn'.*default, linear, llama3"),
    ({"type": "dynamic", "factor": 4.0}, "rope_type='dynamic'"),
    ({"rope_type": "linear"}, "rope_scaling.factor"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
     "rope_scaling.original_max_position_embeddings"),
])
def test_unsupported_scaling_is_a_value_error(rope_scaling, match):
    with pytest.raises(ValueError, match=match):
        rope_inv_freq(64, 10000.0, rope_scaling)
