"""Tensor parallelism inside one engine (common/parallel/): TP 2 over gloo on this CPU.

Greedy tokens at TP 2 equal TP 1 and transformers (the HF equality test's near-tie rule:
an all-reduce sums in another order), each rank holds its share of the weights, a
killed rank makes the next step raise at once, and no rank process outlives its engine.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from common.config import EngineConfig
from common.engine import LLM, SamplingParams
from common.engine.llm_engine import LLMEngine
from common.model.config import load_model_config, model_config_from_dict
from common.model.models.llama import LlamaForCausalLM
from common.parallel import check_role
from common.parallel.shard import plan_shard
from common.parallel.step_wire import INLINE_LEN, pack, unpack
from common.runner.step_inputs import StepInputs
from kernels import get_backend
from tests.conftest import BLOCK_SIZE, assert_no_blocks_in_use
from tests.unit.test_hf_equality import REL_MARGIN, count_near_tie_divergences, hf_next_token_logits

NUM_PROMPTS, NEW_TOKENS = 6, 24
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
HANG_GUARD_S = 60.0     # a wait's bound: only catches a hang, never a slow host


def child_pids() -> set[int]:
    """This process's live child processes (from /proc; zombies excluded), but for
    multiprocessing's resource tracker: one helper a process, started by the first spawn,
    that lives as long as its parent."""
    pids: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            pids.update(int(p) for p in (task / "children").read_text().split())
        except OSError:
            pass
    return {p for p in pids if _alive(p) and b"resource_tracker" not in _cmdline(p)}


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def prompts_for(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 5, 17, 40, 65, 130)[:NUM_PROMPTS]]


def generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    ids = [f"tp-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    return [tokens[rid] for rid in ids]


def engine_at(model_dir, tp: int, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(str(model_dir), num_blocks=256, block_size=BLOCK_SIZE, max_num_seqs=16,
                                  tensor_parallel_size=tp, **kwargs))


@pytest.fixture(scope="module")
def engines():
    """engines(model_dir, tp) -> LLMEngine, one per (model, size) for the module; closed
    at its end. Every test using one must leave no block in use."""
    made: dict[tuple[str, int], LLMEngine] = {}

    def get(model_dir, tp: int) -> LLMEngine:
        key = (str(model_dir), tp)
        if key not in made:
            made[key] = engine_at(model_dir, tp)
        return made[key]

    yield get
    for engine in made.values():
        engine.close()
    for engine in made.values():
        assert engine.tp is None or not any(p.is_alive() for p in engine.tp.procs)


def check_against_references(model_dir, engines) -> None:
    import transformers
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tp1, tp2 = engines(model_dir, 1), engines(model_dir, 2)
    prompts = prompts_for(ref.config.vocab_size)
    ones, twos = generate(tp1, prompts), generate(tp2, prompts)
    ties = 0
    for i, (prompt, one, two) in enumerate(zip(prompts, ones, twos)):
        assert len(two) == NEW_TOKENS
        ref_logits = hf_next_token_logits(ref, prompt, two)
        ties += count_near_tie_divergences(two, ref_logits, f"TP 2, prompt {i}")
        if one != two:   # TP 1 may part from TP 2 only where the reference is a near tie
            pos = next(j for j, (a, b) in enumerate(zip(one, two)) if a != b)
            top2 = ref_logits[pos].topk(2).values
            margin = float((top2[0] - top2[1]) / top2[0].abs())
            assert margin < REL_MARGIN, f"prompt {i}: TP 1 and TP 2 part at token {pos} (margin {margin:.2e})"
    assert ties <= 1, f"{ties} near-tie divergences at TP 2; logits look flat"
    assert_no_blocks_in_use(tp1)
    assert_no_blocks_in_use(tp2)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_models_at_tp2_match_tp1_and_transformers(arch, tiny_model, engines):
    check_against_references(tiny_model(arch), engines)


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2-tied"])
def test_save_pretrained_models_at_tp2_match_tp1_and_transformers(kind, hf_saved_model, engines):
    """llama-gqa: 8 heads over 2 KV heads (one KV head a rank); qwen2-tied: q/k/v biases
    split with their heads, the embedding tied to the vocab-parallel head."""
    check_against_references(hf_saved_model(kind), engines)


def test_kv_heads_replicated_when_tp_exceeds_them(tiny_model, engines):
    """One KV head, two ranks: each rank holds a copy of it and half the query heads."""
    model = tiny_model("llama", num_kv_heads=1)
    assert plan_shard(load_model_config(model), 2, 1).num_kv_heads == 1
    assert engines(model, 2).kv_cache.shape[4] == 1
    check_against_references(model, engines)


def test_step_bigger_than_one_broadcast(tiny_model, engines):
    """A 1500-token prefill does not fit the inline buffer: header, then payload."""
    model = tiny_model("llama")
    prompt = prompts_for(1024, seed=3)[0] * 1500
    assert len(pack(StepInputs(input_ids=prompt, positions=prompt, slots=prompt))) > INLINE_LEN
    one = generate(engines(model, 1), [prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    two = generate(engines(model, 2), [prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert one == two
    assert_no_blocks_in_use(engines(model, 2))


def test_step_inputs_round_trip():
    inputs = StepInputs(input_ids=[5, 6, 7, 8], positions=[9, 0, 1, 2], slots=[41, 64, 65, 66],
                        decode_lens=[10], decode_tables=[[2]], query_lens=[3], kv_lens=[3],
                        prefill_tables=[[4]], sample_rows=[0, 3])
    wire = pack(inputs)
    assert wire.shape == (INLINE_LEN,) and unpack(wire) == inputs
    big = StepInputs(input_ids=list(range(3000)), positions=list(range(3000)), slots=list(range(3000)),
                     query_lens=[3000], kv_lens=[3000], prefill_tables=[list(range(188))], sample_rows=[2999])
    wire = pack(big)
    assert len(wire) > INLINE_LEN and unpack(wire[:INLINE_LEN], wire[8:]) == big


def test_rank_holds_its_share_of_the_weights(hf_saved_model):
    """Exact bytes per rank from the config: split matrices halve, norms stay whole,
    embedding and head hold half the vocabulary each."""
    model = hf_saved_model("llama-gqa")
    cfg = load_model_config(model)
    h, i, v, hd = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    layer_whole = (q + 2 * kv) * h + h * q + 2 * i * h + h * i + 2 * h
    whole = cfg.num_layers * layer_whole + 2 * v * h + h
    layer_half = (q // 2 + kv) * h + h * q // 2 + i * h + h * i // 2 + 2 * h
    half = cfg.num_layers * layer_half + 2 * (v // 2) * h + h
    backend = get_backend("ref", "cpu")
    sizes = []
    for shard in (None, plan_shard(cfg, 2, 0), plan_shard(cfg, 2, 1)):
        lm = LlamaForCausalLM(cfg, backend, torch.float32, max_positions=64, shard=shard)
        lm.load_weights(model)
        sizes.append(sum(p.numel() * p.element_size() for p in lm.parameters()))
    assert sizes == [4 * whole, 4 * half, 4 * half]
    assert sizes[1] < 0.51 * sizes[0]


def wait_until(done) -> None:
    """Until done() is true, HANG_GUARD_S at most (the assert after says what never came)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not done() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_killed_rank_fails_the_next_step_at_once(tiny_model, monkeypatch):
    """Once the rank has exited (its process gone: tp.failure() says so), the very next
    step raises before any collective: none waits for a peer that is gone."""
    before = child_pids()
    engine = engine_at(tiny_model("llama"), 2)
    worker = engine.tp.pids[0]
    assert worker in child_pids() - before
    rng = random.Random(1)
    params = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
    for n in range(4):
        engine.add_request(f"kill-{n}", [rng.randrange(3, 1000) for _ in range(30)], params)
    for _ in range(3):
        engine.step()
    os.kill(worker, signal.SIGKILL)
    wait_until(lambda: engine.tp.failure() is not None)
    assert engine.tp.failure() == f"tensor-parallel rank 1 (pid {worker}) exited"
    collectives = []
    for name in ("broadcast", "all_reduce", "gather"):
        monkeypatch.setattr(engine.tp.group, name, lambda *a, name=name, **kw: collectives.append(name))
    with pytest.raises(RuntimeError, match=rf"rank 1 \(pid {worker}\) exited with code -9"):
        engine.step()
    assert collectives == []
    with pytest.raises(RuntimeError, match="rank 1"):   # and every later step
        engine.step()
    for n in range(4):
        engine.abort(f"kill-{n}")
    assert_no_blocks_in_use(engine)
    engine.close()
    assert not child_pids() - before


