"""`pdmesh eval`: the windows' index arithmetic scores every token but the first exactly
once; perplexity equals the one computed by hand from the engine's full distributions;
a model against itself has KL 0 and agreement 1.0; bad arguments name the field."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from services.cli import main as pdmesh
from services.eval.agreement import agreement
from services.eval.perplexity import perplexity, scored_logprobs
from services.eval.scorers import EngineScorer
from services.eval.windows import Window, prompt_windows, sliding_windows
from tests.conftest import BLOCK_SIZE

GPL3 = Path("/usr/share/common-licenses/GPL-3")


def test_the_documented_example():
    assert sliding_windows(10, 6, 3) == [Window(0, 6, 1), Window(3, 9, 6), Window(6, 10, 9)]


@pytest.mark.parametrize("num_tokens", [2, 3, 7, 64, 100, 511, 512, 513, 1000, 7639])
@pytest.mark.parametrize("window,stride", [(2, 1), (5, 3), (5, 4), (64, 63), (512, 256), (512, 1), (100, 37)])
def test_every_token_but_the_first_is_scored_exactly_once(num_tokens, window, stride):
    windows = sliding_windows(num_tokens, window, stride)
    targets = [t for w in windows for t in range(w.first_scored, w.end)]
    assert targets == list(range(1, num_tokens))
    for k, w in enumerate(windows):
        assert w.begin == k * stride and w.end - w.begin <= window and w.begin < w.first_scored <= w.end
        assert w.end == min(w.begin + window, num_tokens)
    assert windows[-1].end == num_tokens and all(w.end < num_tokens for w in windows[:-1])
    # as much left context as the window allows: a target's row is inside its window
    row = list(range(window - 1))
    for w in windows:
        assert scored_logprobs(w, row[:w.end - w.begin - 1]) == row[w.first_scored - w.begin - 1:w.end - w.begin - 1]


@pytest.mark.parametrize("args,message", [
    ((10, 1, 1), r"window must be an integer >= 2, got 1"),
    ((10, 4, 4), r"stride must be an integer in \[1, window - 1 = 3\] \(windows must overlap, else tokens go "
                 r"unscored\), got 4"),
    ((10, 4, 0), r"stride must be an integer in \[1, window - 1 = 3\]"),
    ((1, 4, 2), r"the text has 1 token\(s\); at least 2 are needed to score one"),
])
def test_bad_windows_name_the_field(args, message):
    with pytest.raises(ValueError, match=message):
        sliding_windows(*args)


def test_prompt_windows():
    assert prompt_windows(1000, 3, 256) == [(0, 256), (256, 512), (512, 768)]
    assert prompt_windows(600, 8, 256) == [(0, 256), (256, 512)]
    with pytest.raises(ValueError, match=r"fewer than one prompt of prompt_len=256"):
        prompt_windows(255, 8, 256)
    with pytest.raises(ValueError, match=r"num_prompts must be an integer >= 1, got 0"):
        prompt_windows(1000, 0, 256)


@pytest.fixture(scope="module")
def llm(tiny_model, llm_factory):
    return llm_factory(tiny_model("llama"), num_blocks=256, block_size=BLOCK_SIZE, max_num_batched_tokens=96)


def by_hand(llm, ids: list[int], window: int, stride: int) -> tuple[float, int]:
    """Mean NLL from LLM.prompt_logprobs_full of each window, and the count scored."""
    total, n = 0.0, 0
    for w in sliding_windows(len(ids), window, stride):
        full = llm.prompt_logprobs_full(ids[w.begin:w.end])
        for t in range(w.first_scored, w.end):
            total -= float(full[t - w.begin - 1, ids[t]])
            n += 1
    return total / n, n


def test_perplexity_equals_the_full_distributions(llm):
    ids = llm.tokenizer.encode(GPL3.read_text())[:300]
    result = perplexity(ids, 64, 24, EngineScorer(llm, batch=3))
    nll, n = by_hand(llm, ids, 64, 24)
    assert (result.scored, result.num_windows) == (299, 11) and n == 299   # begins 0, 24, ..., 240
    assert abs(result.nll - nll) < 1e-5 and result.ppl == pytest.approx(math.exp(nll), rel=1e-5)


def test_the_cli_writes_the_numbers(llm, tiny_model, tmp_path, capsys):
    out = tmp_path / "ppl.json"
    assert pdmesh(["eval", "--model", str(tiny_model("llama")), "--text", "gpl-3", "--window", "64",
                   "--stride", "32", "--max-tokens", "200", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    ids = llm.tokenizer.encode(GPL3.read_text())
    nll, n = by_hand(llm, ids[:200], 64, 32)
    assert result["scored"] == n == 199 and result["num_windows"] == 6 and result["num_tokens"] == 200
    assert result["nll"] == pytest.approx(nll, rel=1e-5) and result["ppl"] == pytest.approx(math.exp(nll), rel=1e-5)
    import hashlib
    assert result["text_sha256"] == hashlib.sha256(GPL3.read_bytes()).hexdigest()
    assert (result["window"], result["stride"], result["dtype"]) == (64, 32, "float32")
    assert result["model_id"] == tiny_model("llama").name
    assert result["special_ids"] == [1] == ids[:1]   # the tiny tokenizer adds a BOS by itself
    assert capsys.readouterr().out.strip() == result["summary"]
    assert result["summary"].startswith(f"perplexity {result['ppl']:.4f} (nll ")


def test_a_model_against_itself(tiny_model, llm, tmp_path, capsys):
    """Two engines of the same folder (A's distributions computed by one, B's by the
    other): KL exactly 0, agreement 1.0; through the CLI too."""
    from common.engine import LLM
    other = LLM(str(tiny_model("llama")), num_blocks=256, block_size=BLOCK_SIZE, max_num_batched_tokens=96)
    ids = llm.tokenizer.encode(GPL3.read_text())
    prompts = [ids[a:b] for a, b in prompt_windows(len(ids), 3, 50)]
    result = agreement(llm, other, prompts)
    assert (result.agreement, result.kl, result.positions, result.num_prompts) == (1.0, 0.0, 147, 3)
    out = tmp_path / "kl.json"
    model = str(tiny_model("llama"))
    assert pdmesh(["eval", "--model", model, "--reference", model, "--num-prompts", "2", "--prompt-len", "40",
                   "--json", str(out)]) == 0
    cli = json.loads(out.read_text())
    assert (cli["agreement"], cli["kl"], cli["positions"], cli["num_prompts"]) == (1.0, 0.0, 78, 2)
    assert capsys.readouterr().out.strip() == cli["summary"]


def test_kl_against_another_model_is_the_definition(tiny_model, llm, llm_factory):
    other = llm_factory(tiny_model("llama", seed=5), num_blocks=256, block_size=BLOCK_SIZE)
    ids = llm.tokenizer.encode(GPL3.read_text())[:120]
    result = agreement(llm, other, [ids[:60], ids[60:]])
    a = torch.cat([llm.prompt_logprobs_full(ids[:60]), llm.prompt_logprobs_full(ids[60:])]).double()
    b = torch.cat([other.prompt_logprobs_full(ids[:60]), other.prompt_logprobs_full(ids[60:])]).double()
    kl = float((b.exp() * (b - a)).sum(-1).mean())
    assert result.positions == 118 and result.agreement < 1.0   # unrelated random weights
    assert result.kl == pytest.approx(kl, rel=1e-4) and result.kl > 0.1
    assert result.agreement == float((a.argmax(-1) == b.argmax(-1)).double().mean())


@pytest.mark.parametrize("argv,message", [
    (["eval", "--text", "gpl-3"], "give exactly one of --model or --gateway"),
    (["eval", "--model", "M", "--gateway", "h:1", "--text", "gpl-3"], "give exactly one of --model or --gateway"),
    (["eval", "--gateway", "h:1", "--reference", "R"], "--reference runs in this process"),
    (["eval", "--model", "M"], "--text FILE is needed for perplexity"),
    (["eval", "--model", "M", "--text", "/nonexistent/text"], "No such file"),
])
def test_bad_arguments_exit_2_naming_them(argv, message, capsys):
    assert pdmesh(argv) == 2
    assert message in capsys.readouterr().err


def test_a_window_past_max_model_len_names_window(tiny_model, llm_factory):
    small = llm_factory(tiny_model("llama"), num_blocks=256, block_size=BLOCK_SIZE, max_model_len=128)
    with pytest.raises(ValueError, match=r"window must be <= 127 \(the model's max_model_len - 1\), got 128"):
        perplexity(list(range(3, 300)), 128, 64, EngineScorer(small))
