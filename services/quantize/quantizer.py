"""One quantization run: a float HF folder in, a quantized HF folder out (written beside
it, then moved into place: a run that fails leaves no half-written model)."""
from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from common.model.config import ModelConfig, load_model_config
from common.model.formats import is_gguf
from common.model.formats.checkpoint import iter_checkpoint
from common.model.formats.quantization import quantization_of
from services.quantize.calibration import calibrate
from services.quantize.experts import QUANTIZED_EXPERT_SCHEMES, has_experts, quantize_experts
from services.quantize.gptq import gptq_int4
from services.quantize.kept_float import float_modules, kept_float_summary, router_gates, stays_float
from services.quantize.smoothing import smooth
from services.quantize.static_ranges import choose_static_ranges
from services.quantize.writers import writer_for

log = logging.getLogger("pdmesh.quantize")
SCHEMES = ("w8a8", "w8a8-dynamic", "w8a8-mix", "w4a16", "c8")   # and "<w8a8 scheme>+c8"
C8 = "+c8"
METHODS = ("rtn", "gptq")
STATIC_RANGES = ("minmax", "search")
SAMPLES = 256      # calibration rows kept per linear layer for choosing its smoothing strength


@dataclass(frozen=True)
class QuantizeOptions:
    scheme: str
    fmt: str
    smooth_alpha: float | str | None = "auto"   # W8A8: SmoothQuant's migration strength, "auto" per layer; None = off
    method: str = "rtn"                   # W4A16: round-to-nearest or GPTQ
    group_size: int = 128
    static_range: str = "search"         # W8A8 static activations: "minmax" or "search" (static_ranges.py)

    @property
    def weights(self) -> str:
        """The weights' scheme ("c8": float weights)."""
        return self.scheme.removesuffix(C8)

    @property
    def kv_int8(self) -> bool:
        return self.scheme == "c8" or self.scheme.endswith(C8)

    def __post_init__(self) -> None:
        allowed = [*SCHEMES, *(s + C8 for s in SCHEMES if s.startswith("w8a8"))]
        if self.scheme not in allowed:
            raise ValueError(f"--scheme must be one of {allowed}, got {self.scheme!r}")
        if self.method not in METHODS:
            raise ValueError(f"--method must be one of {list(METHODS)}, got {self.method!r}")
        if self.method == "gptq" and self.weights != "w4a16":
            raise ValueError("--method gptq applies to --scheme w4a16 only (W8A8 uses smoothing)")
        if self.smooth_alpha not in (None, "auto") and not (
                isinstance(self.smooth_alpha, (int, float)) and 0.0 <= self.smooth_alpha <= 1.0):
            raise ValueError(f"--smooth-alpha must be 'auto' or a number in [0, 1], got {self.smooth_alpha!r}")
        if self.static_range not in STATIC_RANGES:
            raise ValueError(f"--static-range must be one of {list(STATIC_RANGES)}, got {self.static_range!r}")
        if self.group_size < 8 or self.group_size % 8:
            raise ValueError(f"--group-size must be a positive multiple of 8, got {self.group_size}")


def check_out_dir(model_dir: Path, out_dir: Path) -> None:
    """ValueError unless out_dir may be written: not the model, not a folder holding it, and,
    when it exists, empty or a quantized model (what an earlier run wrote)."""
    model, out = model_dir.resolve(), out_dir.resolve()
    if out == model or out in model.parents:
        raise ValueError(f"--out {out_dir} is the model or a folder holding it; give a new folder")
    if out.exists() and any(out.iterdir()):
        if not out.is_dir() or quantization_of(out) == "float":
            raise ValueError(f"--out {out_dir} exists and is not a quantized model; give a new or empty folder")


def quantized_input_widths(cfg: ModelConfig) -> dict[str, int]:
    """The input features of every projection W4A16 quantizes, by the config fields that
    give them (MLA's kv_b_proj and the routed experts stay float: not among them)."""
    widths = {"hidden_size": cfg.hidden_size}
    if cfg.uses_mla:
        if cfg.q_lora_rank:
            widths["q_lora_rank"] = cfg.q_lora_rank
        widths["num_attention_heads * v_head_dim"] = cfg.num_heads * cfg.v_head_dim
    else:
        widths["num_attention_heads * head_dim"] = cfg.num_heads * cfg.head_dim
    if len(cfg.moe_layers) < cfg.num_layers:
        widths["intermediate_size"] = cfg.intermediate_size
    if cfg.moe_layers and cfg.n_shared_experts:
        widths["moe_intermediate_size * n_shared_experts"] = cfg.moe_intermediate_size * cfg.n_shared_experts
    return widths


def check_groups(cfg: ModelConfig, group_size: int) -> None:
    """ValueError unless group_size divides every quantized projection's input features."""
    widths = quantized_input_widths(cfg)
    bad = {name: width for name, width in widths.items() if width % group_size}
    if bad:
        fits = [g for g in (256, 128, 64, 32, 16, 8) if all(w % g == 0 for w in widths.values())]
        hint = f"; {fits[0]} fits" if fits else ""
        raise ValueError(f"--group-size {group_size} must divide every projection's inputs; it does not divide "
                         f"{', '.join(f'{k} = {v}' for k, v in bad.items())}{hint}")


