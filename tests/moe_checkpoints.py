"""Tiny Mixture-of-Experts checkpoints saved by transformers (random weights, the tiny
tokenizer), in either expert layout: "per-expert" (save_original_format=True: experts.{e}.
gate_proj / up_proj / down_proj, Mixtral's w1 / w3 / w2) or "fused" (transformers 5's
experts.gate_up_proj [E, 2I, H] and down_proj [E, H, I])."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

IDS = [1, 17, 400, 9, 23, 610, 5, 77, 301, 12, 990, 45, 3]
COMMON = dict(vocab_size=1024, hidden_size=128, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=4,
              max_position_embeddings=2048, initializer_range=0.15, bos_token_id=1, eos_token_id=2)


def qwen3_moe():
    import transformers
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        intermediate_size=256, moe_intermediate_size=64, head_dim=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], **COMMON))


def mixtral():
    import transformers
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=None, **COMMON))


FAMILIES = {"qwen3_moe": qwen3_moe, "mixtral": mixtral}


def save(family: str, layout: str, out: Path, tokenizer_dir: Path):
    """Build `family` (seed 7), save it to out in `layout` with the tokenizer of
    tokenizer_dir; returns the transformers model (eval mode)."""
    torch.manual_seed(7)
    model = FAMILIES[family]().eval()
    model.save_pretrained(out, save_original_format=layout == "per-expert")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / f, out / f)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tiny_model):
    """saved(family, layout) -> (folder, transformers model)."""
    made = {}

    def get(family: str, layout: str):
        if (family, layout) not in made:
            out = tmp_path_factory.mktemp(f"{family}-{layout}")
            made[family, layout] = (out, save(family, layout, out, tiny_model("llama")))
        return made[family, layout]

    return get


def greedy_reference(model, max_new_tokens: int = 10) -> tuple[torch.Tensor, list[int]]:
    """(prompt log-probs [len(IDS) - 1, vocab] float64, greedy continuation of IDS)."""
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([IDS])).logits[0, :-1].double(), -1)
        want = model.generate(torch.tensor([IDS]), max_new_tokens=max_new_tokens, do_sample=False)[0, len(IDS):]
    return ref, want.tolist()


def w8a8_reference(quant_dir: Path, weights_file: str, divisor: float, attention_ranks: int = 1,
                   expert_ranks: int = 1):
    """transformers' MoE model of quant_dir's architecture in float64 computing W8A8 dynamic
    from the written tensors (int8 codes * weight_scale; weight_offset ignored: zeros): every
    projection's input, and each expert's gate_up and down inputs, fake-quantized per token
    (tests/quant_checkpoints.py). A row-parallel input is quantized in equal column shares:
    o_proj and the dense down_proj in attention_ranks, the experts' down in expert_ranks
    (split by columns), as the ranks do."""
    import transformers

    from tests.quant_checkpoints import PROJECTIONS, fake_quant_per_token

    tensors = load_file(Path(quant_dir) / weights_file)
    hf_cfg = transformers.AutoConfig.from_pretrained(quant_dir)
    hf_cfg.__dict__.pop("quantization_config", None)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).double().eval()
    state, experts = {}, {}
    for name, t in tensors.items():
        if name.endswith((".weight_scale", ".weight_offset")):
            continue
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in PROJECTIONS:
            t = t.double() * tensors[name[:-len("weight")] + "weight_scale"].double()
        if ".experts." in name:           # model.layers.L.mlp.experts.E.gate_proj.weight
            parts = name.split(".")
            experts[int(parts[2]), int(parts[5]), parts[6]] = t.double()
        else:
            state[name] = t.double()
    for layer in {key[0] for key in experts}:
        count = 1 + max(e for (li, e, _) in experts if li == layer)
        p = f"model.layers.{layer}.mlp.experts."
        state[p + "gate_up_proj"] = torch.stack([torch.cat([experts[layer, e, "gate_proj"], experts[layer, e, "up_proj"]])
                                                 for e in range(count)])
        state[p + "down_proj"] = torch.stack([experts[layer, e, "down_proj"] for e in range(count)])
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}, (missing, unexpected)

    def shares(x: torch.Tensor, n: int) -> torch.Tensor:
        return torch.cat([fake_quant_per_token(part, divisor) for part in x.chunk(n, dim=-1)], dim=-1)

    def experts_forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for e in range(self.gate_up_proj.shape[0]):
            token, choice = torch.where(top_k_index == e)
            if token.numel() == 0:
                continue
            gate, up = (fake_quant_per_token(hidden[token], divisor) @ self.gate_up_proj[e].t()).chunk(2, dim=-1)
            h = shares(torch.nn.functional.silu(gate) * up, expert_ranks) @ self.down_proj[e].t()
            out.index_add_(0, token, h * top_k_weights[token, choice, None])
        return out

    for name, module in model.named_modules():
        kind = name.rsplit(".", 1)[-1]
        if kind == "experts":
            module.forward = experts_forward.__get__(module)
        elif kind in ("o_proj", "down_proj"):
            module.register_forward_pre_hook(lambda _m, args: (shares(args[0], attention_ranks),))
        elif kind in PROJECTIONS:
            module.register_forward_pre_hook(lambda _m, args: (fake_quant_per_token(args[0], divisor),))
    return model
