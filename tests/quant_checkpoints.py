"""Quantized checkpoints written from a float model folder, in the exact layout of the
tool that makes them, and a float64 reference of each scheme's math.

compressed-tensors W8A8 (llm-compressor's `W8A8` preset, format `int-quantized`): every
decoder projection's `weight` becomes int8 codes, symmetric per output channel with
compressed-tensors' scale max|w| / 127.5, next to `weight_scale` [out, 1] in the model's
dtype; activations are quantized per token at run time; `lm_head` stays float.

compressed-tensors W4A16 (format `pack-quantized`): `weight_packed` int32 [out, in / 8]
(code j at bits 4 * (j % 8), stored as q + 8), `weight_scale` [out, in / group] with the
scale max|w| / 7.5 of each group, `weight_shape` [2].
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


def w4a16_config(group_size: int) -> dict:
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                            "group_size": group_size, "dynamic": False, "observer": "minmax"},
                "input_activations": None, "output_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


def is_projection(name: str) -> bool:
    return name.endswith(".weight") and name.rsplit(".", 2)[-2] in PROJECTIONS


def quantize_per_channel(weight: torch.Tensor, divisor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes and the scale [out, 1] (weight's dtype) of symmetric per-row quantization."""
    w = weight.double()
    scale = (w.abs().amax(dim=1, keepdim=True) / divisor).clamp_min(1e-12).to(weight.dtype)   # as the file holds it
    codes = torch.round(w / scale.double()).clamp(-128, 127).to(torch.int8)
    return codes, scale


