"""Offline API, vLLM-style:

    from common.engine import LLM, SamplingParams
    llm = LLM("path/to/hf_model", max_num_seqs=16)
    outs = llm.generate(["Hello", {"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=8))
    outs[0].outputs[0].text, .token_ids, .finish_reason
    outs[0].prompt_logprobs                # SamplingParams(prompt_logprobs=k): per position
    llm.prompt_logprobs_full([5, 6, 7])    # float32 [2, vocab]: the full log-distributions

Every prompt and its parameters are validated before anything is scheduled; a bad one
raises ValueError naming the field, and the engine keeps no trace of the call.
"""
from __future__ import annotations

import itertools
from typing import Any, Union

import torch

from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.engine.outputs import CompletionOutput, RequestOutput
from common.engine.sampling_params import SamplingParams
from common.engine.stop_strings import StopStringMatcher
from common.model.detokenizer import IncrementalDetokenizer
from common.model.tokenizer import Tokenizer

PromptType = Union[str, dict[str, Any]]


class _Tracker:
    def __init__(self, request_id: str, prompt: str | None, ids: list[int], params: SamplingParams,
                 tokenizer: Tokenizer):
        self.request_id, self.prompt, self.prompt_ids, self.params = request_id, prompt, ids, params
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.detok = IncrementalDetokenizer(tokenizer, ids) if params.stop else None
        self.matcher = StopStringMatcher(params.stop)
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.num_cached_tokens = 0
        self.prompt_logprobs: list[dict[int, float] | None] | None = None


class LLM:
    def __init__(self, model: str, **engine_args: Any):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **engine_args))
        try:
            self.tokenizer = self.engine.tokenizer or Tokenizer.from_dir(model)  # raises naming the file
        except BaseException:
            self.engine.close()
            raise
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's tensor-parallel rank processes (idempotent; nothing to stop at
        tensor_parallel_size 1). `with LLM(...) as llm:` closes it on the way out."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _prompt_ids(self, prompt: PromptType, index: int) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"prompts[{index}]: prompt must not be empty")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        raise ValueError(f"prompts[{index}] must be a string or a dict with 'prompt_token_ids', "
                         f"got {type(prompt).__name__}")

    def generate(self, prompts: PromptType | list[PromptType],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params has {len(sampling_params)} entries; it must be one "
                             f"or one per prompt ({len(prompts)})")
        trackers: list[_Tracker] = []
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            text, ids = self._prompt_ids(prompt, i)
            rid = f"offline-{next(self._ids)}"
            try:
                self.engine.validate_request(rid, ids, params)
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None
            trackers.append(_Tracker(rid, text, ids, params, self.tokenizer))
        by_id = {t.request_id: t for t in trackers}
        for t in trackers:
            self.engine.add_request(t.request_id, t.prompt_ids, t.params)
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    self._record(by_id[out.request_id], out)
        finally:
            for t in trackers:
                if t.finish_reason is None:
                    self.engine.abort(t.request_id)
        return [self._result(t) for t in trackers]

    def _record(self, t: _Tracker, out) -> None:
        t.token_ids.extend(out.new_token_ids)
        t.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            t.prompt_logprobs = out.prompt_logprobs
        if t.logprobs is not None and out.new_logprobs:
            t.logprobs.extend(out.new_logprobs)
        if t.detok is not None:
            emitted, stopped = t.matcher.feed(t.detok.add(out.new_token_ids))
            t.text += emitted
            if stopped and not out.finished:
                self.engine.abort(t.request_id)
            if stopped:
                t.finish_reason, t.stop_reason = "stop", t.matcher.stopped_by
                return
        if out.finished:
            t.finish_reason = out.finish_reason
            if t.finish_reason == "stop":
                t.stop_reason = t.token_ids[-1]

    def _result(self, t: _Tracker) -> RequestOutput:
        if t.detok is None:
            text = self.tokenizer.decode(t.token_ids)
        else:
            text = t.text if t.matcher.stopped_by else t.text + t.matcher.feed(t.detok.flush())[0] + t.matcher.flush()
        completion = CompletionOutput(0, text, t.token_ids, t.finish_reason, t.logprobs, t.stop_reason)
        return RequestOutput(t.request_id, t.prompt, t.prompt_ids, [completion], t.num_cached_tokens,
                             prompt_logprobs=t.prompt_logprobs)

    def prompt_logprobs_full(self, token_ids: list[int]) -> torch.Tensor:
        """Teacher-forced full distributions of a prompt: float32 log-softmax rows
        [len(token_ids) - 1, vocab] on the CPU, row i predicting token i + 1, through the
        engine's own path (a prompt sink: computed in full, no prefix hit, in chunks and
        slices as any prompt). One token is sampled (greedy) and dropped, so
        len(token_ids) + 1 must fit max_model_len. ValueError naming the field for a bad
        prompt."""
        ids = list(token_ids)
        vocab = self.engine.vocab_size
        rid = f"offline-{next(self._ids)}"
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        self.engine.validate_request(rid, ids, params)
        rows = torch.empty(max(len(ids) - 1, 0), vocab, dtype=torch.float32)

        def sink(start: int, logp: torch.Tensor) -> None:
            rows[start:start + logp.shape[0]] = logp[:, :vocab].to("cpu", torch.float32)

        self.engine.add_request(rid, ids, params, prompt_sink=sink)
        finished = False
        try:
            while not finished and self.engine.has_unfinished():
                finished = any(out.finished for out in self.engine.step() if out.request_id == rid)
        finally:
            if not finished:
                self.engine.abort(rid)
        return rows
