"""A Mixture-of-Experts model's routed experts under `pdmesh quantize`.

The experts are not Linear modules (layers/moe.py holds them fused), so the calibration
never sees their inputs, and no scheme that needs activation statistics can quantize
them. W8A8_DYNAMIC needs none (activations are quantized per token at run time), and it
is the one quantized type the engine's MoE layer reads (layers/moe.py: FLOAT or
W8A8_DYNAMIC; layers/moe_int8.py), so:

    w8a8-dynamic       every expert projection int8, symmetric per output channel, written
                       by the format's own writer as a dense projection is (msModelSlim:
                       divisor 127, weight_scale and zero weight_offset [out, 1] float32;
                       compressed-tensors: 127.5, weight_scale [out, 1] in the model's dtype),
                       under its per-expert name:
                           <layer>.mlp.experts.{e}.gate_proj / up_proj / down_proj   (Qwen3-MoE, DeepSeek)
                           <layer>.block_sparse_moe.experts.{e}.w1 / w3 / w2          (Mixtral)
    any other scheme   the experts stay FLOAT (said in the log by the quantizer)

Fused float experts (transformers 5's `<layer>.mlp.experts.gate_up_proj` [E, 2I, H] and
`down_proj` [E, H, I]) are split into those per-expert names first: the engine reads int8
experts per expert only (layers/moe.py `_stacked`). The router gate is not an expert: it
stays float in every scheme (kept_float.py).
"""
from __future__ import annotations

import re

import torch

from common.model.layers.moe import FUSED_MODULE, PER_EXPERT_NAMES

QUANTIZED_EXPERT_SCHEMES = ("w8a8-dynamic",)     # --scheme values whose experts are quantized
PER_EXPERT = re.compile(r"(.+\.experts\.\d+\.[^.]+)\.weight")      # not shared_experts: no index after it
FUSED_GATE_UP = re.compile(r"(.+\.)experts\.gate_up_proj")


def expert_naming(model_type: str) -> tuple[str, tuple[str, str, str]]:
    """(module, (gate, up, down)) of the per-expert names the engine reads for model_type
    (models/llama.py picks Mixtral's for mixtral, Qwen3-MoE's for every other family)."""
    return PER_EXPERT_NAMES["mixtral" if model_type == "mixtral" else "qwen3_moe"]


def has_experts(tensors: dict[str, torch.Tensor]) -> bool:
    return any(PER_EXPERT.fullmatch(n) or FUSED_GATE_UP.fullmatch(n) for n in tensors)


def split_fused_experts(tensors: dict[str, torch.Tensor], model_type: str) -> int:
    """Replace every fused expert pair in tensors (mutated) by per-expert tensors of the
    same values (views, no copy); a family whose per-expert module is not `mlp.`
    (Mixtral's block_sparse_moe.) has its router gate moved there too, so the layer finds
    one layout whole. Returns the number of MoE layers split."""
    module, (gate, up, down) = expert_naming(model_type)
    layers = [m.group(1) for n in list(tensors) if (m := FUSED_GATE_UP.fullmatch(n))]
    for fused in layers:       # e.g. "model.layers.3.mlp."
        layer = fused.removesuffix(FUSED_MODULE)
        gate_up, down_w = tensors.pop(fused + "experts.gate_up_proj"), tensors.pop(fused + "experts.down_proj")
        inter = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            p = f"{layer}{module}experts.{e}."
            tensors[p + gate + ".weight"] = gate_up[e, :inter]
            tensors[p + up + ".weight"] = gate_up[e, inter:]
            tensors[p + down + ".weight"] = down_w[e]
        if module != FUSED_MODULE:
            for suffix in ("weight", "e_score_correction_bias"):
                if fused + "gate." + suffix in tensors:
                    tensors[f"{layer}{module}gate.{suffix}"] = tensors.pop(fused + "gate." + suffix)
    return len(layers)


def expert_projections(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The per-expert projections in tensors (names without ".weight"), in name order."""
    return sorted(m.group(1) for n in tensors if (m := PER_EXPERT.fullmatch(n)))


def quantize_experts(tensors: dict[str, torch.Tensor], writer, model_type: str) -> dict[str, torch.Tensor]:
    """Every expert projection through writer.projection with no input statistics (the
    scheme must be one of QUANTIZED_EXPERT_SCHEMES); their float tensors are popped from
    tensors (mutated, fused ones split first). Returns the written tensors."""
    split_fused_experts(tensors, model_type)
    out: dict[str, torch.Tensor] = {}
    for name in expert_projections(tensors):
        out.update(writer.projection(name, tensors.pop(name + ".weight"), tensors.pop(name + ".bias", None), None))
    return out
