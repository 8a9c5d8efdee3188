"""The real-model prompt set: chat requests to SmolLM2-135M-Instruct with ShareGPT-like
lengths, written as JSONL for `pdmesh bench serve --dataset jsonl` and bench/vs_vllm.py.

    python bench/chat_dataset.py [--num-requests 64] [--seed 0] [--out bench/datasets/smollm2_chat.jsonl]

Each request is one user turn in the model's chat template (ChatML, its default system
prompt): a question alone, or, for the longer prompts, a passage of real English (the
GPL-3 and Apache-2.0 texts every Debian machine has, /usr/share/common-licenses) and a
question about it. Prompt lengths are log-normal around a median of 190 tokens and
outputs around 65 (sigma 0.5, ShareGPT-like, as the random dataset), every request
ignore_eos so that two servers make the same number of tokens. A line holds the prompt's
token ids (the same ids reach every server: tokenization is not what is compared), the
messages (to read), max_tokens and ignore_eos. The file is committed; this script is
how it was written (it needs the model: `pdmesh models pull smollm2-135m-instruct`).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import re
from pathlib import Path

from bench_model import ROOT

TEXTS = [Path("/usr/share/common-licenses/GPL-3"), Path("/usr/share/common-licenses/Apache-2.0")]
QUESTIONS = [
    "What is the main point of this passage?", "Summarize the passage in two sentences.",
    "Which obligations does this text describe?", "Explain this passage to a child.",
    "List the key terms used in this passage.", "What rights does this passage grant?",
    "Rewrite the first sentence in plain English.", "Is anything in this passage surprising? Why?",
]
SHORT_QUESTIONS = [
    "What is the capital of France?", "Write a haiku about autumn.", "How do I boil an egg?",
    "Name three uses of a paperclip.", "What is the difference between weather and climate?",
    "Give me a tip for writing clean code.", "Why is the sky blue?", "What is a prime number?",
    "Suggest a name for a small bakery.", "How many continents are there?",
    "Explain what a database index is.", "Write a limerick about a cat.",
]
MEDIAN_PROMPT, MEDIAN_OUTPUT, SIGMA = 190, 65, 0.5
PROMPT_RANGE, OUTPUT_RANGE = (24, 1024), (8, 512)


def lognormal(rng: random.Random, median: int, bounds: tuple[int, int]) -> int:
    return min(bounds[1], max(bounds[0], round(median * math.exp(rng.gauss(0.0, SIGMA)))))


def sentences() -> list[str]:
    text = " ".join(p.read_text() for p in TEXTS if p.is_file())
    text = re.sub(r"\s+", " ", text)
    return [s.strip() for s in re.split(r"(?<=[.;:])\s", text) if len(s.split()) >= 4]


def build(model_dir: Path, num_requests: int, seed: int) -> list[dict]:
    from common.model.tokenizer import Tokenizer
    from services.gateway.openai_http.chat_template import ChatTemplate
    tokenizer, template = Tokenizer.from_dir(model_dir), ChatTemplate.from_dir(model_dir)
    pool, rng, lines = sentences(), random.Random(seed), []

    def ids_of(content: str) -> list[int]:
        return tokenizer.encode(template.render([{"role": "user", "content": content}]), add_special_tokens=False)

    for _ in range(num_requests):
        target = lognormal(rng, MEDIAN_PROMPT, PROMPT_RANGE)
        content = rng.choice(SHORT_QUESTIONS)
        if len(ids_of(content)) < target:            # a passage and a question about it, up to the target
            start, question, passage = rng.randrange(len(pool)), rng.choice(QUESTIONS), []
            while True:
                passage.append(pool[(start + len(passage)) % len(pool)])
                longer = f"Read this passage:\n\n{' '.join(passage)}\n\n{question}"
                if len(ids_of(longer)) > target and len(passage) > 1:
                    break
                content = longer
        lines.append({"messages": [{"role": "user", "content": content}], "prompt_token_ids": ids_of(content),
                      "max_tokens": lognormal(rng, MEDIAN_OUTPUT, OUTPUT_RANGE), "ignore_eos": True})
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "datasets" / "smollm2_chat.jsonl"))
    args = ap.parse_args()
    from common.model.catalog import pull_model
    model = Path(args.model)
    if not (model / "config.json").exists():
        model = pull_model("smollm2-135m-instruct", folder=model)
    lines = build(model, args.num_requests, args.seed)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))
    prompt = sorted(len(x["prompt_token_ids"]) for x in lines)
    output = sorted(x["max_tokens"] for x in lines)
    print(f"wrote {args.out}: {len(lines)} requests; prompt tokens median {prompt[len(prompt) // 2]} "
          f"(min {prompt[0]}, max {prompt[-1]}), max_tokens median {output[len(output) // 2]} "
          f"(min {output[0]}, max {output[-1]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