def quantize_per_group(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 codes (in int8, -8..7) and the scale [out, in / group] of symmetric per-group
    quantization with compressed-tensors' divisor 7.5."""
    w = weight.double()
    groups = w.reshape(w.shape[0], -1, group_size)
    scale = (groups.abs().amax(dim=-1) / 7.5).clamp_min(1e-12).to(weight.dtype)   # as the file holds it
    codes = torch.round(groups / scale.double().unsqueeze(-1)).clamp(-8, 7).reshape(w.shape).to(torch.int8)
    return codes, scale


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes -8..7 [rows, cols] -> int32 [rows, cols / 8], code j at bits 4 * (j % 8) as q + 8."""
    stored = (codes.to(torch.int64) + 8).reshape(codes.shape[0], -1, 8)
    words = (stored << torch.arange(0, 32, 4, dtype=torch.int64)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def dequantized_w4a16(tensors: dict, name: str, group_size: int) -> torch.Tensor:
    """float64 weight of a W4A16 projection (name: its `....weight`) from its own tensors."""
    prefix = name[:-len("weight")]
    packed = tensors[prefix + "weight_packed"].to(torch.int64) & 0xFFFFFFFF
    codes = ((packed.unsqueeze(-1) >> torch.arange(0, 32, 4)) & 0xF).reshape(packed.shape[0], -1) - 8
    return codes.double() * tensors[prefix + "weight_scale"].double().repeat_interleave(group_size, dim=1)


def _rewrite(float_dir: Path, out_dir: Path, projection, quantization_config: dict) -> Path:
    """A copy of float_dir with each projection weight replaced by projection(name, weight)'s
    tensors (name: the weight's prefix, e.g. "model.layers.0.mlp.up_proj.") and config.json
    given quantization_config."""
    out_dir = Path(out_dir)
    shutil.copytree(float_dir, out_dir, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors = {}
    for path in sorted(Path(float_dir).glob("*.safetensors")):
        tensors.update(load_file(path))
    out = {}
    for name, tensor in tensors.items():
        if is_projection(name):
            out.update(projection(name[:-len("weight")], tensor))
        else:
            out[name] = tensor
    save_file(out, out_dir / "model.safetensors")
    cfg = json.loads((out_dir / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return out_dir


def write_compressed_tensors_w4a16(float_dir: Path, out_dir: Path, group_size: int) -> Path:
    """A copy of float_dir with its projections W4A16-quantized (groups of group_size inputs)."""
    def projection(prefix: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        codes, scale = quantize_per_group(weight, group_size)
        return {prefix + "weight_packed": pack_int4(codes), prefix + "weight_scale": scale,
                prefix + "weight_shape": torch.tensor(weight.shape, dtype=torch.int64)}

    return _rewrite(float_dir, out_dir, projection, w4a16_config(group_size))


def _float64_model(quant_dir: Path, state: dict[str, torch.Tensor]):
    """transformers' model of quant_dir's architecture (its quantization_config dropped) in
    float64 with state loaded; every tensor taken, only a tied lm_head may be missing."""
    import transformers
    hf_cfg = transformers.AutoConfig.from_pretrained(quant_dir)
    del hf_cfg.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).double().eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"} and (not missing or hf_cfg.tie_word_embeddings)
    return model


def w4a16_reference_model(quant_dir: Path, group_size: int):
    """transformers' model of quant_dir's architecture in float64 on the dequantized weights."""
    tensors = load_file(Path(quant_dir) / "model.safetensors")
    state = {}
    for name, tensor in tensors.items():
        if name.endswith("weight_packed"):
            weight_name = name[:-len("weight_packed")] + "weight"
            state[weight_name] = dequantized_w4a16(tensors, weight_name, group_size)
        elif not name.endswith(("weight_scale", "weight_shape")):
            state[name] = tensor.double()
    return _float64_model(quant_dir, state)


def write_compressed_tensors_w8a8(float_dir: Path, out_dir: Path, config: dict | None = None) -> Path:
    """A copy of float_dir (one safetensors file) with its projections W8A8-quantized."""
    def projection(prefix: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        codes, scale = quantize_per_channel(weight, CT_DIVISOR)
        return {prefix + "weight": codes, prefix + "weight_scale": scale}

    return _rewrite(float_dir, out_dir, projection, config or W8A8_CONFIG)


def fake_quant_per_token(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """x's rows quantized to int8 symmetric per token and back, in x's dtype."""
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / divisor, torch.ones_like(amax))
    return torch.round(x / scale).clamp(-128, 127) * scale


ROW_PARALLEL = ("o_proj", "down_proj")


def w8a8_reference_model(quant_dir: Path, divisor: float = CT_DIVISOR, tensor_parallel_size: int = 1):
    """transformers' model of quant_dir's float architecture in float64, each projection
    computing the scheme's math: y = fakequant_token(x) @ (codes * scale)^T + b. At
    tensor_parallel_size n a row-parallel projection (o, down) quantizes each of its n
    equal column shares of a token on its own, as the ranks do."""
    tensors = load_file(Path(quant_dir) / "model.safetensors")
    state = {}
    for name, tensor in tensors.items():
        if name.endswith(".weight_scale"):
            continue
        if is_projection(name):
            tensor = tensor.double() * tensors[name[:-len("weight")] + "weight_scale"].double()
        state[name] = tensor.double()
    model = _float64_model(quant_dir, state)

    def per_rank(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([fake_quant_per_token(part, divisor) for part in x.chunk(tensor_parallel_size, dim=-1)],
                         dim=-1)

    for name, module in model.named_modules():
        kind = name.rsplit(".", 1)[-1]
        if kind in ROW_PARALLEL:
            module.register_forward_pre_hook(lambda _m, args: (per_rank(args[0]),))
        elif kind in PROJECTIONS:
            module.register_forward_pre_hook(lambda _m, args: (fake_quant_per_token(args[0], divisor),))
    return model


def kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per position of two log-probability tensors [..., vocab]."""
    return (p_log.exp() * (p_log - q_log)).sum(-1)


# engine arguments under which a quantized model is checked against its float64 reference
ENGINE_CASES = [dict(kernel_backend="ref"), dict(kernel_backend="cpu"),
                dict(kernel_backend="cpu", tensor_parallel_size=2), dict(kernel_backend="npu", block_size=128)]
ENGINE_CASE_IDS = ["ref", "cpu", "cpu-tp2", "npu"]
