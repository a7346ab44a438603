"""pagoda: a vLLM-class LLM inference engine built as ZeroMQ + msgpack microservices.

This package only re-exports the public API. The exports load on first use, so the `pagoda`
command (e.g. a health probe) starts without importing torch.
"""
import importlib

_EXPORTS = {
    "LLM": "services.engine.llm",
    "LLMEngine": "services.engine.llm_engine",
    "EngineArgs": "shared.engine_args",
    "SamplingParams": "shared.sampling_params",
    "RequestOutput": "shared.outputs",
    "CompletionOutput": "shared.outputs",
    "AsyncEngineClient": "services.gateway.client",
    "EngineRequestError": "services.gateway.client",
}

__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pagoda' has no attribute {name!r}")
