"""The loraplex inference engine: paged KV cache on one page pool, continuous batching, Llama models.

The public names load lazily, so the torch-free bookkeeping (pool, scheduler) imports without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import EngineConfig
    from .engine import LLMEngine
    from .request import RequestOutput
    from .sampling_params import SamplingParams

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]

_HOMES = {
    "EngineConfig": ".config",
    "LLMEngine": ".engine",
    "RequestOutput": ".request",
    "SamplingParams": ".sampling_params",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(_HOMES[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
