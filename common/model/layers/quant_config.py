"""A checkpoint's quantization config: which linear method each projection gets (vLLM's
QuantizationConfig -> LinearMethod). The model asks once per Linear with the checkpoint
names of its parts; a fused layer (qkv, gate_up) is one matmul, so its parts must share
one scheme, else the load stops with the names and their types. formats/quantization.py
reads the config from the checkpoint."""
from __future__ import annotations

from abc import ABC, abstractmethod

from common.model.layers.float_linear import FloatLinearMethod
from common.model.layers.linear import LinearMethod


class QuantizationConfig(ABC):
    name: str = ""
    kv_cache_int8: bool = False    # C8: an int8 KV cache, its scales in the checkpoint (layers/kv_cache_int8.py)

    @abstractmethod
    def scheme_of(self, projection: str) -> str:
        """The quantization type of one checkpoint projection (its full tensor prefix, e.g.
        "model.layers.0.self_attn.q_proj"), e.g. "FLOAT"."""

    @abstractmethod
    def method_for(self, scheme: str) -> LinearMethod:
        """The linear method of a scheme that scheme_of returned."""

    def linear_method(self, projections: list[str]) -> LinearMethod:
        """The method of a Linear fusing these projections; ValueError naming each and its
        type when they differ."""
        schemes = {p: self.scheme_of(p) for p in projections}
        if len(set(schemes.values())) > 1:
            shown = ", ".join(f"{p}={s}" for p, s in schemes.items())
            raise ValueError(f"{self.name}: fused projections must share one quantization type "
                             f"(they are one matmul); got {shown}")
        return self.method_for(schemes[projections[0]])


class FloatConfig(QuantizationConfig):
    """An unquantized checkpoint (or a GGUF file, dequantized at load)."""

    name = "float"

    def __init__(self):
        self._method = FloatLinearMethod()

    def scheme_of(self, projection: str) -> str:
        return "FLOAT"

    def method_for(self, scheme: str) -> LinearMethod:
        return self._method
