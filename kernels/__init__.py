"""Paged-attention kernels behind one Backend interface (see kernels/api.py).

Importing this package loads torch only; torch_npu / flash_attn load with their backend.
"""
from kernels.api import Backend, DecodeMetadata, PrefillMetadata
from kernels.factory import get_backend, register_backend
from kernels.rope import rope_attention_factor, rope_cos_sin, rope_inv_freq

__all__ = ["Backend", "DecodeMetadata", "PrefillMetadata", "get_backend", "register_backend",
           "rope_attention_factor", "rope_cos_sin", "rope_inv_freq"]
