"""Mixture-of-Experts families through the engine (Qwen3-MoE, Mixtral: layers/moe.py) against
transformers on tiny random models it saved, in both checkpoint layouts (per expert, and
transformers 5's fused `save_original_format=False`), and the checkpoints the loader must
refuse: a missing expert, two layouts at once, a tensor no parameter takes."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.engine import LLM, SamplingParams
from common.model.config import model_config_from_dict
from tests.conftest import assert_no_blocks_in_use
from tests.moe_checkpoints import IDS, greedy_reference, saved  # noqa: F401  (saved: a fixture)

@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("layout", ["per-expert", "fused"])
@pytest.mark.parametrize("backend", ["ref", "cpu"])
def test_moe_model_equals_transformers(saved, family, layout, backend):
    folder, theirs = saved(family, layout)
    names = load_file(folder / "model.safetensors").keys()
    assert any(".experts.0." in n for n in names) == (layout == "per-expert")     # the layout under test
    ref, want = greedy_reference(theirs)
    with LLM(str(folder), kernel_backend=backend, num_blocks=64) as llm:
        torch.testing.assert_close(llm.prompt_logprobs_full(IDS).double(), ref, atol=1e-4, rtol=0)
        out = llm.generate([{"prompt_token_ids": IDS}],
                           SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0].outputs[0]
        assert list(out.token_ids) == want
        assert_no_blocks_in_use(llm.engine)


def test_the_config_says_which_layers_are_sparse():
    raw = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=64,
               num_hidden_layers=6, num_attention_heads=4, num_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=16, decoder_sparse_step=2, mlp_only_layers=[3])
    cfg = model_config_from_dict(raw)
    assert cfg.moe_layers == (1, 5) and cfg.moe_intermediate_size == 16 and cfg.qk_norm
    mixtral_cfg = model_config_from_dict({**raw, "architectures": ["MixtralForCausalLM"], "num_experts": None,
                                          "num_local_experts": 4})
    assert mixtral_cfg.moe_layers == tuple(range(6)) and mixtral_cfg.moe_intermediate_size == 64
    assert mixtral_cfg.norm_topk_prob
    with pytest.raises(ValueError, match="needs num_experts"):
        model_config_from_dict({**raw, "num_experts": None})


def edited(folder, tmp_path, change):
    out = tmp_path / "edited"
    shutil.copytree(folder, out)
    tensors = load_file(out / "model.safetensors")
    change(tensors)
    save_file(tensors, out / "model.safetensors")
    return out


@pytest.mark.parametrize("layout,change,match", [
    ("per-expert", lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"),
     r"model.layers.2.mlp.experts: checkpoint is missing 1 tensor\(s\): model.layers.2.mlp.experts.5.up_proj.weight"),
    ("fused", lambda t: t.pop("model.layers.0.mlp.experts.down_proj"),
     r"model.layers.0.mlp.experts: checkpoint is missing 1 tensor\(s\): model.layers.0.mlp.experts.down_proj"),
    ("per-expert", lambda t: t.update({"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(8, 128, 128)}),
     "one layout, per expert .* or fused .*; found per expert and fused"),
    ("fused", lambda t: t.update({"model.layers.0.mlp.experts.gate_up_proj.weight": torch.zeros(8, 128, 128)}),
     "unexpected tensor 'model.layers.0.mlp.experts.gate_up_proj.weight'"),
    ("per-expert", lambda t: t.update({"model.layers.0.mlp.experts.8.up_proj.weight": torch.zeros(64, 128)}),
     "unexpected tensor 'model.layers.0.mlp.experts.8.up_proj.weight'"),
    ("per-expert", lambda t: t.update({"model.layers.2.mlp.experts.3.down_proj.weight": torch.zeros(128, 64,
                                                                                                  dtype=torch.int8)}),
     "tensor 'model.layers.2.mlp.experts.3.down_proj.weight' is int8, expected a float tensor"),
    ("fused", lambda t: t.update({"model.layers.2.mlp.experts.down_proj": torch.zeros(8, 128, 64, dtype=torch.int8)}),
     "tensor 'model.layers.2.mlp.experts.down_proj' is int8: fused quantized experts are not supported; "
     "supported: float fused experts, or int8 experts per expert"),
])
def test_a_checkpoint_that_would_leave_garbage_experts_is_refused(saved, tmp_path, layout, change, match):
    folder, _ = saved("qwen3_moe", layout)
    with pytest.raises(ValueError, match=match):
        LLM(str(edited(folder, tmp_path, change)), num_blocks=16)


@pytest.mark.parametrize("family,layout,expert_parallel,dispatch", [
    ("qwen3_moe", "per-expert", True, "all_reduce"), ("qwen3_moe", "fused", True, "all_reduce"),
    ("mixtral", "per-expert", True, "all_reduce"), ("qwen3_moe", "fused", True, "all_to_all"),
    ("mixtral", "per-expert", True, "all_to_all"), ("qwen3_moe", "per-expert", False, "all_reduce"),
    ("qwen3_moe", "fused", False, "all_reduce"), ("mixtral", "fused", False, "all_reduce")])
def test_tensor_parallel_2_equals_transformers(saved, family, layout, expert_parallel, dispatch):
    """Experts placed whole (expert parallel; tokens dispatched by the all-reduce or by
    all_to_all) or split by columns: the same tokens, the same expert load counted."""
    folder, theirs = saved(family, layout)
    ref, want = greedy_reference(theirs)
    with LLM(str(folder), kernel_backend="cpu", num_blocks=64, tensor_parallel_size=2,
             enable_expert_parallel=expert_parallel, moe_dispatch=dispatch) as llm:
        moe = [layer.mlp for layer in llm.engine.model.layers if hasattr(layer.mlp, "num_local")]
        assert [m.dispatch for m in moe] == [dispatch] * len(moe)
        experts = llm.engine.model_config.num_experts
        assert moe
        for i, m in ((i, layer.mlp) for i, layer in enumerate(llm.engine.model.layers) if layer.mlp in moe):
            if expert_parallel:                                                      # rank 0's part
                assert (m.num_local, m.first, m.inter) == (experts // 2, 0, m.full_inter)
            else:
                assert (m.num_local, m.first, m.inter, m.inter_start) == (experts, 0, m.full_inter // 2, 0)
            assert llm.engine.model.dense_bytes[f"layers.{i}.mlp.w13"] == m.num_local * 2 * m.inter * m.hidden * 4
        torch.testing.assert_close(llm.prompt_logprobs_full(IDS).double(), ref, atol=1e-4, rtol=0)
        tokens, counts = generate_counting(llm)
        assert tokens == want
        assert counts == whole_model_counts(folder)      # per layer, per expert: as at TP 1
        assert_no_blocks_in_use(llm.engine)


_COUNTS: dict = {}


def generate_counting(llm) -> tuple[list[int], dict[int, list[int]]]:
    """Greedy 10 tokens of IDS, and the tokens each expert got meanwhile per MoE layer (the
    engine's totals before and after: common/engine/expert_load.py)."""
    before = llm.engine.expert_tokens()
    out = llm.generate([{"prompt_token_ids": IDS}],
                       SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0].outputs[0]
    counts = {i: [a - b for a, b in zip(c, before[i])] for i, c in llm.engine.expert_tokens().items()}
    top_k = llm.engine.model_config.num_experts_per_tok          # prompt + 9 decode steps, top_k each
    assert {i: sum(c) for i, c in counts.items()} == {i: (len(IDS) + 9) * top_k for i in llm.engine.model_config.moe_layers}
    return list(out.token_ids), counts


def whole_model_counts(folder) -> dict[int, list[int]]:
    if folder not in _COUNTS:
        with LLM(str(folder), kernel_backend="cpu", num_blocks=64) as llm:
            _COUNTS[folder] = generate_counting(llm)[1]
            assert_no_blocks_in_use(llm.engine)
    return _COUNTS[folder]


def test_tensor_parallel_sizes_a_moe_model_refuses(saved):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=8 does not fit MixtralForCausalLM: num_experts=4 must "
                                         r"be a multiple of it .*; allowed: \[1, 2, 4\]"):
        LLM(str(saved("mixtral", "fused")[0]), num_blocks=16, tensor_parallel_size=8, enable_expert_parallel=True)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not fit Qwen3MoeForCausalLM: moe_intermediate_"
                                         r"size=64 must be a multiple of it .*; allowed: \[1, 2, 4, 8\]"):
        LLM(str(saved("qwen3_moe", "fused")[0]), num_blocks=16, tensor_parallel_size=3)


