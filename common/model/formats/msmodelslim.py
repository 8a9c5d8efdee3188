"""Ascend msModelSlim checkpoints: `quant_model_description.json` beside the safetensors
(config.json says nothing about quantization).

The description maps every tensor name the exporter wrote to a type ("W8A8",
"W8A8_DYNAMIC", "W8A8_MIX", "FLOAT", "C8", ...), next to top-level keys (`version`,
`model_quant_type`, `group_size`, `kv_cache_type`, `metadata`, ...: non-string values are
not tensors). A projection's type is its `<name>.weight` entry (a float `.bias` is
"FLOAT" even in a quantized layer). Supported here:

    FLOAT          float weights
    W8A8           static asymmetric per-tensor activations (layers/int8_static_linear.py)
    W8A8_DYNAMIC   dynamic symmetric per-token activations, divisor 127 (layers/int8_linear.py)
    W8A8_MIX       both sets in one checkpoint; the engine's w8a8_mix_path picks one
    C8             (kv_cache_type, and the `{k,v}_proj.kv_cache_{scale,offset}` entries) an int8
                   KV cache with per-channel scales (layers/kv_cache_int8.py)

Anything else (W8A16, W4A4_*, ...) is refused at load with the tensor and
the allowed types named.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from common.model.layers.float_linear import FloatLinearMethod
from common.model.layers.int8_linear import Int8DynamicLinearMethod
from common.model.layers.int8_static_linear import (MSMODELSLIM_DIVISOR, Int8MixLinearMethod,
                                                   Int8StaticLinearMethod)
from common.model.layers.linear import LinearMethod
from common.model.layers.quant_config import QuantizationConfig

log = logging.getLogger("pdmesh.model")
DESCRIPTION = "quant_model_description.json"
LINEAR_TYPES = ("FLOAT", "W8A8", "W8A8_DYNAMIC", "W8A8_MIX")


class MsModelSlimConfig(QuantizationConfig):
    name = "msmodelslim"

    def __init__(self, description: dict, source: str, w8a8_mix_path: str = "dynamic"):
        self.source = source
        self.types = {k: v for k, v in description.items() if isinstance(v, str) and "." in k}
        kv = description.get("kv_cache_type") or description.get("kv_quant_type")
        if kv is None and "C8" in self.types.values():
            kv = "C8"
        if kv not in (None, "", "C8"):
            raise ValueError(f"{source}: kv_cache_type {kv!r} is not supported; supported: 'C8' (int8 with "
                             f"per-channel scales) or none (a float KV cache)")
        self.kv_cache_int8 = kv == "C8"
        self.mix_path = w8a8_mix_path
        self._methods: dict[str, LinearMethod] = {}

    def scheme_of(self, projection: str) -> str:
        key = projection + ".weight"
        kind = self.types.get(key)
        if kind is None:
            raise ValueError(f"{self.source}: no entry for {key!r}")
        if kind not in LINEAR_TYPES:
            raise ValueError(f"{self.source}: {key!r} has type {kind!r}, which is not supported; "
                             f"supported: {list(LINEAR_TYPES)}")
        return kind

    def method_for(self, scheme: str) -> LinearMethod:
        if scheme not in self._methods:
            if scheme == "W8A8_MIX":   # said once, when the model is built (not when the config is only read)
                log.info("W8A8_MIX checkpoint: this engine runs its %s path", self.mix_path)
            self._methods[scheme] = {
                "FLOAT": FloatLinearMethod,
                "W8A8": Int8StaticLinearMethod,
                "W8A8_DYNAMIC": lambda: Int8DynamicLinearMethod(MSMODELSLIM_DIVISOR, weight_offset=True),
                "W8A8_MIX": lambda: Int8MixLinearMethod(self.mix_path),
            }[scheme]()
        return self._methods[scheme]


def msmodelslim_config(model_dir: str | Path, w8a8_mix_path: str) -> MsModelSlimConfig:
    path = Path(model_dir) / DESCRIPTION
    try:
        description = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(description, dict):
        raise ValueError(f"{path}: must be an object mapping tensor names to types")
    return MsModelSlimConfig(description, str(path), w8a8_mix_path)


def kv_scales_id(model_dir: str | Path) -> str:
    """The identity of a C8 checkpoint's KV cache scales: "c8:" and a digest of every
    `kv_cache_scale` / `kv_cache_offset` tensor (names and bytes, in name order) of the whole
    checkpoint, so every tensor-parallel rank and every node of the model computes the same."""
    import hashlib

    from safetensors import safe_open

    from common.model.formats.safetensors import checkpoint_files
    digest = hashlib.blake2b(digest_size=8)
    found: list[tuple[str, bytes]] = []
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name.endswith((".kv_cache_scale", ".kv_cache_offset")):
                    t = f.get_tensor(name).float().contiguous()
                    found.append((name, t.numpy().tobytes()))
    for name, data in sorted(found):
        digest.update(name.encode() + b"\x00" + data)
    return "c8:" + digest.hexdigest()
