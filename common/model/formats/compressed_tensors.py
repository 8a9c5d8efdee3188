"""compressed-tensors checkpoints (llm-compressor's output): config.json's
`quantization_config` with `quant_method: "compressed-tensors"`.

    config_groups   {name: scheme} where a scheme is {targets, weights, input_activations,
                    format?}, or {preset name: [targets]} (e.g. "W8A8": ["Linear"])
    ignore          module names (or "re:<regex>", matched from the start) kept float
    format          how weights are stored (a group's own `format` overrides it)

A projection (e.g. "model.layers.0.mlp.down_proj", a Linear) takes the first group whose
targets match it ("Linear" matches every projection), unless `ignore` matches it first.
Supported schemes, checked field by field at load (anything else is refused with the
group, the field and the allowed values):

    W8A8_DYNAMIC   format int-quantized; weights int8 symmetric per channel, static;
                   input activations int8 symmetric per token, dynamic
    W4A16          format pack-quantized; weights int4 symmetric per group of inputs
                   (any group size that divides the inputs), static; activations float
"""
from __future__ import annotations

import re
from typing import Any

from common.model.layers.float_linear import FloatLinearMethod
from common.model.layers.int4_linear import Int4GroupLinearMethod
from common.model.layers.int8_linear import Int8DynamicLinearMethod
from common.model.layers.linear import LinearMethod
from common.model.layers.quant_config import QuantizationConfig

QUANT_METHOD = "compressed-tensors"
SYMMETRIC_DIVISOR = 127.5      # compressed-tensors' symmetric int8 scale: max|x| / ((127 - -128) / 2)
W8A8_WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
W8A8_ACTIVATIONS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
W4A16_WEIGHTS = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "dynamic": False}
PRESET_GROUP_SIZE = 128
PRESETS = {"W8A8": "W8A8_DYNAMIC", "INT8": "W8A8_DYNAMIC", "W4A16": f"W4A16/{PRESET_GROUP_SIZE}"}
FORMATS = ("int-quantized", "pack-quantized")


def _matches(name: str, targets: list[str]) -> bool:
    for target in targets:
        if target == "Linear" or target == name:
            return True
        if target.startswith("re:") and re.match(target[3:], name):
            return True
    return False


def _check_args(where: str, args: Any, want: dict[str, Any], supported: str) -> None:
    if not isinstance(args, dict):
        raise ValueError(f"{where} must be an object with {want}, got {args!r}")
    for key, value in want.items():
        got = args.get(key)
        if key == "dynamic" and got in (None, False) and value is False:
            continue
        if got != value:
            raise ValueError(f"{where}.{key} must be {value!r} (supported: {supported}), got {got!r}")
    if args.get("actorder") not in (None, False, "weight", "static"):
        raise ValueError(f"{where}.actorder {args.get('actorder')!r} is not supported (its weight_g_idx "
                         f"reorders the inputs); supported: null or 'weight'")


class CompressedTensorsConfig(QuantizationConfig):
    name = QUANT_METHOD

    def __init__(self, raw: dict[str, Any], source: str):
        where = f"{source}: quantization_config"
        if raw.get("kv_cache_scheme"):
            raise ValueError(f"{where}.kv_cache_scheme is not supported yet; supported: null")
        status = raw.get("quantization_status", "compressed")
        if status != "compressed":
            raise ValueError(f"{where}.quantization_status must be 'compressed' (weights stored quantized), "
                             f"got {status!r}")
        top_format = raw.get("format")
        self.ignore = list(raw.get("ignore") or [])
        self._methods: dict[str, LinearMethod] = {}
        self.groups: list[tuple[list[str], str]] = []
        groups = raw.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise ValueError(f"{where}.config_groups must name at least one group")
        for name, group in groups.items():
            self.groups.append(self._group(f"{where}.config_groups.{name}", name, group, top_format))

    @staticmethod
    def _group(where: str, name: str, group: Any, top_format: str | None) -> tuple[list[str], str]:
        """(targets, scheme) of one config group; the scheme "W8A8_DYNAMIC" or "W4A16/<group>"."""
        if isinstance(group, list):          # a preset name over its targets
            if name not in PRESETS:
                raise ValueError(f"{where}: preset {name!r} is not supported; supported: {sorted(PRESETS)}")
            return [str(t) for t in group], PRESETS[name]
        if not isinstance(group, dict):
            raise ValueError(f"{where} must be a scheme object or a list of targets")
        fmt = group.get("format") or top_format
        targets = group.get("targets")
        if not targets:
            raise ValueError(f"{where}.targets must list the modules it quantizes")
        if fmt not in FORMATS:
            raise ValueError(f"{where}: format {fmt!r} is not supported; supported: {list(FORMATS)}")
        if group.get("output_activations"):
            raise ValueError(f"{where}.output_activations is not supported; supported: null")
        if fmt == "int-quantized":
            w8a8 = "W8A8: int8 per-channel weights, dynamic per-token int8 activations"
            _check_args(f"{where}.weights", group.get("weights"), W8A8_WEIGHTS, w8a8)
            _check_args(f"{where}.input_activations", group.get("input_activations"), W8A8_ACTIVATIONS, w8a8)
            return [str(t) for t in targets], "W8A8_DYNAMIC"
        weights = group.get("weights")
        _check_args(f"{where}.weights", weights, W4A16_WEIGHTS, "W4A16: int4 symmetric per-group weights")
        if group.get("input_activations"):
            raise ValueError(f"{where}.input_activations must be null for pack-quantized (W4A16)")
        size = weights.get("group_size")
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"{where}.weights.group_size must be a positive int, got {size!r}")
        return [str(t) for t in targets], f"W4A16/{size}"

    def scheme_of(self, projection: str) -> str:
        if _matches(projection, self.ignore):
            return "FLOAT"
        for targets, scheme in self.groups:
            if _matches(projection, targets):
                return scheme
        return "FLOAT"

    def method_for(self, scheme: str) -> LinearMethod:
        method = self._methods.get(scheme)      # one per scheme: its start-up line is said once
        if method is None:
            if scheme == "FLOAT":
                method = FloatLinearMethod()
            elif scheme.startswith("W4A16/"):
                method = Int4GroupLinearMethod(int(scheme.split("/")[1]))
            else:
                method = Int8DynamicLinearMethod(SYMMETRIC_DIVISOR)
            self._methods[scheme] = method
        return method
