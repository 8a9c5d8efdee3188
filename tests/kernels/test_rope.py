"""rope_inv_freq and rope_attention_factor against transformers' rope init functions
(bit-exact), and their errors."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from kernels import rope_attention_factor, rope_cos_sin, rope_inv_freq

LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
# DeepSeek-V3's own (config.json's rope_scaling), and a plain YaRN one (Qwen2.5's long-context recipe)
DEEPSEEK_YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
                 "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
QWEN_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


def _hf_inv_freq(head_dim: int, theta: float, rope_scaling: dict | None):
    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                         rope_theta=theta, rope_scaling=dict(rope_scaling or {}) or None,
                         max_position_embeddings=163840)
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope_type](config)


@pytest.mark.parametrize("head_dim,theta", [(64, 10000.0), (128, 500000.0), (96, 1e6)])
@pytest.mark.parametrize("rope_scaling", [
    None, {"rope_type": "default"}, {"rope_type": "linear", "factor": 2.0},
    {"type": "linear", "factor": 8.0}, LLAMA3,
    dict(LLAMA3, factor=8.0, original_max_position_embeddings=256),
    DEEPSEEK_YARN, dict(DEEPSEEK_YARN, mscale=0.707, mscale_all_dim=1.0), QWEN_YARN,
    dict(QWEN_YARN, attention_factor=1.25, beta_fast=16, truncate=False)])
def test_inv_freq_matches_transformers(head_dim, theta, rope_scaling):
    expected, attention_scaling = _hf_inv_freq(head_dim, theta, rope_scaling)
    got = rope_inv_freq(head_dim, theta, rope_scaling)
    assert rope_attention_factor(rope_scaling) == attention_scaling
    assert got.dtype == torch.float32 and torch.equal(got, expected)


def test_yarn_attention_factor_values():
    # mscale == mscale_all_dim (DeepSeek-V3): the factors cancel in cos/sin (the softmax scale takes mscale**2)
    assert rope_attention_factor(DEEPSEEK_YARN) == 1.0
    assert rope_attention_factor(QWEN_YARN) == pytest.approx(0.1 * math.log(4.0) + 1.0)
    cos, sin = rope_cos_sin(rope_inv_freq(64, 1e4, QWEN_YARN), 8, attention_factor=2.0)
    plain_cos, _ = rope_cos_sin(rope_inv_freq(64, 1e4, QWEN_YARN), 8)
    assert torch.equal(cos, plain_cos * 2.0)


def test_cos_sin_tables():
    inv_freq = rope_inv_freq(64, 10000.0)
    cos, sin = rope_cos_sin(inv_freq, 4096, dtype=torch.bfloat16)
    assert cos.shape == sin.shape == (4096, 32) and cos.dtype == torch.bfloat16
    freqs = torch.arange(4096, dtype=torch.float64)[:, None] * inv_freq.double()[None]
    torch.testing.assert_close(cos.double(), freqs.cos(), atol=4e-3, rtol=0)
    torch.testing.assert_close(sin.double(), freqs.sin(), atol=4e-3, rtol=0)


@pytest.mark.parametrize("rope_scaling,match", [
    ({"rope_type": "yarn", "factor": 4.0}, "rope_scaling.original_max_position_embeddings"),
    ({"rope_type": "longrope", "factor": 4.0}, "rope_type='longrope'.*default, linear, llama3, yarn"),
    ({"type": "dynamic", "factor": 4.0}, "rope_type='dynamic'"),
    ({"rope_type": "linear"}, "rope_scaling.factor"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
     "rope_scaling.original_max_position_embeddings"),
])
def test_unsupported_scaling_is_a_value_error(rope_scaling, match):
    with pytest.raises(ValueError, match=match):
        rope_inv_freq(64, 10000.0, rope_scaling)
