"""Inference engine: `LLM` (offline), `AsyncEngine` (services), `SamplingParams`.

Names are imported lazily so that light modules (block manager, scheduler) load without
the model and kernels.
"""
from importlib import import_module

_EXPORTS = {
    "LLM": "common.engine.llm",
    "AsyncEngine": "common.engine.async_engine",
    "LLMEngine": "common.engine.llm_engine",
    "StepOutput": "common.engine.llm_engine",
    "SamplingParams": "common.engine.sampling_params",
    "RequestOutput": "common.engine.outputs",
    "CompletionOutput": "common.engine.outputs",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'common.engine' has no attribute {name!r}")
