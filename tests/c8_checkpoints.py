"""C8 (int8 KV cache) checkpoints in msModelSlim's layout, written from a float or an
msModelSlim folder, and a float64 reference of the C8 math on float weights.

    <layer>.self_attn.{k,v}_proj.kv_cache_scale / kv_cache_offset   float32 [kv_heads * head_dim]
    description: those names typed "C8", "kv_cache_type": "C8"

Keys are scaled from a bound on the rotated key (a rotary pair never leaves the circle of
its two channels), over [-bound, 1.1 bound] so that their offsets are nonzero too (the
key offset is the one attention drops: a constant per query row); values asymmetrically
from their min/max.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

WEIGHTS = "quant_model_weights.safetensors"


def kv_ranges(float_dir: Path, prompts: list[list[int]]) -> dict[int, dict[str, torch.Tensor]]:
    """layer -> {"k_bound": [kv], "v_min": [kv], "v_max": [kv]} over the prompts (transformers, float64)."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float64).eval()
    seen: dict[int, dict[str, torch.Tensor]] = {}

    def hook(i: int, what: str):
        def record(_module, _args, out):
            rows = out.detach().reshape(-1, out.shape[-1])
            s = seen.setdefault(i, {})
            for key, value, op in ((f"{what}_min", rows.amin(0), torch.minimum),
                                   (f"{what}_max", rows.amax(0), torch.maximum)):
                s[key] = op(s[key], value) if key in s else value
        return record

    for i, layer in enumerate(model.model.layers):
        layer.self_attn.k_proj.register_forward_hook(hook(i, "k"))
        layer.self_attn.v_proj.register_forward_hook(hook(i, "v"))
    with torch.no_grad():
        for prompt in prompts:
            model(torch.tensor([prompt]))
    hd = model.config.head_dim if getattr(model.config, "head_dim", None) else \
        model.config.hidden_size // model.config.num_attention_heads
    for s in seen.values():
        a = torch.maximum(s["k_min"].abs(), s["k_max"].abs()).view(-1, hd)
        half = torch.cat([a[:, hd // 2:], a[:, :hd // 2]], dim=1)      # each channel's rotary partner
        s["k_bound"] = (a.square() + half.square()).sqrt().flatten()
    return seen


def asymmetric(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, offset) float32 per channel mapping [lo, hi] onto -128..127."""
    scale = ((hi - lo) / 255).clamp_min(1e-6)
    return scale.float(), torch.round(-128 - lo / scale).clamp(-128, 127).float()


def c8_tensors(ranges: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for i, s in ranges.items():
        p = f"model.layers.{i}.self_attn."
        k_scale, k_offset = asymmetric(-s["k_bound"], 1.1 * s["k_bound"])
        v_scale, v_offset = asymmetric(s["v_min"].clamp(max=0), s["v_max"].clamp(min=0))
        out.update({p + "k_proj.kv_cache_scale": k_scale, p + "k_proj.kv_cache_offset": k_offset,
                    p + "v_proj.kv_cache_scale": v_scale, p + "v_proj.kv_cache_offset": v_offset})
    return out


def write_c8(src_dir: Path, out_dir: Path, prompts: list[list[int]], float_dir: Path | None = None) -> Path:
    """src_dir: a float model or an msModelSlim checkpoint (its weights kept as they are);
    float_dir: the float model the ranges are measured on (default src_dir)."""
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    shutil.copytree(src_dir, out_dir, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    description_file = src_dir / "quant_model_description.json"
    if description_file.is_file():
        tensors = load_file(src_dir / WEIGHTS)
        description = json.loads(description_file.read_text())
    else:
        tensors = {}
        for path in sorted(src_dir.glob("*.safetensors")):
            tensors.update(load_file(path))
        description = {"version": "1.0.0", "model_quant_type": "FLOAT", "group_size": 0, "metadata": {},
                       **{name: "FLOAT" for name in tensors}}
    c8 = c8_tensors(kv_ranges(float_dir or src_dir, prompts))
    tensors.update(c8)
    description.update({name: "C8" for name in c8}, kv_cache_type="C8")
    save_file(tensors, out_dir / WEIGHTS)
    (out_dir / "quant_model_description.json").write_text(json.dumps(description, indent=2))
    return out_dir


def fake_quant(x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """x [..., channels] through the store and read rules, in x's dtype."""
    codes = torch.round(x / scale + offset).clamp(-128, 127)
    return (codes - offset) * scale


def c8_reference(c8_dir: Path):
    """transformers' Llama in float64 on the checkpoint's float weights, with every layer's
    rotated keys and its values passed through the C8 store and read rules (`.float()`
    runs the same math in float32). Call under `patched(model)`."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(c8_dir)).double().eval()
    tensors = load_file(Path(c8_dir) / WEIGHTS)
    floats = {k: v.double() for k, v in tensors.items() if "kv_cache" not in k}
    missing, unexpected = model.load_state_dict(floats, strict=False)
    assert unexpected == [] and all("rotary" in m or m == "lm_head.weight" for m in missing), (missing, unexpected)
    model.c8 = {i: {k.split("self_attn.")[1]: v.double() for k, v in tensors.items()
                    if k.startswith(f"model.layers.{i}.self_attn.") and "kv_cache" in k}
                for i in range(len(model.model.layers))}
    return model


class patched:
    """Within: the model's attention quantizes and dequantizes its keys (after rotary) and
    values (v_proj's output) by the layer's C8 scales."""

    def __init__(self, model):
        import transformers.models.llama.modeling_llama as llama
        self.module, self.model, self.handles, self.layer = llama, model, [], [0]

    def __enter__(self):
        original, c8, layer, model = self.module.apply_rotary_pos_emb, self.model.c8, self.layer, self.model

        def rotary(q, k, cos, sin, *args, **kwargs):
            q, k = original(q, k, cos, sin, *args, **kwargs)
            s = c8[layer[0]]
            heads, hd = k.shape[1], k.shape[-1]
            scale = s["k_proj.kv_cache_scale"].view(heads, 1, hd).to(k.dtype)
            offset = s["k_proj.kv_cache_offset"].view(heads, 1, hd).to(k.dtype)
            return q, fake_quant(k, scale, offset)

        self.original = original
        self.module.apply_rotary_pos_emb = rotary
        for i, block in enumerate(model.model.layers):
            self.handles.append(block.self_attn.register_forward_pre_hook(lambda *_a, i=i: layer.__setitem__(0, i)))
            self.handles.append(block.self_attn.v_proj.register_forward_hook(
                lambda _m, _a, out, i=i: fake_quant(out, c8[i]["v_proj.kv_cache_scale"].to(out.dtype),
                                                    c8[i]["v_proj.kv_cache_offset"].to(out.dtype))))
        return self.model

    def __exit__(self, *exc):
        self.module.apply_rotary_pos_emb = self.original
        for h in self.handles:
            h.remove()
