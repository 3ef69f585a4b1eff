"""The loraplex inference engine: paged KV cache on one page pool, continuous batching, Llama models."""

from .config import EngineConfig
from .engine import LLMEngine
from .request import RequestOutput
from .sampling_params import SamplingParams

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
