"""A request's adapter lookup waits for no engine step: AsyncEngine.adapter reads the engine's published
view of the registrations, so it answers while a step is still running, and a registration or unregister
the caller awaited is in that view the moment it returns. Proved on a tiny model whose step is held on
an event this test controls."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from loraplex.engine import EngineConfig, LLMEngine, SamplingParams
from loraplex.engine.request import RequestOutput
from loraplex.engine.server.async_engine import AsyncEngine

from ...adapters.conftest import TINY, make_peft_adapter

HOLD_LIMIT_S = 60.0  # a deadline for a held step, never a wait that makes the test pass


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(root / "base")  # type: ignore[arg-type]
    make_peft_adapter(root / "a", seed=1, r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    make_peft_adapter(root / "b", seed=2, r=4, lora_alpha=8, target_modules="all-linear")
    return root / "base", {"a": root / "a", "b": root / "b"}


class HeldSteps:
    """Makes every engine step wait until released (all from then on, or exactly one); says when one has
    started waiting."""

    def __init__(self, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch):
        self.started = threading.Event()
        self.released = threading.Event()
        self._one = threading.Semaphore(0)
        step = engine.step

        def held_step() -> list[RequestOutput]:
            self.started.set()
            deadline = time.monotonic() + HOLD_LIMIT_S
            while not self.released.is_set() and not self._one.acquire(timeout=0.01):
                if time.monotonic() > deadline:
                    raise AssertionError("the test never released the step")
            self.started.clear()
            return step()

        monkeypatch.setattr(engine, "step", held_step)

    def release_one(self) -> None:
        """Let the step that waits now (or the next) run; the one after it waits again."""
        self._one.release()


def test_adapter_lookups_answer_while_a_step_runs(
    tiny: tuple[Path, dict[str, Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    base, dirs = tiny
    engine = LLMEngine(EngineConfig(model=str(base), device="cpu", num_pages=32, page_size=16))
    held = HeldSteps(engine, monkeypatch)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)

    async def scenario() -> None:
        served = AsyncEngine(engine)
        served.start()
        try:
            held.released.set()  # registration runs between steps: let them go for now
            manifest = await served.register_adapter("a", dirs["a"].as_uri())
            held.released.clear()

            stream = await served.add_request([5, 6, 7], params, adapter="a")
            assert await asyncio.to_thread(held.started.wait, HOLD_LIMIT_S), "no step started"
            # The loop thread is inside a step now, and stays there until released.
            listing = asyncio.ensure_future(served.adapters())  # asks the loop: waits for the step

            known = served.adapter("a")
            assert known is not None and known.sha256 == manifest.sha256 and known.failed is None
            assert known.pages == engine.registry.pages_of("a")
            assert served.adapter("b") is None and served.adapter_names() == ["a"]
            await asyncio.sleep(0)  # one turn of the event loop: the listing posts its command, then waits
            assert not listing.done() and not held.released.is_set()

            held.released.set()
            assert [info.name for info in await listing] == ["a"]
            while not (await stream.next()).finished:
                pass

            # What the caller awaited is visible the moment it returns, with no step in between.
            await served.register_adapter("b", dirs["b"].as_uri())
            assert served.adapter("b") is not None and served.adapter_names() == ["a", "b"]
            assert await served.unregister_adapter("a") is True
            assert served.adapter("a") is None and served.adapter_names() == ["b"]

            # An adapter that drains (unregistered while a request uses it) is unknown to new lookups.
            held.released.clear()
            held.started.clear()
            stream = await served.add_request([5, 6, 7], params, adapter="b")
            assert await asyncio.to_thread(held.started.wait, HOLD_LIMIT_S), "no step started"
            # Posted while the first step is held, so it runs before the next: the request still uses it.
            unregistering = asyncio.ensure_future(served.unregister_adapter("b"))
            await asyncio.sleep(0)  # one turn of the event loop: the task posts its command
            assert not unregistering.done() and served.adapter("b") is not None
            held.release_one()  # the held step runs, then the command, and the next step waits: the
            assert await unregistering is False  # request is still running when we look (3 tokens)
            assert served.adapter("b") is None and served.adapter_names() == []
            assert engine.adapter_view["b"].draining
            held.released.set()
            while not (await stream.next()).finished:
                pass
        finally:
            held.released.set()
            await served.stop()

    asyncio.run(scenario())
    assert dict(engine.adapter_view) == {}  # the drained adapter was forgotten when its request ended
