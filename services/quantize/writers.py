"""Quantized checkpoints in the layouts their reference tools write (what the engine's
formats/compressed_tensors.py and formats/msmodelslim.py read, and the producers'
consumers: compressed-tensors itself, vLLM-Ascend).

A writer turns one projection (its float weight [out, in], optional bias, and the input
statistics of its Linear) into the tensors of its scheme, and at the end writes the
config (compressed-tensors: config.json's quantization_config) or the description
(msModelSlim: quant_model_description.json, every tensor named with its type).
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from services.quantize.calibration import InputStats
from services.quantize.schemes import TINY, int4_per_group, int8_per_channel, pack_int4, static_activation

CT_DIVISOR = 127.5     # compressed-tensors: (127 - -128) / 2
MS_DIVISOR = 127.0     # msModelSlim / npu_dynamic_quant


class CompressedTensorsWriter:
    """w8a8-dynamic (int-quantized) or w4a16 (pack-quantized, group_size)."""

    SCHEMES = ("w8a8-dynamic", "w4a16")

    def __init__(self, scheme: str, group_size: int = 128):
        if scheme not in self.SCHEMES:
            raise ValueError(f"--scheme {scheme} cannot be written as compressed-tensors; allowed: "
                             f"{list(self.SCHEMES)} (static W8A8 and W8A8-MIX: --format modelslim)")
        self.scheme, self.group_size = scheme, group_size
        self.weights_file = "model.safetensors"

    def projection(self, name: str, weight: torch.Tensor, bias: torch.Tensor | None, stats: InputStats | None,
                   codes: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """name: the checkpoint's projection name; stats: its input's (None: a routed
        expert's, w8a8-dynamic only); codes/scale: already quantized (GPTQ)."""
        out: dict[str, torch.Tensor] = {}
        if self.scheme == "w8a8-dynamic":
            codes, scale = int8_per_channel(weight, CT_DIVISOR)
            out[name + ".weight"], out[name + ".weight_scale"] = codes, scale.to(weight.dtype)
        else:
            if codes is None:
                codes, scale = int4_per_group(weight, self.group_size, clip=False)   # plain RTN: the baseline
            out[name + ".weight_packed"] = pack_int4(codes)
            out[name + ".weight_scale"] = scale.to(weight.dtype)
            out[name + ".weight_shape"] = torch.tensor(weight.shape, dtype=torch.int64)
        if bias is not None:
            out[name + ".bias"] = bias
        return out

    def finish(self, out_dir: Path, tensors: dict[str, torch.Tensor], float_modules: Sequence[str] = ()) -> None:
        """config.json's quantization_config; float_modules: what stayed float beside lm_head
        (module names, or "re:" patterns), its `ignore`."""
        path = out_dir / "config.json"
        config = json.loads(path.read_text())
        if self.scheme == "w8a8-dynamic":
            group = {"targets": ["Linear"], "format": "int-quantized",
                     "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                                 "dynamic": False, "group_size": None},
                     "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                           "dynamic": True},
                     "output_activations": None}
            fmt = "int-quantized"
        else:
            group = {"targets": ["Linear"], "format": "pack-quantized",
                     "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                 "group_size": self.group_size, "dynamic": False},
                     "input_activations": None, "output_activations": None}
            fmt = "pack-quantized"
        config["quantization_config"] = {"quant_method": "compressed-tensors", "format": fmt,
                                         "quantization_status": "compressed", "config_groups": {"group_0": group},
                                         "ignore": ["lm_head", *float_modules], "kv_cache_scheme": None}
        path.write_text(json.dumps(config, indent=2) + "\n")


class MsModelSlimWriter:
    """w8a8 (static), w8a8-dynamic, w8a8-mix (both sets); any of them with "+c8", or c8 alone
    (float weights): an int8 KV cache with per-channel scales."""

    SCHEMES = {"w8a8": "W8A8", "w8a8-dynamic": "W8A8_DYNAMIC", "w8a8-mix": "W8A8_MIX", "c8": "FLOAT"}

    def __init__(self, scheme: str):
        weights = "c8" if scheme == "c8" else scheme.removesuffix("+c8")
        if weights not in self.SCHEMES:
            raise ValueError(f"--scheme {scheme} cannot be written as msModelSlim here; allowed: "
                             f"{list(self.SCHEMES)}, a w8a8 scheme with +c8 (w4a16: --format compressed-tensors)")
        self.kind = self.SCHEMES[weights]
        self.weights_file = "quant_model_weights.safetensors"
        self.types: dict[str, str] = {}
        self.kv_type: str | None = None

    def kv_cache_int8(self, kv: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """C8 scales from each layer's KV ranges (max |x| per channel): symmetric, offset 0
        (vLLM-Ascend's decode reads C8 with scales alone)."""
        out: dict[str, torch.Tensor] = {}
        for i, ranges in sorted(kv.items()):
            for proj, amax in (("k_proj", ranges["k"]), ("v_proj", ranges["v"])):
                p = f"model.layers.{i}.self_attn.{proj}.kv_cache_"
                out[p + "scale"] = (amax / 127.0).clamp_min(TINY).float()
                out[p + "offset"] = torch.zeros(amax.shape[0], dtype=torch.float32)
        self.types.update({name: "C8" for name in out})
        self.kv_type = "C8"
        return out

    def projection(self, name: str, weight: torch.Tensor, bias: torch.Tensor | None, stats: InputStats | None,
                   codes: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """stats None: a routed expert's (W8A8_DYNAMIC only: static types need its input range)."""
        if self.kind == "FLOAT":
            return {name + ".weight": weight, **({name + ".bias": bias} if bias is not None else {})}
        codes, w_scale = int8_per_channel(weight, MS_DIVISOR)
        out = {name + ".weight": codes}
        if self.kind in ("W8A8", "W8A8_MIX"):
            s_x, offset = static_activation(*stats.input_range)
            deq = (s_x * w_scale[:, 0]).float()
            b = bias.double() if bias is not None else torch.zeros(weight.shape[0], dtype=torch.float64)
            quant_bias = torch.round(b / deq.double() - offset * codes.double().sum(dim=1))
            if quant_bias.abs().max() > 2**31 - 1:
                raise ValueError(f"{name}: its bias over deq_scale does not fit the int32 quant_bias "
                                 f"(a row of zero weights beside a bias?)")
            # float16 models: the float32 bits in an int64, as msModelSlim writes (and vLLM-Ascend declares)
            deq_stored = deq.view(torch.int32).to(torch.int64) if weight.dtype == torch.float16 else deq
            out.update({name + ".input_scale": torch.tensor([s_x], dtype=torch.float32),
                        name + ".input_offset": torch.tensor([offset], dtype=torch.float32),
                        name + ".quant_bias": quant_bias.to(torch.int32),
                        name + ".deq_scale": deq_stored})
        # every W8A8 type carries the weight's scale and (zero) offset, as msModelSlim writes them
        out.update({name + ".weight_scale": w_scale.float(),
                    name + ".weight_offset": torch.zeros_like(w_scale, dtype=torch.float32)})
        self.types.update({key: self.kind for key in out})
        if bias is not None:
            out[name + ".bias"] = bias
            self.types[name + ".bias"] = "FLOAT"
        return out

    def finish(self, out_dir: Path, tensors: dict[str, torch.Tensor], float_modules: Sequence[str] = ()) -> None:
        """quant_model_description.json: every tensor this writer did not quantize is FLOAT
        (float_modules among them: the description names them by tensor, not module)."""
        types = {name: self.types.get(name, "FLOAT") for name in tensors}
        description = {"version": "1.0.0", "model_quant_type": self.kind, "group_size": 0, "metadata": {},
                       **({"kv_cache_type": self.kv_type} if self.kv_type else {}), **types}
        (out_dir / "quant_model_description.json").write_text(json.dumps(description, indent=2) + "\n")


def writer_for(fmt: str, scheme: str, group_size: int):
    if fmt == "compressed-tensors":
        return CompressedTensorsWriter(scheme, group_size)
    if fmt == "modelslim":
        return MsModelSlimWriter(scheme)
    raise ValueError(f"--format must be one of ['compressed-tensors', 'modelslim'], got {fmt!r}")
