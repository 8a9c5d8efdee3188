"""Which part of the model one tensor-parallel rank holds (Megatron-style sharding).

For a model of H query heads, K KV heads, intermediate size I and vocabulary V at
tensor_parallel_size N, rank r holds:

    query heads   [r*H/N, (r+1)*H/N)              (H % N == 0)
    KV heads      split:      [r*K/N, (r+1)*K/N)  when K % N == 0
                  replicated: head r // (N/K)     when N > K and N % K == 0 (vLLM's rule:
                              the N/K ranks of a group hold one copy of the same head)
    MLP columns   [r*I/N, (r+1)*I/N)              (I % N == 0)
    vocab rows    [r*Vp, min((r+1)*Vp, V))        Vp = ceil(V/N); the last rank's missing
                                                  rows are zero padding

A rank's query heads all map to KV heads it holds: head h attends with KV head
h // (H/K), and both ranges above start at the same fraction r/N of their heads.
Norms (and Qwen3's per-head-dim q/k norms) and the row-parallel biases (o, down) are
whole on every rank; the biases are added once, after the all-reduce.

A Mixture-of-Experts model's E experts of intermediate size Ie are either placed whole
(`enable_expert_parallel`, vLLM's name; expert-parallel size = tensor_parallel_size) or,
without it, split by columns like the dense MLP:

    expert parallel   experts [r*E/N, (r+1)*E/N), whole          (E % N == 0)
    tensor parallel   every expert, columns [r*Ie/N, (r+1)*Ie/N)  (Ie % N == 0)

The router is whole on every rank either way; the ranks' shares are summed by the layer's
all-reduce (or travel by all_to_all: common/model/layers/moe_dispatch.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from common.model.config import ModelConfig

FIELD = "tensor_parallel_size"


@dataclass(frozen=True)
class TPShard:
    """Rank `rank` of `size`: local head counts and the first global index of each range."""

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    kv_head_start: int
    intermediate_size: int
    vocab_start: int
    vocab_end: int               # exclusive; vocab_end - vocab_start <= vocab_per_rank
    vocab_per_rank: int          # rows of the rank's embedding / lm_head (padded)
    num_local_experts: int = 0   # a MoE model's experts on this rank: [expert_start, + num_local_experts)
    expert_start: int = 0
    expert_intermediate_size: int = 0   # each local expert's columns: [expert_inter_start, + this)
    expert_inter_start: int = 0

    @property
    def head_start(self) -> int:
        return self.rank * self.num_heads


def allowed_sizes(cfg: ModelConfig, limit: int = 64, expert_parallel: bool = False) -> list[int]:
    """The tensor_parallel_size values this model can run at, up to limit."""
    return [n for n in range(1, limit + 1) if _problem(cfg, n, expert_parallel) is None]


def _problem(cfg: ModelConfig, size: int, expert_parallel: bool = False) -> str | None:
    if cfg.moe_layers and expert_parallel and cfg.num_experts % size:
        return (f"num_experts={cfg.num_experts} must be a multiple of it (enable_expert_parallel: experts "
                f"placed whole on each rank)")
    if cfg.moe_layers and not expert_parallel and cfg.moe_intermediate_size % size:
        return (f"moe_intermediate_size={cfg.moe_intermediate_size} must be a multiple of it (experts split "
                f"by columns; or enable_expert_parallel: true)")
    if cfg.num_heads % size:
        return f"num_attention_heads={cfg.num_heads} must be a multiple of it"
    k = cfg.num_kv_heads
    if k % size and not (size > k and size % k == 0):
        return (f"num_key_value_heads={k} must be a multiple of it (KV heads split) or divide "
                f"it (KV heads replicated)")
    if cfg.intermediate_size % size:
        return f"intermediate_size={cfg.intermediate_size} must be a multiple of it"
    return None


def check_tensor_parallel(cfg: ModelConfig, size: int, expert_parallel: bool = False) -> None:
    """ValueError naming the field, the reason and the allowed values unless this model
    can be sharded `size` ways (a MoE model's experts placed whole with expert_parallel,
    else split by columns)."""
    problem = _problem(cfg, size, expert_parallel)
    if problem is not None:
        raise ValueError(f"{FIELD}={size} does not fit {cfg.architecture}: {problem}; "
                         f"allowed: {allowed_sizes(cfg, expert_parallel=expert_parallel)}")


def plan_shard(cfg: ModelConfig, size: int, rank: int, expert_parallel: bool = False) -> TPShard:
    """Rank `rank`'s part (check_tensor_parallel first; ValueError when it does not fit).
    expert_parallel: the engine's enable_expert_parallel (a MoE model's experts placed whole
    on the ranks rather than split by columns)."""
    check_tensor_parallel(cfg, size, expert_parallel)
    if not 0 <= rank < size:
        raise ValueError(f"rank must be in [0, {size}), got {rank}")
    k = cfg.num_kv_heads
    if k % size == 0:
        num_kv, kv_start = k // size, rank * (k // size)
    else:
        num_kv, kv_start = 1, rank // (size // k)
    per_rank = -(-cfg.vocab_size // size)
    start = min(rank * per_rank, cfg.vocab_size)
    return TPShard(rank=rank, size=size, num_heads=cfg.num_heads // size, num_kv_heads=num_kv,
                   kv_head_start=kv_start, intermediate_size=cfg.intermediate_size // size,
                   vocab_start=start, vocab_end=min(start + per_rank, cfg.vocab_size),
                   vocab_per_rank=per_rank, **_experts(cfg, size, rank, expert_parallel))


def _experts(cfg: ModelConfig, size: int, rank: int, expert_parallel: bool) -> dict[str, int]:
    if expert_parallel or size == 1:
        per_rank = cfg.num_experts // size
        return dict(num_local_experts=per_rank, expert_start=rank * per_rank,
                    expert_intermediate_size=cfg.moe_intermediate_size)
    columns = cfg.moe_intermediate_size // size
    return dict(num_local_experts=cfg.num_experts, expert_start=0, expert_intermediate_size=columns,
                expert_inter_start=rank * columns)


def whole_model(cfg: ModelConfig) -> TPShard:
    """The one shard of tensor_parallel_size 1: everything."""
    return plan_shard(cfg, 1, 0)
