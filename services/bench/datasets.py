"""What a serving benchmark sends: a list of BenchRequest, made reproducibly.

    random_requests(n, input_len, output_len, ...)   log-normal lengths around the means
                                                     (seeded), random token ids
    shared_prefix_requests(num_groups, ...)          groups sharing a system prompt (SGLang's
                                                     generated-shared-prefix), then a question
    jsonl_requests(path, output_len)                 one JSON object a line: "prompt" (text) or
                                                     "prompt_token_ids", optional "max_tokens"

Token ids are drawn from [FIRST_ID, vocab_size): the lowest ids are the tiny models'
special tokens. Every request is greedy and, unless it says otherwise (ignore_eos False:
a JSONL line's "ignore_eos": false), runs its max_tokens, so two servers given the same
requests make the same number of tokens.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

FIRST_ID = 3


@dataclass(frozen=True)
class BenchRequest:
    max_tokens: int
    prompt_token_ids: tuple[int, ...] = ()
    prompt: str = ""                       # text instead of ids (the server tokenizes it)
    group: int = field(default=-1, compare=False)   # shared-prefix group, -1 if none
    ignore_eos: bool = True                # False: the request may stop early at EOS

    @property
    def num_prompt_tokens(self) -> int:
        """0 for a text prompt (the server counts its tokens)."""
        return len(self.prompt_token_ids)


def _lognormal_lengths(rng: random.Random, n: int, mean: int, sigma: float, low: int, high: int) -> list[int]:
    """n lengths of median `mean`, spread by sigma (0 = all equal), clamped to [low, high]."""
    if mean < 1:
        raise ValueError(f"a mean length must be >= 1, got {mean}")
    return [min(high, max(low, round(mean * math.exp(rng.gauss(0.0, sigma))))) if sigma > 0 else mean
            for _ in range(n)]


def random_requests(num_prompts: int, input_len: int, output_len: int, vocab_size: int, sigma: float = 0.5,
                    seed: int = 0, max_model_len: int = 0) -> list[BenchRequest]:
    """Prompts and outputs whose lengths are log-normal around input_len and output_len;
    prompt + output within max_model_len when it is given."""
    rng = random.Random(seed)
    cap = max_model_len or 1 << 30
    inputs = _lognormal_lengths(rng, num_prompts, input_len, sigma, 1, max(1, cap - 2))
    outputs = _lognormal_lengths(rng, num_prompts, output_len, sigma, 1, cap)
    requests = []
    for n_in, n_out in zip(inputs, outputs):
        n_out = max(1, min(n_out, cap - n_in))
        ids = tuple(rng.randrange(FIRST_ID, vocab_size) for _ in range(n_in))
        requests.append(BenchRequest(max_tokens=n_out, prompt_token_ids=ids))
    return requests


def shared_prefix_requests(num_groups: int, prompts_per_group: int, system_len: int, question_len: int,
                           output_len: int, vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    """num_groups system prompts of system_len tokens, each followed by prompts_per_group
    questions of question_len tokens; the requests are shuffled (groups interleave)."""
    rng = random.Random(seed)
    requests = []
    for group in range(num_groups):
        system = [rng.randrange(FIRST_ID, vocab_size) for _ in range(system_len)]
        for _ in range(prompts_per_group):
            question = [rng.randrange(FIRST_ID, vocab_size) for _ in range(question_len)]
            requests.append(BenchRequest(max_tokens=output_len, prompt_token_ids=tuple(system + question),
                                         group=group))
    rng.shuffle(requests)
    return requests


def jsonl_requests(path: str | Path, output_len: int, num_prompts: int = 0) -> list[BenchRequest]:
    """The file's requests, in order (the first num_prompts when > 0); a line's
    "ignore_eos" (default true) is kept. ValueError naming the line for one with neither
    "prompt" nor "prompt_token_ids"."""
    requests = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not JSON ({e.msg})") from None
        max_tokens = int(item.get("max_tokens") or output_len)
        ignore_eos = bool(item.get("ignore_eos", True))
        if isinstance(item.get("prompt_token_ids"), list) and item["prompt_token_ids"]:
            requests.append(BenchRequest(max_tokens, prompt_token_ids=tuple(int(i) for i in item["prompt_token_ids"]),
                                         ignore_eos=ignore_eos))
        elif isinstance(item.get("prompt"), str) and item["prompt"]:
            requests.append(BenchRequest(max_tokens, prompt=item["prompt"], ignore_eos=ignore_eos))
        else:
            raise ValueError(f'{path}:{number}: needs a non-empty "prompt" (text) or "prompt_token_ids" (list)')
        if num_prompts and len(requests) == num_prompts:
            break
    if not requests:
        raise ValueError(f"{path} holds no request")
    return requests
