"""Activation statistics of every linear layer's input, from calibration prompts run
through the float model (the engine on the ref backend, a forward pre-hook per Linear).

A Linear fuses projections that share one input (q/k/v, gate/up), so the statistics are
per Linear and apply to each of its projections. Kept per input channel j:
min_j, max_j (float64), the number of tokens, with `hessian` the sum of x^T x (GPTQ's
H / 2), float64 [in, in], and with `samples` a fixed-size random sample of the input rows
(float32; reservoir sampling, seeded: the same prompts give the same sample), on which
smoothing measures what each migration strength costs.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger("pdmesh.quantize")


@dataclass
class InputStats:
    """What the calibration saw at one Linear's input."""

    projections: list[str]          # checkpoint names, e.g. "model.layers.0.self_attn.q_proj"
    min: torch.Tensor               # float64 [in]
    max: torch.Tensor               # float64 [in]
    num_tokens: int = 0
    xtx: torch.Tensor | None = None   # float64 [in, in]: sum over tokens of x x^T
    max_samples: int = 0
    samples: torch.Tensor | None = None   # float32 [<= max_samples, in]
    static_range: tuple[float, float] | None = None   # W8A8 static's [lo, hi]; None: [min, max]
    _seen: bool = field(default=False, repr=False)
    _rng: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(0), repr=False)

    @property
    def input_range(self) -> tuple[float, float]:
        """The [lo, hi] a static quantization of this input covers."""
        return self.static_range or (float(self.min.min()), float(self.max.max()))

    @property
    def absmax(self) -> torch.Tensor:
        return torch.maximum(self.min.abs(), self.max.abs())

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).double()
        if self._seen:
            torch.minimum(self.min, x.amin(0), out=self.min)
            torch.maximum(self.max, x.amax(0), out=self.max)
        else:
            self.min, self.max, self._seen = x.amin(0), x.amax(0), True
        if self.max_samples:
            self._sample(x.float())
        self.num_tokens += x.shape[0]
        if self.xtx is not None:
            self.xtx += x.t() @ x

    def _sample(self, rows: torch.Tensor) -> None:
        """Reservoir sampling (Algorithm R): every row seen so far is in the sample with the
        same probability."""
        held = 0 if self.samples is None else self.samples.shape[0]
        take = min(rows.shape[0], self.max_samples - held)
        if take:
            self.samples = rows[:take].clone() if self.samples is None else torch.cat([self.samples, rows[:take]])
        rest = rows[take:]
        if rest.shape[0]:
            seen = self.num_tokens + take + torch.arange(rest.shape[0], dtype=torch.float64)   # rows before each
            slot = (torch.rand(rest.shape[0], generator=self._rng, dtype=torch.float64) * (seen + 1)).long()
            for i in (slot < self.max_samples).nonzero().flatten().tolist():   # in order: a later row wins
                self.samples[slot[i]] = rest[i]


def calibrate(model_dir: str | Path, prompts: list[list[int]], hessian: bool = False,
              kv: dict[int, dict[str, torch.Tensor]] | None = None, samples: int = 0) -> dict[str, InputStats]:
    """Linear module name (e.g. "layers.0.self_attn.qkv") -> InputStats over all prompts.
    kv: filled with layer -> {"k": max|key|, "v": max|value|} per channel (float64
    [kv_heads * head_dim]) of what each layer writes into its KV cache (keys after rotary):
    a C8 cache's ranges."""
    from common.engine import LLM
    longest = max(len(p) for p in prompts)
    llm = LLM(str(model_dir), kernel_backend="ref", max_model_len=longest + 2,
              num_blocks=2 * (longest // 16 + 2), max_num_seqs=1)
    stats: dict[str, InputStats] = {}
    if kv is not None:
        model = llm.engine.model
        model.backend = KVRecorder(model.backend, len(model.layers), kv)   # this model's alone
    try:
        for name, linear in llm.engine.model.linears():
            width = linear.in_features
            stats[name] = InputStats(linear.projections, torch.zeros(width, dtype=torch.float64),
                                     torch.zeros(width, dtype=torch.float64),
                                     xtx=torch.zeros(width, width, dtype=torch.float64) if hessian else None,
                                     max_samples=samples)
            linear.register_forward_pre_hook(lambda _m, args, s=stats[name]: s.add(args[0]))
        for i, prompt in enumerate(prompts, 1):
            llm.prompt_logprobs_full(prompt)
            log.info("calibration prompt %d/%d (%d tokens)", i, len(prompts), len(prompt))
    finally:
        llm.close()
    return stats


def calibration_prompts(model_dir: str | Path, path: str | Path, num_prompts: int, tokens_per_prompt: int
                        ) -> list[list[int]]:
    """Token ids of calibration prompts from a text file (cut into pieces of
    tokens_per_prompt tokens) or a JSONL file (one prompt a line: {"text": ...},
    {"prompt": ...} or {"messages": [...]} in the model's chat template), num_prompts at
    most. ValueError naming the file and line for a line it cannot read."""
    import json
    from common.model.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_dir(str(model_dir))
    path = Path(path)
    prompts: list[list[int]] = []
    if path.suffix == ".jsonl":
        template = None
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not JSON ({e})") from None
            if "messages" in row:
                if template is None:
                    from services.gateway.openai_http.chat_template import ChatTemplate
                    template = ChatTemplate.from_dir(str(model_dir))
                    if template is None:
                        raise ValueError(f"{path}:{number}: \"messages\" needs a chat template; "
                                         f"{model_dir} has none")
                text = template.render(row["messages"], add_generation_prompt=False)
            elif isinstance(row.get("text", row.get("prompt")), str):
                text = row.get("text", row.get("prompt"))
            else:
                raise ValueError(f"{path}:{number}: needs a \"text\", \"prompt\" or \"messages\" field")
            prompts.append(tokenizer.encode(text)[:tokens_per_prompt])
            if len(prompts) == num_prompts:
                break
    else:
        ids = tokenizer.encode(path.read_text())
        prompts = [ids[i:i + tokens_per_prompt] for i in range(0, len(ids), tokens_per_prompt)][:num_prompts]
    prompts = [p for p in prompts if len(p) >= 2]
    if not prompts:
        raise ValueError(f"{path}: no calibration prompt of 2 tokens or more")
    return prompts


class KVRecorder:
    """The backend as one model sees it, with write_kv recording: the model calls it once a
    layer, in layer order, with the keys after rotary and the values as they enter the
    cache. Everything else is the backend's (which other engines share: it is not patched)."""

    def __init__(self, backend, num_layers: int, kv: dict[int, dict[str, torch.Tensor]]):
        self._backend, self._num_layers, self._kv, self._calls = backend, num_layers, kv, 0

    def __getattr__(self, name: str):
        return getattr(self._backend, name)

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping):
        layer = self._kv.setdefault(self._calls % self._num_layers, {})
        self._calls += 1
        for name, x in (("k", key), ("v", value)):
            amax = x.detach().double().abs().reshape(x.shape[0], -1).amax(0)
            layer[name] = torch.maximum(layer[name], amax) if name in layer else amax
        return self._backend.write_kv(key, value, k_cache, v_cache, slot_mapping)
