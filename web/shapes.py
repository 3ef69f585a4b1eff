"""Base-model shapes the control plane knows by name, so a deployment can name its model alone.

Copied from the engine's named shapes (tests check they agree): the web package never imports the engine.
"""

from __future__ import annotations

from loraplex.adapters import BaseShape

_SMOLLM2_135M = BaseShape(num_layers=30, hidden_size=576, intermediate_size=1536, q_size=576, kv_size=192)
_SMOLLM2_360M = BaseShape(num_layers=32, hidden_size=960, intermediate_size=2560, q_size=960, kv_size=320)

KNOWN_SHAPES: dict[str, BaseShape] = {
    "smollm2-135m": _SMOLLM2_135M,
    "HuggingFaceTB/SmolLM2-135M": _SMOLLM2_135M,
    "HuggingFaceTB/SmolLM2-135M-Instruct": _SMOLLM2_135M,
    "smollm2-360m": _SMOLLM2_360M,
    "HuggingFaceTB/SmolLM2-360M": _SMOLLM2_360M,
    "HuggingFaceTB/SmolLM2-360M-Instruct": _SMOLLM2_360M,
}


def known_shape(base_model: str) -> BaseShape | None:
    return KNOWN_SHAPES.get(base_model)
