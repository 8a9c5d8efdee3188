"""Quantized checkpoints written from a float model folder, in the exact layout of the
tool that makes them, and a float64 reference of each scheme's math.

compressed-tensors W8A8 (llm-compressor's `W8A8` preset, format `int-quantized`): every
decoder projection's `weight` becomes int8 codes, symmetric per output channel with
compressed-tensors' scale max|w| / 127.5, next to `weight_scale` [out, 1] in the model's
dtype; activations are quantized per token at run time; `lm_head` stays float.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

CT_DIVISOR = 127.5
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

W8A8_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                    "dynamic": False, "group_size": None, "observer": "minmax"},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                              "dynamic": True, "observer": None},
        "output_activations": None,
    }},
    "ignore": ["lm_head"],
    "kv_cache_scheme": None,
}


def is_projection(name: str) -> bool:
    return name.endswith(".weight") and name.rsplit(".", 2)[-2] in PROJECTIONS


def quantize_per_channel(weight: torch.Tensor, divisor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes and the scale [out, 1] (weight's dtype) of symmetric per-row quantization."""
    w = weight.double()
    scale = (w.abs().amax(dim=1, keepdim=True) / divisor).clamp_min(1e-12)
    codes = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
    return codes, scale.to(weight.dtype)


def write_compressed_tensors_w8a8(float_dir: Path, out_dir: Path, config: dict | None = None) -> Path:
    """A copy of float_dir (one safetensors file) with its projections W8A8-quantized."""
    out_dir = Path(out_dir)
    shutil.copytree(float_dir, out_dir, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors = {}
    for path in sorted(Path(float_dir).glob("*.safetensors")):
        tensors.update(load_file(path))
    out = {}
    for name, tensor in tensors.items():
        if is_projection(name):
            codes, scale = quantize_per_channel(tensor, CT_DIVISOR)
            out[name] = codes
            out[name[:-len("weight")] + "weight_scale"] = scale
        else:
            out[name] = tensor
    save_file(out, out_dir / "model.safetensors")
    cfg = json.loads((out_dir / "config.json").read_text())
    cfg["quantization_config"] = config or W8A8_CONFIG
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return out_dir


def fake_quant_per_token(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """x's rows quantized to int8 symmetric per token and back, in x's dtype."""
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / divisor, torch.ones_like(amax))
    return torch.round(x / scale).clamp(-128, 127) * scale


def w8a8_reference_model(quant_dir: Path, divisor: float = CT_DIVISOR):
    """transformers' model of quant_dir's float architecture in float64, each projection
    computing the scheme's math: y = fakequant_token(x) @ (codes * scale)^T + b."""
    import transformers
    hf_cfg = transformers.AutoConfig.from_pretrained(quant_dir)
    del hf_cfg.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).double().eval()
    tensors = load_file(Path(quant_dir) / "model.safetensors")
    state = {}
    for name, tensor in tensors.items():
        if name.endswith(".weight_scale"):
            continue
        if is_projection(name):
            tensor = tensor.double() * tensors[name[:-len("weight")] + "weight_scale"].double()
        state[name] = tensor.double()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"} and (not missing or hf_cfg.tie_word_embeddings)
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in PROJECTIONS:
            module.register_forward_pre_hook(lambda _m, args: (fake_quant_per_token(args[0], divisor),))
    return model
