"""The trained demo adapter, served by the engine: replies in capitals, while the base model's are not."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.engine import EngineConfig, LLMEngine, SamplingParams

DEMO = Path(__file__).resolve().parents[2] / "fixtures" / "adapters" / "demo-uppercase"
PROMPTS = [
    "What do owls eat?",
    "Describe a quiet morning in a village.",
    "How does a bicycle stay upright?",
    "Name two uses for salt.",
    "Why do leaves change colour in autumn?",
    "Give me advice for a first job interview.",
]


def uppercase_ratio(texts: list[str]) -> float:
    letters = [c for t in texts for c in t if c.isalpha() and c.lower() != c.upper()]
    return sum(c.isupper() for c in letters) / max(len(letters), 1)


def assert_replies_in_uppercase_only_with_the_demo(engine: LLMEngine) -> None:
    """Register the demo adapter; greedy replies with it are >= 90% capitals, the base model's < 50%
    (adapter and base requests in the same batch)."""
    assert engine.tokenizer is not None
    engine.register_adapter("demo-uppercase", DEMO)
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(max_tokens=32, temperature=0.0)
    outputs = engine.generate(
        prompts * 2, params, adapters=["demo-uppercase"] * len(prompts) + [None] * len(prompts)
    )
    adapted = [o.text for o in outputs[: len(prompts)]]
    base = [o.text for o in outputs[len(prompts) :]]
    assert uppercase_ratio(adapted) >= 0.9, adapted
    assert uppercase_ratio(base) < 0.5, base


@pytest.mark.slow
def test_engine_replies_in_uppercase_with_the_demo_adapter(smollm2) -> None:
    engine = LLMEngine(EngineConfig(device="cpu", dtype="float32"), loaded=smollm2)
    assert_replies_in_uppercase_only_with_the_demo(engine)
