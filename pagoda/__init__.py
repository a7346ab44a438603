"""pagoda: a vLLM-class LLM inference engine built as ZeroMQ + msgpack microservices.

This package only re-exports the public API.
"""
from shared.config import EngineArgs
from shared.sampling_params import SamplingParams
from services.engine.llm import LLM
from services.engine.llm_engine import LLMEngine
from services.engine.outputs import CompletionOutput, RequestOutput
from services.gateway.client import AsyncEngineClient, EngineRequestError

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput",
           "AsyncEngineClient", "EngineRequestError"]
__version__ = "0.1.0"