def test_close_stops_every_rank(tiny_model):
    """The offline LLM as a context manager: its engine's ranks stop on the way out."""
    before = child_pids()
    with LLM(str(tiny_model("llama")), num_blocks=64, tensor_parallel_size=2) as llm:
        assert len(child_pids() - before) == 1
        out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, temperature=0.0))
        assert len(out[0].outputs[0].token_ids) == 3
    assert not child_pids() - before
    llm.close()   # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        generate(llm.engine, [[5, 6, 7]])
    for rid in list(llm.engine._requests):
        llm.engine.abort(rid)
    assert_no_blocks_in_use(llm.engine)


def test_ranks_exit_when_rank_0_is_killed(tiny_model):
    """rank 0's process killed by a signal (no cleanup runs): its workers exit anyway."""
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from common.config import EngineConfig
        from common.engine.llm_engine import LLMEngine
        engine = LLMEngine(EngineConfig({str(tiny_model("llama"))!r}, num_blocks=16, tensor_parallel_size=2))
        print(engine.tp.pids[0], flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(proc.stdout.readline())
        assert _alive(worker)
        proc.send_signal(signal.SIGKILL)
        proc.wait(HANG_GUARD_S)
        wait_until(lambda: not _alive(worker))
        assert not _alive(worker), f"rank 1 (pid {worker}) outlived its rank 0"
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "2"])
def test_bad_tensor_parallel_size_names_the_field(value, tiny_model):
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be an integer >= 1"):
        EngineConfig(str(tiny_model("llama")), tensor_parallel_size=value)


def test_size_that_does_not_divide_the_model_is_refused_before_any_rank_starts(tiny_model):
    before = child_pids()
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not fit LlamaForCausalLM: "
                                         r"num_attention_heads=8 .*allowed: \[1, 2, 4, 8\]"):
        engine_at(tiny_model("llama"), 3)
    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 192,
           "intermediate_size": 384, "num_hidden_layers": 1, "num_attention_heads": 12,
           "num_key_value_heads": 3}
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not fit .*num_key_value_heads=3 "
                                         r"must be a multiple of it .*allowed: \[1, 3, 6, 12\]"):
        plan_shard(model_config_from_dict(raw), 4, 0)
    assert not child_pids() - before


def test_nodes_that_move_kv_at_tensor_parallelism_need_a_transfer_between_processes():
    check_role("both", 2, "fake")
    check_role("prefill", 1, "fake")
    check_role("prefill", 2, "mooncake")
    check_role("decode", 4, "grpc")
    with pytest.raises(ValueError, match=r"tensor_parallel_size > 1 on a decode node needs a transfer backend "
                                         r"between processes \(mooncake or grpc\), not 'fake'"):
        check_role("decode", 2, "fake")
