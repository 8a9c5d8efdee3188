"""Which quantization a checkpoint uses, from its own files:

    config.json "quantization_config"      compressed-tensors, GPTQ, AWQ, fp8, ... (HF)
    quant_model_description.json           Ascend msModelSlim (config.json says nothing)
    neither, or a .gguf file               float (GGUF blocks are dequantized at load)

A scheme the engine cannot run is refused here, at load, with the file and the scheme
named: read as float, its int8 codes and scales would be garbage or a pile of
"unexpected tensor" errors.
"""
from __future__ import annotations

import json
from pathlib import Path

from common.model.formats import is_gguf
from common.model.formats.msmodelslim import DESCRIPTION
from common.model.layers.quant_config import FloatConfig, QuantizationConfig

SUPPORTED = ("float", "compressed-tensors", "msmodelslim")


def quantization_of(model_dir: str | Path) -> str:
    """"float", or the scheme named by the checkpoint (e.g. "compressed-tensors",
    "msmodelslim"); ValueError naming the file when it cannot be read."""
    root = Path(model_dir)
    if is_gguf(root):
        return "float"
    if (root / DESCRIPTION).is_file():
        return "msmodelslim"
    others = sorted(root.glob("quant_model_description*.json"))
    if others:
        raise ValueError(f"{others[0]}: msModelSlim descriptions are read from {DESCRIPTION} (vLLM-Ascend's "
                         f"name); rename it")
    config = root / "config.json"
    if config.is_file():
        try:
            quant = json.loads(config.read_text()).get("quantization_config")
        except json.JSONDecodeError as e:
            raise ValueError(f"{config}: invalid JSON ({e})") from None
        if quant:
            method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else "unknown"
            return str(method)
    return "float"


def quantization_config(model_dir: str | Path, w8a8_mix_path: str = "dynamic") -> QuantizationConfig:
    """The checkpoint's QuantizationConfig; ValueError naming the model and its scheme when
    the engine has no linear method for it. w8a8_mix_path: the path of an msModelSlim
    W8A8_MIX checkpoint's layers ("static" or "dynamic")."""
    scheme = quantization_of(model_dir)
    if scheme == "float":
        return FloatConfig()
    if scheme == "msmodelslim":
        from common.model.formats.msmodelslim import msmodelslim_config
        return msmodelslim_config(model_dir, w8a8_mix_path)
    if scheme == "compressed-tensors":
        from common.model.formats.compressed_tensors import CompressedTensorsConfig
        config = Path(model_dir) / "config.json"
        return CompressedTensorsConfig(json.loads(config.read_text())["quantization_config"], str(config))
    raise ValueError(f"{model_dir}: quantization {scheme!r} is not supported; supported: {list(SUPPORTED)} "
                     f"(float: float32, bfloat16 or float16 safetensors, or GGUF)")