def quantize_model(model_dir: str | Path, out_dir: str | Path, prompts: list[list[int]],
                   options: QuantizeOptions) -> Path:
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if is_gguf(model_dir):
        raise ValueError(f"{model_dir}: give a Hugging Face folder (`pdmesh models pull` converts a GGUF file)")
    if quantization_of(model_dir) != "float":
        raise ValueError(f"{model_dir}: already quantized ({quantization_of(model_dir)}); give a float model")
    writer = writer_for(options.fmt, options.scheme, options.group_size)
    check_out_dir(model_dir, out_dir)
    cfg = load_model_config(model_dir)
    if cfg.uses_mla and options.kv_int8:
        raise ValueError(f"--scheme {options.scheme}: C8 (an int8 KV cache with per-channel K and V scales) does not "
                         f"apply to {cfg.model_type}: MLA's cache holds the latent, not per-head K and V; "
                         f"give a scheme without c8")
    if options.weights == "w4a16":
        check_groups(cfg, options.group_size)
    start = time.perf_counter()
    tensors = {name: tensor for name, tensor, _ in iter_checkpoint(model_dir)}
    kv: dict[int, dict[str, torch.Tensor]] | None = {} if options.kv_int8 else None
    auto = options.weights != "c8" and options.smooth_alpha == "auto"
    search = options.weights in ("w8a8", "w8a8-mix") and options.static_range == "search"
    stats = calibrate(model_dir, prompts, hessian=options.method == "gptq", kv=kv,
                      samples=SAMPLES if auto or search else 0)
    log.info("calibrated on %d prompts (%d tokens) in %.1fs", len(prompts), sum(map(len, prompts)),
             time.perf_counter() - start)
    if options.weights != "c8" and options.smooth_alpha is not None:
        # (smoothing keeps every q/k/v output, so the KV ranges stay valid). W4A16: AWQ's idea,
        # the activations' scale moved into the weights where it lowers the int4 error
        paths = {"w8a8": ("static",), "w8a8-dynamic": ("dynamic",),
                 "w4a16": (f"w4a16:{options.group_size}",)}.get(options.weights, ("static", "dynamic"))
        done = smooth(tensors, stats, options.smooth_alpha, paths)
        chosen = sorted(a for a in done.values() if a is not None)
        log.info("smoothed %d of %d layers (alpha %s)", len(chosen), len(done),
                 options.smooth_alpha if options.smooth_alpha != "auto" else
                 f"per layer, least {'+'.join(paths)} error on the calibration sample: "
                 + (f"{chosen[0]}..{chosen[-1]}" if chosen else "none better than unsmoothed"))
    if search:
        ratios = choose_static_ranges(tensors, stats)
        clipped = sorted(r for r in ratios.values() if r < 1)
        log.info("static activation ranges: %d of %d layers clipped below their calibration min/max%s", len(clipped),
                 len(ratios), f" (to {clipped[0]}..{clipped[-1]} of it)" if clipped else "")
    out: dict[str, torch.Tensor] = {}
    kept: list[str] = []
    for i, st in enumerate(stats.values(), 1):
        for name in st.projections:
            if stays_float(name):
                kept.append(name)
                continue
            weight = tensors.pop(name + ".weight")
            bias = tensors.pop(name + ".bias", None)
            codes = scale = None
            if options.method == "gptq":
                codes, scale = gptq_int4(weight, st.xtx, st.num_tokens, options.group_size)
            out.update(writer.projection(name, weight, bias, st, codes, scale))
        if i % 8 == 0 or i == len(stats):
            log.info("quantized %d/%d linear layers", i, len(stats))
    float_experts_why = _experts(tensors, out, writer, options, cfg.model_type)
    gates = router_gates(tensors)
    summary = kept_float_summary(kept, gates, float_experts_why) if options.weights != "c8" else None
    if summary:
        log.info("%s", summary)
    out.update(tensors)
    if kv is not None:
        out.update(writer.kv_cache_int8(kv))
    staging = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(model_dir, staging, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json",
                                                                      "*.gguf", ".*"))
    save_file({k: v.contiguous() for k, v in out.items()}, staging / writer.weights_file)
    writer.finish(staging, out, float_modules(kept, gates, float_experts_why is not None))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    staging.rename(out_dir)
    log.info("wrote %s in %.1fs", out_dir, time.perf_counter() - start)
    return out_dir


def _experts(tensors: dict[str, torch.Tensor], out: dict[str, torch.Tensor], writer, options: QuantizeOptions,
             model_type: str) -> str | None:
    """A MoE model's routed experts: quantized from tensors into out (both mutated) when the
    scheme takes them (experts.py), else left in tensors. Returns why they stayed float
    (None: quantized, or no experts, or float weights, c8, where nothing is quantized)."""
    if options.weights == "c8" or not has_experts(tensors):
        return None
    if options.weights not in QUANTIZED_EXPERT_SCHEMES:
        return (f"--scheme {options.weights}: the engine's MoE layer reads experts FLOAT or W8A8_DYNAMIC only; "
                f"w8a8-dynamic quantizes them")
    start = time.perf_counter()
    done = quantize_experts(tensors, writer, model_type)
    out.update(done)
    log.info("quantized %d routed-expert projections per output channel in %.1fs (dynamic activations: no "
             "calibration through the experts)", sum(k.endswith(".weight") for k in done), time.perf_counter() - start)
    return None
