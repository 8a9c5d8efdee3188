"""DeepSeek-V2 / V3 through the engine (MLA over a latent cache, layers/mla.py; DeepSeek's MoE
layers) against transformers on tiny random models it saved: prompt log-probs (the expanded
prefill) and greedy tokens (the absorbed decode) at TP 1 and TP 2; the absorbed decode's
log-probs against the expanded prefill's on the same positions; the latent cache under a
prefix-cache hit, chunked prefill and preemption; the checkpoints the loader must refuse,
and DeepSeek-V3's multi-token-prediction layer skipped by name."""
from __future__ import annotations

import json
import logging
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.engine import LLM, SamplingParams
from common.model.config import model_config_from_dict
from tests.conftest import assert_no_blocks_in_use
from tests.mla_checkpoints import COMMON, saved_deepseek  # noqa: F401  (saved_deepseek: a fixture)
from tests.moe_checkpoints import IDS, greedy_reference

FAMILIES = ["deepseek_v2", "deepseek_v3"]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("backend,layout", [("ref", "per-expert"), ("cpu", "per-expert"), ("cpu", "fused")])
def test_deepseek_equals_transformers(saved_deepseek, family, backend, layout):
    folder, theirs = saved_deepseek(family, layout)
    names = load_file(folder / "model.safetensors").keys()
    assert any(".experts.0." in n for n in names) == (layout == "per-expert")     # the layout under test
    ref, want = greedy_reference(theirs)
    with LLM(str(folder), kernel_backend=backend, num_blocks=64) as llm:
        assert tuple(llm.engine.kv_cache.shape) == (3, 1, 64, 16, 1, 32 + 8)     # one latent plane, one head
        assert llm.engine.layout.endswith(":latent")
        torch.testing.assert_close(llm.prompt_logprobs_full(IDS).double(), ref, atol=1e-4, rtol=0)
        out = llm.generate([{"prompt_token_ids": IDS}], GREEDY)[0].outputs[0]
        assert list(out.token_ids) == want
        assert_no_blocks_in_use(llm.engine)


@pytest.mark.parametrize("family,expert_parallel,layout", [
    ("deepseek_v2", False, "per-expert"), ("deepseek_v2", True, "fused"),
    ("deepseek_v3", False, "fused"), ("deepseek_v3", True, "per-expert")])
def test_deepseek_at_tensor_parallel_2_equals_transformers(saved_deepseek, family, expert_parallel, layout):
    """Query heads split, the latent (and so the cache) whole on both ranks; the experts
    split by columns, or placed whole (4 a rank) with expert parallelism, each rank
    holding only its experts' bytes."""
    folder, theirs = saved_deepseek(family, layout)
    ref, want = greedy_reference(theirs)
    with LLM(str(folder), kernel_backend="cpu", num_blocks=64, tensor_parallel_size=2,
             enable_expert_parallel=expert_parallel) as llm:
        model = llm.engine.model
        moe = [(i, layer.mlp) for i, layer in enumerate(model.layers) if hasattr(layer.mlp, "num_local")]
        assert [i for i, _ in moe] == [1, 2]                                   # first_k_dense_replace 1
        for i, m in moe:                                                       # rank 0's part
            assert (m.num_local, m.inter) == ((4, 32) if expert_parallel else (8, 16))
            assert model.dense_bytes[f"layers.{i}.mlp.w13"] == m.num_local * 2 * m.inter * 128 * 4
        assert model.layers[0].self_attn.num_heads == 4                        # 8 query heads split
        torch.testing.assert_close(llm.prompt_logprobs_full(IDS).double(), ref, atol=1e-4, rtol=0)
        assert list(llm.generate([{"prompt_token_ids": IDS}], GREEDY)[0].outputs[0].token_ids) == want
        assert_no_blocks_in_use(llm.engine)


@pytest.mark.parametrize("family", FAMILIES)
def test_absorbed_decode_equals_expanded_prefill(saved_deepseek, family):
    """Each generated token's log-prob from the decode step (absorbed: attention over the
    latent rows) equals the same position's from a prefill of prompt + output (expanded
    through kv_b_proj into per-head K and V)."""
    folder, _ = saved_deepseek(family)
    with LLM(str(folder), kernel_backend="cpu", num_blocks=64) as llm:
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
        out = llm.generate([{"prompt_token_ids": IDS}], params)[0].outputs[0]
        decoded = torch.tensor([lp[t] for t, lp in zip(out.token_ids, out.logprobs)], dtype=torch.float64)
        full = llm.prompt_logprobs_full(IDS + list(out.token_ids)).double()
        positions = torch.arange(len(IDS) - 1, len(IDS) - 1 + len(out.token_ids))
        expanded = full[positions, torch.tensor(out.token_ids)]
        torch.testing.assert_close(decoded, expanded, atol=2e-5, rtol=0)
        assert_no_blocks_in_use(llm.engine)


