"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def device() -> torch.device:
    """The GPU when there is one; else the CPU, where the kernels run under TRITON_INTERPRET=1."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
