"""msModelSlim checkpoints written from a float model folder in its exporter's layout (a
`quant_model_description.json` naming every tensor's type; config.json untouched), and
a float64 reference of each scheme's math computed from the written tensors.

    W8A8          weight int8 (symmetric per channel, max|w| / 127), input_scale and
                  input_offset [1] (asymmetric per tensor, min/max of the projection's
                  input over calibration prompts), quant_bias int32 [out] (the float bias
                  folded in), deq_scale [out] (float32, or its bits in an int64)
    W8A8_DYNAMIC  weight int8, weight_scale [out, 1] float32, weight_offset zeros
    W8A8_MIX      both sets
A float `bias` stays beside them, typed FLOAT, as the exporter writes it.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.quant_checkpoints import PROJECTIONS, is_projection

DIVISOR = 127.0


def calibrate(float_dir: Path, prompts: list[list[int]]) -> dict[str, tuple[float, float]]:
    """projection name (e.g. "model.layers.0.self_attn.q_proj") -> (min, max) of its input."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    ranges: dict[str, tuple[float, float]] = {}

    def hook(name):
        def record(_module, args):
            lo, hi = float(args[0].min()), float(args[0].max())
            old = ranges.get(name, (lo, hi))
            ranges[name] = (min(old[0], lo), max(old[1], hi))
        return record

    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in PROJECTIONS:
            module.register_forward_pre_hook(hook(name))
    with torch.no_grad():
        for prompt in prompts:
            model(torch.tensor([prompt]))
    return ranges


def static_input(lo: float, hi: float) -> tuple[float, float]:
    """(input_scale, input_offset) mapping [lo, hi] (widened to hold 0) onto -128..127."""
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    scale = (hi - lo) / 255.0
    offset = max(-128.0, min(127.0, round(-128.0 - lo / scale)))
    return scale, float(offset)


def write_msmodelslim(float_dir: Path, out_dir: Path, kind: str, prompts: list[list[int]],
                      deq_scale_bits: bool = False) -> Path:
    """kind: "W8A8", "W8A8_DYNAMIC" or "W8A8_MIX"; deq_scale_bits: deq_scale stored as
    float32 bits in int64 (what the exporter writes for a float16 model)."""
    out_dir = Path(out_dir)
    shutil.copytree(float_dir, out_dir, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors = {}
    for path in sorted(Path(float_dir).glob("*.safetensors")):
        tensors.update(load_file(path))
    ranges = calibrate(float_dir, prompts) if kind != "W8A8_DYNAMIC" else {}
    out: dict[str, torch.Tensor] = {}
    types: dict[str, str] = {}
    for name, tensor in tensors.items():
        if not is_projection(name):
            out[name], types[name] = tensor, "FLOAT"
            continue
        prefix = name[:-len("weight")]
        w = tensor.double()
        w_scale = (w.abs().amax(dim=1, keepdim=True) / DIVISOR).clamp_min(1e-12)
        codes = torch.round(w / w_scale).clamp(-128, 127)
        layer = {"weight": codes.to(torch.int8)}
        if kind in ("W8A8", "W8A8_MIX"):
            s_x, off = static_input(*ranges[prefix[:-1]])
            deq = (s_x * w_scale[:, 0]).float()
            bias = tensors.get(prefix + "bias", torch.zeros(w.shape[0])).double()
            quant_bias = torch.round(bias / deq.double() - off * codes.sum(dim=1))
            layer.update(input_scale=torch.tensor([s_x], dtype=torch.float32),
                         input_offset=torch.tensor([off], dtype=torch.float32),
                         quant_bias=quant_bias.to(torch.int32),
                         deq_scale=deq.view(torch.int32).to(torch.int64) if deq_scale_bits else deq)
        if kind in ("W8A8_DYNAMIC", "W8A8_MIX"):
            layer.update(weight_scale=w_scale.float(), weight_offset=torch.zeros_like(w_scale, dtype=torch.float32))
        for suffix, value in layer.items():
            out[prefix + suffix], types[prefix + suffix] = value, kind
    save_file(out, out_dir / "quant_model_weights.safetensors")
    description = {"version": "1.0.0", "model_quant_type": kind, "group_size": 0, "metadata": {}, **types}
    (out_dir / "quant_model_description.json").write_text(json.dumps(description, indent=2))
    return out_dir


def reference_model(quant_dir: Path, path: str):
    """transformers' model of the architecture in float64 (`.float()` runs the same math in
    float32), every projection computing the checkpoint's scheme from its own tensors; path "static" or "dynamic" (W8A8_MIX: which
    half; W8A8 is static, W8A8_DYNAMIC dynamic)."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(quant_dir)).double().eval()
    tensors = {k: v for k, v in load_file(Path(quant_dir) / "quant_model_weights.safetensors").items()}
    floats = {k: v.double() for k, v in tensors.items() if not is_projection(k) and k.rsplit(".", 1)[0].rsplit(
        ".", 1)[-1] not in PROJECTIONS}
    missing, unexpected = model.load_state_dict(floats, strict=False)
    assert unexpected == []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in PROJECTIONS:
            continue
        p = name + "."
        codes = tensors[p + "weight"].double()
        bias = tensors[p + "bias"].double() if p + "bias" in tensors else None
        if path == "static":
            s_x, off = float(tensors[p + "input_scale"]), float(tensors[p + "input_offset"])
            deq = tensors[p + "deq_scale"]
            deq = (deq.to(torch.int32).view(torch.float32) if deq.dtype == torch.int64 else deq).double()
            qb = tensors[p + "quant_bias"].double()

            def forward(x, codes=codes, s_x=s_x, off=off, deq=deq, qb=qb):   # in x's dtype
                x_q = torch.round(x / s_x + off).clamp(-128, 127)
                return (x_q @ codes.to(x.dtype).t() + qb.to(x.dtype)) * deq.to(x.dtype)
        else:
            w_scale = tensors[p + "weight_scale"].double()[:, 0]

            def forward(x, codes=codes, w_scale=w_scale, bias=bias):
                amax = x.abs().amax(dim=-1, keepdim=True)
                s = torch.where(amax > 0, amax / DIVISOR, torch.ones_like(amax))
                y = (torch.round(x / s).clamp(-128, 127) @ codes.to(x.dtype).t()) * s * w_scale.to(x.dtype)
                return y if bias is None else y + bias.to(x.dtype)
        module.forward = forward
    return model
