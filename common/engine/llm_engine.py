"""The engine core: validated requests in, tokens out. Token ids only; text lives in LLM
(offline) and in the gateway.

Lifecycle of a request (states and transitions: common/engine/lifecycle.py, owned by the
scheduler): add_request (validated, WAITING) -> step()* (admitted, prefilled in chunks,
decoded) -> FINISHED (stop | length) or abort() -> blocks freed at once.

Every token the engine emits, from a step or from committing a remote prefill, is queued
in one ordered list of StepOutputs; `take_outputs()` hands them over in the order they
were produced (`step()` returns them). That list is the engine's only way out.

The narrow interface services drive it through:
- decode node: add_request(kv_remote=True) -> on admission `on_remote_admit(seq)` gets
  the block ids -> commit_remote(first token) once a prefill node wrote the KV, or
  fail_remote(writer_settled) to compute it here (in fresh blocks when the writer has not
  confirmed it stopped: the old ones are quarantined until release_quarantine).
- prefill node: add_request(hold_blocks=True, on_computed=cb): cb(seq, start, end) after
  each step that computed tokens [start, end); when cb has an `on_layer` attribute, also
  cb.on_layer(seq, layer, start, end) inside the step's forward pass, right after each
  layer wrote that KV (common/engine/step_runner.py; layerwise KV push); finished, the
  blocks stay HELD (the KV is being pushed) until release(). With kv_remote=True as
  well, admission parks it in KV_REMOTE while the kv-store fills leading blocks;
  commit_loaded(n) makes it compute the prompt from token n on.
- abort(request_id, writer_settled=False) while a remote fill is unconfirmed quarantines.
- prompt logits: params.prompt_logprobs and/or add_request(prompt_sink=fn): the prompt is
  computed here in full (no prefix hit; kv_remote refused), each step's score rows go
  through `_prompt_logits` (log-softmax once, then the per-position entries and the
  sink), and the first StepOutput carries `prompt_logprobs` (list, None at position 0).

Not thread-safe: one thread at a time calls into it (AsyncEngine owns that). One
exception: `forward_window()` (a context manager, nullcontext by default) is entered
around each step's forward pass, during which the step reads only its scheduled
sequences and writes only the KV of their blocks; inside it another thread may call
what leaves those sequences and their blocks alone (add_request, admit_remote,
commit_remote, commit_loaded, fail_remote, release, release_quarantine, stats,
expert_tokens, take_outputs), never abort or step.
"""
from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Callable, ContextManager

import torch

from common.config import EngineConfig
from common.engine_config import resolved_w8a8_mix_path
from common import cpu_budget
from common.engine.borrowed_cores import BorrowedCores
from common.engine.block_manager import BlockManager
from common.engine.expert_load import ExpertLoad
from common.engine.step_runner import StepRunner
from common.engine.sampler import compute_logprobs, sample
from common.engine.sampling_params import SamplingParams
from common.engine.lifecycle import RequestState
from common.engine.scheduler import Scheduler
from common.engine.sequence import Sequence
from common.engine.step_output import StepOutput
from common.engine.validation import validate_request, validate_resume_position
from common.hashing import layout_key
from common.kv_layout import KVLayout
from common.model.config import load_model_config
from common.model.formats.quantization import quantization_config
from common.runner.dtypes import dtype_name, resolve_dtype
from common.runner.model_runner import ModelRunner, load_rank
from common.runner.weight_source import WeightSource
from common.model.weight_identity import weights_identity
from kernels import get_backend

