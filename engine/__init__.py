"""The model runtime both workers drive: paged KV, continuous batching, prefix caching."""

from halfmoon.engine.config import EngineConfig
from halfmoon.engine.errors import HalfmoonError, InvalidRequestError, ModelLoadError
from halfmoon.engine.llm import LLM, CompletionOutput
from halfmoon.engine.llm_engine import EngineStats, LLMEngine, RequestOutput
from halfmoon.engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineStats",
    "HalfmoonError",
    "InvalidRequestError",
    "LLMEngine",
    "ModelLoadError",
    "RequestOutput",
    "SamplingParams",
]
