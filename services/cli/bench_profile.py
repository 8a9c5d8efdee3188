"""`pdmesh bench profile --config MESH [--node-id ID] --out FILE`: measure one node's
hardware on the mesh's model and write the profile the planner loads
(meta_server.planner.profile; docs/planner.md).

The engine is the node's (--node-id: the mesh's engine section with that node's own
fields; default: the mesh's engine section), run in this process on this machine, so run
it where the nodes will run (same device, cores, TP size). It measures prefill TTFT and
throughput at each --prompt-lens, and decode ITL at each --contexts x --batches point
(services/bench/profile.py says how); points the engine cannot run are skipped and named.
A model folder the config makes (tiny_arch, pull) is made first, as `pdmesh up` does.

    pdmesh bench profile --config deploy/local.yaml --node-id decode-0 --out profile.json

Exit code 0 when the profile was written, 2 on a bad config or arguments, or when no
prefill or no decode point fits the engine.
"""
from __future__ import annotations

import argparse
import sys


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"integers >= 1, got {text!r}")
    return values


def add_profile_parser(actions) -> argparse.ArgumentParser:
    p = actions.add_parser("profile", help="measure one node's rates: the planner's profile", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="mesh YAML (e.g. deploy/local.yaml)")
    p.add_argument("--node-id", default="", help="whose engine fields (default: the mesh's engine section)")
    p.add_argument("--out", default="node-profile.json", help="the profile JSON (default: %(default)s)")
    p.add_argument("--prompt-lens", type=_ints, default=(128, 512, 2048), metavar="L1,L2,...",
                   help="prefill points, prompt tokens (default: 128,512,2048)")
    p.add_argument("--contexts", type=_ints, default=(256, 2048), metavar="C1,C2,...",
                   help="decode points, context tokens (default: 256,2048)")
    p.add_argument("--batches", type=_ints, default=(1, 8, 32), metavar="B1,B2,...",
                   help="decode points, sequences decoding at once (default: 1,8,32)")
    p.add_argument("--decode-steps", type=int, default=16, help="steps timed a decode point (default: 16)")
    p.add_argument("--seed", type=int, default=0, help="of the random prompts")
    return p


def run_profile(args: argparse.Namespace) -> int:
    import datetime

    from common.config import load_mesh_config
    from common.engine.llm_engine import LLMEngine
    from services.bench.profile import ProfilePlan, measure_profile
    from services.cli.up import ensure_model
    from services.meta_server.profile_file import write_profile
    try:
        mesh = load_mesh_config(args.config)
        engine_cfg = mesh.engine_config(mesh.node(args.node_id) if args.node_id else None)
        plan = ProfilePlan(prompt_lens=args.prompt_lens, contexts=args.contexts, batches=args.batches,
                           decode_steps=args.decode_steps, seed=args.seed)
        ensure_model(mesh)
        engine = LLMEngine(engine_cfg)
        try:
            result = measure_profile(engine, plan, say=lambda line: print(line, flush=True))
        finally:
            engine.close()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for why in result.skipped:
        print(f"skipped: {why}")
    about = {"model_id": engine.model_id, "node_id": args.node_id, "device": str(engine.device),
             "kernel_backend": engine.backend.name, "dtype": str(engine.dtype).removeprefix("torch."),
             "tensor_parallel_size": engine_cfg.tensor_parallel_size,
             "max_num_batched_tokens": engine_cfg.max_num_batched_tokens, "max_num_seqs": engine_cfg.max_num_seqs,
             "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "seconds": round(result.seconds, 3), "skipped": result.skipped}
    write_profile(args.out, result.profile, about)
    print(f"wrote {args.out}: {len(result.profile.prefill)} prefill and {len(result.profile.decode)} decode "
          f"points in {result.seconds:.1f}s")
    return 0