log = logging.getLogger("pdmesh.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig, rank_transfer: Callable[[], object] | None = None,
                 weights: WeightSource | None = None, keep_weights: bool = False,
                 rank_weights: Callable[[object, int], WeightSource] | None = None):
        """rank_transfer: at tensor_parallel_size > 1, what makes each worker rank's own
        transfer engine (a picklable factory; common/parallel/rank_writes.py), for nodes
        that push or receive KV; None: the workers do no KV transfer. weights: where rank
        0's weights come from (default: the disk; services/node/weight_loader.py reads a
        peer's); keep_weights: keep them as one buffer to serve as a weight seed
        (self.loaded_weights.pool; identity: self.weights_identity); rank_weights(transfer,
        rank): where each worker rank's weights come from (picklable; default the disk), and
        the workers keep theirs alike (self.tp.loaded, self.tp.weight_ranks)."""
        from common.parallel.shard import plan_shard
        self.config = config
        tp_size = config.tensor_parallel_size
        self.borrowed_cores = None
        if tp_size == 1:
            threads = cpu_budget.apply(config.cpu_cores, config.num_threads)
            if config.borrow_cores and config.device.split(":")[0] == "cpu":   # on a device the host threads matter little
                self.borrowed_cores = BorrowedCores(config.cpu_cores or cpu_budget.allowed_cpus(), threads,
                                                    config.borrow_cores)
            self.device = torch.device(config.device)
        else:   # torch.distributed and the worker code only when there are ranks
            from common.parallel.executor import TPExecutor, rank_cpu_budget, rank_device
            cpu_budget.apply(*rank_cpu_budget(config.cpu_cores, config.num_threads, tp_size, 0))
            self.device = torch.device(rank_device(config.device, 0))
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)   # as the workers do: collectives use the current device
        self.model_config = mcfg = load_model_config(config.model)
        self.shard = plan_shard(mcfg, tp_size, 0, config.enable_expert_parallel)   # ValueError naming the field
        self.backend = get_backend(config.kernel_backend, self.device)
        supported = self.backend.supported_block_sizes()
        self.block_size = config.block_size or (supported[0] if supported else 16)
        if supported is not None and self.block_size not in supported:
            raise ValueError(f"block_size must be one of {supported} on the {self.backend.name} "
                             f"kernel backend, got {self.block_size}")
        self.dtype = resolve_dtype(config.dtype, self.device)
        kv_itemsize = 1 if quantization_config(config.model).kv_cache_int8 else self.dtype.itemsize
        per_block = (mcfg.num_layers * mcfg.kv_planes * self.block_size * self.shard.num_kv_heads
                     * mcfg.head_dim * kv_itemsize)       # per rank: each holds its KV heads (MLA: the latent)
        self.num_blocks = config.num_blocks or max(1, config.kv_cache_memory // per_block)
        limit = min(mcfg.max_position_embeddings, self.num_blocks * self.block_size)
        if mcfg.sliding_window:
            limit = min(limit, mcfg.sliding_window)
        if config.max_model_len > limit:
            raise ValueError(f"max_model_len must be <= {limit} (max_position_embeddings, "
                             f"KV cache of {self.num_blocks} blocks, sliding window), got {config.max_model_len}")
        self.max_model_len = config.max_model_len or limit
        self._weights, self._keep_weights = weights, keep_weights
        mix_path = resolved_w8a8_mix_path(config)
        # what a weight seed and its loader compare (a few small reads): only where weights move
        self.weights_identity = "" if weights is None and not keep_weights else weights_identity(
            config.model, dtype_name(self.dtype), type(quantization_config(config.model, mix_path)).__name__, mix_path,
            config.tensor_parallel_size, config.enable_expert_parallel)
        start = time.perf_counter()
        # rank 0 here, the workers spawned first so that they load their shards meanwhile
        self.tp = None if tp_size == 1 else TPExecutor(
            config, dtype=dtype_name(self.dtype),
            num_blocks=self.num_blocks, block_size=self.block_size, max_model_len=self.max_model_len,
            transfer_factory=rank_transfer, weights=rank_weights, weights_identity=self.weights_identity,
            keep_weights=keep_weights)
        try:
            self._build(config, mcfg, start)
        except BaseException:
            self.close()   # no worker outlives an engine that failed to start
            raise

    def _build(self, config: EngineConfig, mcfg, start: float) -> None:
        """The rest of __init__ (rank 0's model and KV cache, the scheduler, the tokenizer),
        after the workers were spawned."""
        mix_path = resolved_w8a8_mix_path(config)
        self.model, self.kv_cache = load_rank(mcfg, self.backend, self.dtype, self.device, config.model,
                                              self.shard, self.max_model_len, self.num_blocks, self.block_size,
                                              mix_path, config.lm_head_quantization == "int8",
                                              self._weights, self.weights_identity, self._keep_weights)
        self.loaded_weights = self.model.loaded_weights
        if self.tp is not None:
            self.model.attach_group(self.tp.wait_ready(), config.moe_dispatch)
        self.expert_load = ExpertLoad.of_model(self.model)   # None: a dense model
        self.model_id = config.model_id or Path(config.model).resolve().name
        self.kv_scales_id = self.model.kv_scales_id
        self.layout = layout_key(KVLayout.of_cache(self.kv_cache, self.kv_scales_id))
        self.block_manager = BlockManager(self.num_blocks, self.block_size, self.model_id,
                                          self.layout, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.enable_chunked_prefill)
        self.runner = StepRunner(ModelRunner(self.model, self.kv_cache, self.block_size), tp=self.tp)
        self.runner.on_prompt_logits = self._prompt_logits
        self.generator = torch.Generator().manual_seed(config.seed)
        from common.model.tokenizer import tokenizer_or_none   # tokenizers loads with an engine only
        self.tokenizer = tokenizer_or_none(config.model)
        self.eos_token_ids = set(mcfg.eos_token_ids) | set(self.tokenizer.eos_token_ids if self.tokenizer else ())
        self.vocab_size = mcfg.vocab_size
        self._arrivals = 0
        self._requests: dict[str, Sequence] = {}     # live: not finished, not aborted
        self._outputs: list[StepOutput] = []
        self.last_step_empty = False
        self.forward_window: Callable[[], ContextManager[None]] = contextlib.nullcontext
        log.info("engine ready: %s on %s/%s, %s, %d blocks x %d tokens, max_model_len %d (%.1fs)",
                 self.model_id, self.device, self.backend.name, self.dtype, self.num_blocks,
                 self.block_size, self.max_model_len, time.perf_counter() - start)
        if mcfg.moe_layers:
            log.info("Mixture of Experts: %d sparse layers, top %d, experts %d of %d a rank (%s)",
                     len(mcfg.moe_layers), mcfg.num_experts_per_tok, self.shard.num_local_experts, mcfg.num_experts,
                     "whole model" if config.tensor_parallel_size == 1 else "split by columns" if not config.enable_expert_parallel
                     else f"expert parallel, {config.moe_dispatch} dispatch")

    def close(self, graceful: bool = True) -> None:
        """Stop the tensor-parallel worker processes (idempotent; nothing to do at
        tensor_parallel_size 1). At TP > 1 a step after it raises RuntimeError. graceful
        sends the workers a stop message, a collective: only when no step runs on another
        thread (else they are killed)."""
        if getattr(self, "tp", None) is not None:
            self.tp.close(graceful)

    # ---- requests -----------------------------------------------------------------
    def validate_request(self, request_id: str, prompt_token_ids: list[int],
                         params: SamplingParams) -> None:
        """ValueError naming the field and its allowed range. Pure: touches no state
        except the set of live request ids."""
        validate_request(prompt_token_ids, params, self.vocab_size, self.max_model_len)
        if request_id in self._requests or request_id in self.scheduler.quarantined:
            raise ValueError(f"request_id {request_id!r} is already in use")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    *, kv_remote: bool = False, hold_blocks: bool = False,
                    on_computed: Callable[[Sequence, int, int], None] | None = None,
                    resume_position: int = 0,
                    prompt_sink: Callable[[int, torch.Tensor], None] | None = None) -> Sequence:
        """resume_position: the request resumes there (migrated): the prompt ends with
        that many output tokens already streamed, and sampling continues at that output
        position (0 <= resume_position < len(prompt_token_ids), ValueError otherwise).
        prompt_sink(p, rows): called on the step thread with the float32 log-softmax
        rows [k, vocab] (on the engine's device; valid during the call only) of prompt
        positions p .. p+k-1 (row j predicts token p+j+1) as
        they are computed, until the first token; after a preemption before it, the same
        positions come again (overwrite). With it or prompt_logprobs, kv_remote must be
        False (ValueError: the prompt is computed here)."""
        self.validate_request(request_id, prompt_token_ids, params)
        validate_resume_position(resume_position, len(prompt_token_ids))
        if kv_remote and (params.prompt_logprobs is not None or prompt_sink is not None):
            raise ValueError("prompt_logprobs needs the prompt computed on this node: kv_remote must be False")
        seq = Sequence(request_id, list(prompt_token_ids), params, self._arrivals,
                       kv_remote=kv_remote, hold_blocks=hold_blocks, on_computed=on_computed,
                       resume_position=resume_position, prompt_sink=prompt_sink)
        self._arrivals += 1
        self._requests[request_id] = seq
        if kv_remote and self.borrowed_cores is not None:
            self.borrowed_cores.want_back()
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str, writer_settled: bool = True) -> bool:
        """End the request as aborted and free its blocks now (held ones too), unless it is
        in KV_REMOTE and writer_settled is False: then they stay quarantined until
        release_quarantine(request_id). False if it is not live."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.abort(seq, writer_settled)
        if self.expert_load is not None and not self._any_running():
            self.expert_load.on_idle()
        return True

    def release(self, request_id: str) -> bool:
        """Free the blocks a finished hold_blocks request kept. False if none held."""
        if not self.scheduler.release(request_id):
            return False
        del self._requests[request_id]
        return True

    def release_quarantine(self, request_id: str) -> bool:
        """The remote writer of request_id's old blocks can write no more: free them."""
        return self.scheduler.release_quarantine(request_id)

    def _remote_seq(self, request_id: str) -> Sequence | None:
        seq = self._requests.get(request_id)
        return seq if seq is not None and seq.state == RequestState.KV_REMOTE else None

    def commit_remote(self, request_id: str, first_token: int,
                      logprobs: dict[int, float] | None = None) -> bool:
        """The prefill node wrote the prompt's KV into this sequence's blocks and sampled
        its first token (with its logprobs, which a request that asked for them must get):
        it is emitted, and the sequence joins the batch. False when the request is not
        waiting for a remote prefill (aborted meanwhile); ValueError when the token or
        its logprobs cannot be this request's."""
        seq = self._remote_seq(request_id)
        if seq is None:
            return False
        if not 0 <= first_token < self.vocab_size:
            raise ValueError(f"first_token {first_token} is outside the vocabulary")
        self._check_remote_logprobs(seq, first_token, logprobs)
        self.scheduler.kv_landed(seq, len(seq))
        self._append(seq, first_token, logprobs if seq.params.logprobs is not None else None)
        return True

    def _check_remote_logprobs(self, seq: Sequence, first_token: int,
                               logprobs: dict[int, float] | None) -> None:
        want = seq.params.logprobs
        if want is None:
            return
        if logprobs is None:
            raise ValueError("the request asked for logprobs and the prefill node sent none")
        ids = list(logprobs)
        if ids[0] != first_token or len(ids) > want + 1 or len(ids) < max(want, 1):
            raise ValueError(f"the first token's logprobs name tokens {ids[:want + 2]}; expected "
                             f"{first_token} first and {want} top tokens")
        if not all(0 <= t < self.vocab_size for t in ids) or not all(v <= 0.0 for v in logprobs.values()):
            raise ValueError("the first token's logprobs hold a token outside the vocabulary or a "
                             "logprob above 0")

    def commit_loaded(self, request_id: str, num_tokens: int) -> bool:
        """A KV_REMOTE sequence's blocks now hold the KV of its first num_tokens prompt
        tokens (read from the kv-store into them): it prefills the rest here. num_tokens
        counts whole blocks, at least what the sequence had computed, less than its length
        (ValueError otherwise). False when it is not waiting for its KV."""
        seq = self._remote_seq(request_id)
        if seq is None:
            return False
        if (num_tokens % self.block_size or not seq.num_computed_tokens <= num_tokens < len(seq)):
            raise ValueError(f"num_tokens {num_tokens} must be a multiple of {self.block_size} in "
                             f"[{seq.num_computed_tokens}, {len(seq)})")
        seq.num_cached_tokens = num_tokens
        self.scheduler.kv_landed(seq, num_tokens)
        return True

    def fail_remote(self, request_id: str, writer_settled: bool) -> bool:
        """The remote fill failed: compute the prompt here (see Scheduler.kv_failed).
        False when it is not waiting for its KV."""
        seq = self._remote_seq(request_id)
        if seq is None:
            return False
        self.scheduler.kv_failed(seq, writer_settled)
        return True

    def admit_remote(self) -> None:
        """Admit the kv_remote sequences at the head of the waiting queue now, without a
        step (on_remote_admit is told; Scheduler.admit_remote says when they must wait for
        a step instead). Allowed inside forward_window."""
        self.scheduler.admit_remote()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def take_outputs(self) -> list[StepOutput]:
        """Every StepOutput emitted since the last call, in the order produced."""
        outs, self._outputs = self._outputs, []
        return outs

    # ---- stepping -----------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Run one scheduled step; returns take_outputs() (this step's tokens, after any
        emitted by commands since the last call)."""
        sched = self.scheduler.schedule()
        # nothing could run (e.g. no free block) and nothing changed: only a command can help
        self.last_step_empty = sched.is_empty and not sched.preempted
        if sched.is_empty:
            return self.take_outputs()
        between_layers = None
        if self.borrowed_cores is not None:
            self.borrowed_cores.clear_wanted_back()
            self.borrowed_cores.fit(borrow=not self.scheduler.has_remote_kv())
            between_layers = self.borrowed_cores.between_layers if self.borrowed_cores.borrowing else None
        with self.forward_window():
            logits, sample_seqs = self.runner.execute(sched, between_layers)
        if self.device.type != "cpu" and any(s.on_computed is not None for s in sched.prefill_seqs):
            torch.accelerator.synchronize(self.device)   # a push reads the KV the step's kernels wrote
        for seq in sched.decode_seqs:
            self._computed(seq, 1)
        for seq, n in zip(sched.prefill_seqs, sched.prefill_lens):
            self._computed(seq, n)
        if logits is not None:
            tokens = sample(logits, sample_seqs, self.generator)
            want = [s.params.logprobs for s in sample_seqs]
            logprobs = compute_logprobs(logits, tokens, want)
            for seq, tok, lp in zip(sample_seqs, tokens, logprobs):
                self._append(seq, tok, lp)
        if self.expert_load is not None:
            self.expert_load.after_step(idle=not self._any_running())
        return self.take_outputs()

    def _any_running(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.ready)

    def _computed(self, seq: Sequence, n: int) -> None:
        start = seq.num_computed_tokens
        seq.num_computed_tokens += n
        self.block_manager.cache_full_blocks(seq)
        if seq.on_computed is not None:
            seq.on_computed(seq, start, start + n)

    def _prompt_logits(self, seq: Sequence, start: int, logits: torch.Tensor) -> None:
        """The runner's on_prompt_logits (step thread): float32 logits of prompt positions
        [start, start + k): log-softmax once, then prompt_logprobs[p + 1] = {actual token,
        top prompt_logprobs} (overwritten by a recompute) and the sink."""
        logp = logits.log_softmax(dim=-1)
        k = seq.params.prompt_logprobs
        if k is not None:
            n = logp.shape[0]
            targets = seq.token_ids[start + 1:start + 1 + n]
            actual = logp.gather(1, torch.tensor(targets, device=logp.device).unsqueeze(1)).squeeze(1).tolist()
            top_ids = top_values = None
            if k:
                top_values, top_ids = (t.tolist() for t in logp.topk(k, dim=-1))
            for j, (token, value) in enumerate(zip(targets, actual)):
                entry = {token: value}
                if k:
                    entry.update(zip(top_ids[j], top_values[j]))
                seq.prompt_logprobs[start + 1 + j] = entry
        if seq.prompt_sink is not None:
            seq.prompt_sink(start, logp)

    def _append(self, seq: Sequence, token: int, logprobs: dict[int, float] | None) -> None:
        """Add a sampled token to seq, finish it when it stops, emit its StepOutput (the
        first one of a prompt_logprobs request carries them: handed over, not kept)."""
        prompt_logprobs = None
        if seq.num_output_tokens == 0 and seq.prompt_logprobs is not None:
            prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None
        seq.token_ids.append(token)
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        p = seq.params
        reason = None
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            reason = "stop"
        elif seq.num_output_tokens >= p.max_tokens or len(seq) >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)
            if not seq.hold_blocks:
                del self._requests[seq.request_id]
        queue_s = (seq.first_scheduled_time or seq.arrival_time) - seq.arrival_time
        self._outputs.append(StepOutput(seq.request_id, [token], reason is not None, reason,
                                        seq.num_prompt_tokens, max(seq.num_cached_tokens, 0),
                                        [logprobs] if logprobs is not None else None, queue_s,
                                        prompt_logprobs))

    # ---- introspection ------------------------------------------------------------
    @property
    def num_used_blocks(self) -> int:
        return self.block_manager.num_used_blocks

    def expert_tokens(self) -> dict[int, list[int]]:
        """A Mixture-of-Experts model: MoE layer index -> tokens routed to each expert
        (indexed by expert id) since the engine started; {} for a dense model. Another
        thread may read it while a step runs (no lock): up to DRAIN_EVERY_STEPS steps old
        while requests run, exact when none does (common/engine/expert_load.py)."""
        return self.expert_load.totals() if self.expert_load is not None else {}

    def stats(self) -> dict[str, int]:
        """Counts only. Another thread may read them while a step runs (EngineView.snapshot:
        metrics, heartbeats): each count is one atomic read, so a set of them may be a step
        apart; used and free come from one read, so they always add up to the total."""
        bm = self.block_manager
        sched = self.scheduler
        free = bm.num_free_blocks
        return {"running": len(sched.running) + len(sched.ready), "waiting": len(sched.waiting),
                "kv_remote": len(sched.remote), "held": len(sched.held),
                "free_blocks": free, "used_blocks": bm.num_blocks - free,
                "total_blocks": bm.num_blocks, "prefix_hit_tokens": bm.num_hits,
                "prefix_query_tokens": bm.num_queries, "preemptions": sched.num_preemptions,
                "quarantined_blocks": sched.num_quarantined_blocks, "cached_blocks": bm.num_cached_blocks,
                "borrowed_core_steps": self.borrowed_cores.num_steps if self.borrowed_cores else 0}