def test_latent_cache_under_prefix_hits_chunks_and_preemption(saved_deepseek):
    """The same greedy tokens alone, with a warm prefix cache (the prefix read back from
    latent blocks), in chunks of 32, and after preemption."""
    folder, _ = saved_deepseek("deepseek_v3")
    rng = random.Random(11)
    target = [rng.randrange(3, 1000) for _ in range(150)]
    others = [[rng.randrange(3, 1000) for _ in range(150)] for _ in range(5)]
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    with LLM(str(folder), kernel_backend="cpu", num_blocks=64, enable_prefix_caching=False) as llm:
        alone = llm.generate([{"prompt_token_ids": target}], params)[0].outputs[0].token_ids
    with LLM(str(folder), kernel_backend="cpu", num_blocks=64, max_num_batched_tokens=32) as llm:
        first = llm.generate([{"prompt_token_ids": target}], params)[0]
        second = llm.generate([{"prompt_token_ids": target}], params)[0]
        assert first.outputs[0].token_ids == alone and second.outputs[0].token_ids == alone
        assert second.num_cached_tokens == (150 - 1) // 16 * 16
        assert_no_blocks_in_use(llm.engine)
    with LLM(str(folder), kernel_backend="cpu", num_blocks=384 // 16, max_model_len=384,
             enable_prefix_caching=False) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in [target, *others]], params)
        assert llm.engine.scheduler.num_preemptions > 0
        assert outs[0].outputs[0].token_ids == alone
        assert_no_blocks_in_use(llm.engine)


def edited(folder, tmp_path, change_tensors=None, change_config=None):
    out = tmp_path / "edited"
    shutil.copytree(folder, out)
    if change_tensors is not None:
        tensors = load_file(out / "model.safetensors")
        change_tensors(tensors)
        save_file(tensors, out / "model.safetensors")
    if change_config is not None:
        cfg = json.loads((out / "config.json").read_text())
        change_config(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_a_wrong_kv_lora_rank_is_refused_naming_the_tensor(saved_deepseek, tmp_path):
    folder, _ = saved_deepseek("deepseek_v3")
    bad = edited(folder, tmp_path, change_config=lambda c: c.update(kv_lora_rank=16))
    with pytest.raises(ValueError, match=r"tensor 'model.layers.0.self_attn.kv_a_layernorm.weight' has shape "
                                         r"\(32,\), expected \(16,\) from config.json"):
        LLM(str(bad), kernel_backend="cpu", num_blocks=16)


def test_the_multi_token_prediction_layer_is_skipped_by_name(saved_deepseek, tmp_path, caplog):
    """DeepSeek-V3's checkpoints carry model.layers.{num_hidden_layers}.*: not run, said in
    the log; a tensor of no layer at all is still refused."""
    folder, theirs = saved_deepseek("deepseek_v3")
    _, want = greedy_reference(theirs)

    def add_mtp(tensors):
        for name in [n for n in tensors if n.startswith("model.layers.2.")]:
            tensors[name.replace("model.layers.2.", "model.layers.3.")] = tensors[name].clone()
        tensors["model.layers.3.eh_proj.weight"] = torch.zeros(128, 256)

    with_mtp = edited(folder, tmp_path, change_tensors=add_mtp)
    with caplog.at_level(logging.INFO, logger="common.model.loading"):
        with LLM(str(with_mtp), kernel_backend="cpu", num_blocks=64) as llm:
            assert list(llm.generate([{"prompt_token_ids": IDS}], GREEDY)[0].outputs[0].token_ids) == want
    assert "under model.layers.3.*: DeepSeek-V3's multi-token-prediction layer" in caplog.text
    stray = edited(folder, tmp_path / "stray", change_tensors=lambda t: t.update(
        {"model.layers.0.self_attn.rotary.weight": torch.zeros(4)}))
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.self_attn.rotary.weight'"):
        LLM(str(stray), kernel_backend="cpu", num_blocks=16)


def test_deepseek_config_fields():
    raw = dict(COMMON, architectures=["DeepseekV3ForCausalLM"], num_hidden_layers=5, num_key_value_heads=128,
               q_lora_rank=48, n_group=4, topk_group=2, first_k_dense_replace=2,
               rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                             "mscale": 1.0, "mscale_all_dim": 1.0}, rope_theta=10000.0)
    cfg = model_config_from_dict(raw)
    assert cfg.uses_mla and cfg.kv_planes == 1 and (cfg.num_kv_heads, cfg.head_dim, cfg.rope_dim) == (1, 40, 8)
    assert cfg.moe_layers == (2, 3, 4) and cfg.moe_routing == "deepseek_v3" and cfg.n_shared_experts == 1
    assert cfg.rope_interleave and cfg.norm_topk_prob and cfg.routed_scaling_factor == 2.5
    assert cfg.rope_scaling["rope_type"] == "yarn"
    v2 = model_config_from_dict(dict(raw, architectures=["DeepseekV2ForCausalLM"], q_lora_rank=None,
                                     topk_method="group_limited_greedy", first_k_dense_replace=0))
    assert (v2.q_lora_rank, v2.moe_routing, v2.topk_method, v2.moe_layers) == (0, "deepseek_v2",
                                                                               "group_limited_greedy", (0, 1, 2, 3, 4))
    assert not v2.norm_topk_prob and v2.routed_scaling_factor == 1.0
    assert cfg.num_nextn_predict_layers == 1 and v2.num_nextn_predict_layers == 0
    bare = model_config_from_dict({k: v for k, v in raw.items() if k not in (
        "n_group", "topk_group", "n_shared_experts", "moe_intermediate_size", "first_k_dense_replace")})
    assert (bare.n_group, bare.topk_group, bare.n_shared_experts, bare.moe_intermediate_size, bare.moe_layers) == \
        (8, 4, 1, 2048, (3, 4))                                   # transformers' DeepSeek-V3 defaults
    with pytest.raises(ValueError, match="kv_lora_rank must be an integer, got None"):
        model_config_from_dict(dict(raw, kv_lora_rank=None))
    with pytest.raises(ValueError, match="qk_rope_head_dim must be even, got 7"):
        model_config_from_dict(dict(raw, qk_rope_head_dim=7))
    with pytest.raises(ValueError, match="needs n_routed_experts and num_experts_per_tok"):
        model_config_from_dict(dict(raw, n_routed_experts=None))


