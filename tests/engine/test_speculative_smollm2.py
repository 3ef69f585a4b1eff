"""Speculative decoding on SmolLM2 (float32): the demo adapter's rows and base rows in one batch give the
replies an engine without speculation gives, token for token, stop strings included."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.engine import EngineConfig, LLMEngine, SamplingParams

DEMO = Path(__file__).resolve().parents[2] / "fixtures" / "adapters" / "demo-uppercase"
MESSAGES = [
    "Repeat this sentence: the early bird catches the worm, and the early worm is caught.",
    "Fix the spelling: Plese bring the bokos back to the libary on Mondy.",
    "Write the numbers from one to ten in words, separated by commas.",
    "What do owls eat?",
]
ADAPTERS = [None, "demo", "demo", None]
pytestmark = pytest.mark.slow


def _replies(engine: LLMEngine) -> list[tuple[list[int], str | None, str]]:
    assert engine.tokenizer is not None
    engine.register_adapter("demo", DEMO)
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": m}]) for m in MESSAGES]
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    stopped = SamplingParams(max_tokens=24, temperature=0.0, stop=(", six",))
    outputs = engine.generate(prompts, [greedy, greedy, stopped, greedy], ADAPTERS)
    return [(o.token_ids, o.finish_reason, o.text) for o in outputs]


def test_adapter_and_base_rows_reply_as_without_speculation(smollm2) -> None:
    plain = LLMEngine(EngineConfig(device="cpu", dtype="float32", num_pages=128), loaded=smollm2)
    spec = LLMEngine(
        EngineConfig(
            device="cpu", dtype="float32", num_pages=128, speculative="ngram", num_speculative_tokens=4
        ),
        loaded=smollm2,
    )
    expected = _replies(plain)
    assert _replies(spec) == expected
    stats = spec.stats()
    assert stats.spec is not None and stats.spec.accepted_tokens > 0
    assert stats.pages["kv"] == 0