def test_columns_of_experts_must_divide():
    raw = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=64, hidden_size=64, intermediate_size=64,
               num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8, num_experts=4,
               num_experts_per_tok=2, moe_intermediate_size=20)
    from common.parallel.shard import check_tensor_parallel
    with pytest.raises(ValueError, match=r"moe_intermediate_size=20 must be a multiple of it \(experts split by "
                                         r"columns; or enable_expert_parallel: true\); allowed: \[1, 2, 4\]"):
        check_tensor_parallel(model_config_from_dict(raw), 8, expert_parallel=False)


def test_moe_dispatch_is_validated():
    from common.engine_config import EngineConfig
    with pytest.raises(ValueError, match=r"moe_dispatch must be one of \('all_reduce', 'all_to_all'\), got 'deepep'"):
        EngineConfig(model="m", moe_dispatch="deepep")
    with pytest.raises(ValueError, match=r"moe_dispatch: all_to_all needs enable_expert_parallel: true .*; allowed "
                                         r"without it: all_reduce"):
        EngineConfig(model="m", tensor_parallel_size=2, moe_dispatch="all_to_all")


def test_a_column_split_node_plans_its_shards_whatever_the_expert_count():
    """A node's KV-head offsets come from plan_shard at its own enable_expert_parallel
    (services/node/engine_node.py): 6 experts at TP 4 split by columns, which placing them
    whole could not do."""
    from common.parallel.shard import plan_shard
    raw = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=64, hidden_size=64, intermediate_size=64,
               num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, num_experts=6,
               num_experts_per_tok=2, moe_intermediate_size=32)
    cfg = model_config_from_dict(raw)
    assert [plan_shard(cfg, 4, r).kv_head_start for r in range(4)] == [0, 1, 2, 3]
    assert [(s.num_local_experts, s.expert_inter_start) for s in (plan_shard(cfg, 4, r) for r in range(4))] == \
        [(6, 0), (6, 8), (6, 16), (6, 24)]
    with pytest.raises(ValueError, match="num_experts=6 must be a multiple of it"):
        plan_shard(cfg, 4, 0, expert_parallel=True)