def test_an_int8_kv_cache_is_refused_for_mla(saved_deepseek, tmp_path):
    """msModelSlim's C8 quantizes per-head K and V; an MLA cache holds the latent: never
    served as codes nobody scales."""
    folder, _ = saved_deepseek("deepseek_v2")
    bad = edited(folder, tmp_path)
    (bad / "quant_model_description.json").write_text(json.dumps({"model_quant_type": "FLOAT",
                                                                  "kv_cache_type": "C8"}))
    with pytest.raises(ValueError, match="kv_cache_type C8 .* is not supported for MLA models"):
        LLM(str(bad), kernel_backend="cpu", num_blocks=16)


def test_the_cpu_decode_gemms_over_consecutive_blocks_and_the_paged_kernel_over_the_rest():
    """CpuBackend.mla_decode on a batch mixing sequences whose blocks are consecutive (two
    GEMMs each, kernels/mla_cpu_decode.py) and scattered ones (the paged kernel): every
    sequence equals ref's decode; an all-consecutive batch takes no paged-kernel call."""
    from kernels import get_backend
    from kernels.api import DecodeMetadata
    from kernels.mla_cpu_decode import consecutive
    from kernels.ref import RefBackend
    g = torch.Generator().manual_seed(4)
    plane = torch.randn(12, 16, 1, 40, generator=g)
    lens = [40, 17, 5, 33]
    tables = torch.tensor([[3, 4, 5], [9, 2, 0], [7, 0, 0], [0, 1, 2]], dtype=torch.int32)
    meta = DecodeMetadata(seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables, seq_lens_list=lens)
    assert consecutive(meta, 16) == [True, False, True, True]
    query = torch.randn(4, 6, 40, generator=g)
    cpu = get_backend("cpu", "cpu")
    want = RefBackend().mla_decode(query, (plane,), meta, 0.1, 32)
    torch.testing.assert_close(cpu.mla_decode(query, (plane,), meta, 0.1, 32), want, rtol=0, atol=1e-5)
    calls = []
    decode = cpu.decode
    cpu.decode = lambda *a, **k: calls.append(1) or decode(*a, **k)
    try:
        keep = [0, 2, 3]
        part = DecodeMetadata(seq_lens=meta.seq_lens[keep], block_tables=tables[keep],
                              seq_lens_list=[lens[i] for i in keep])
        torch.testing.assert_close(cpu.mla_decode(query[keep], (plane,), part, 0.1, 32), want[keep], rtol=0, atol=1e-5)
        assert calls == []
        cpu.mla_decode(query, (plane,), meta, 0.1, 32)
        assert calls == [1]                          # the scattered one alone
    finally:
        del cpu.decode
