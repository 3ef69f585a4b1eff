"""A SmolLM2-shaped model on the kernel path (fused norms, rotary in the KV write, SiLU·mul, Triton
attention) gives the logits and the KV cache of the plain-torch path, for a prefill step then a step of
decodes beside a new prefill chunk.

Random weights (norm weights too, so a dropped weight multiply shows), two layers, a small vocabulary:
what is being checked is the layer's wiring, which every layer repeats. The kernels run under
TRITON_INTERPRET=1 on a CPU (tests/conftest.py) and natively on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from loraplex.engine.attention import ReferenceAttention, TritonAttention
from loraplex.engine.batch import BatchBuilder
from loraplex.engine.model.config import NAMED_SHAPES
from loraplex.engine.model.layer_ops import REFERENCE_OPS, kernel_ops, ops_of
from loraplex.engine.model.loader import random_model

PAGE_SIZE = 16
TOLERANCES = {torch.float32: 2e-4, torch.bfloat16: 6e-2}  # on logits of size ~1


@dataclass
class Request:
    prompt: list[int]
    pages: list[int]
    adapter: str | None = None

    def tokens(self, start: int, end: int) -> list[int]:
        return self.prompt[start:end]


@dataclass
class Chunk:
    request: Request
    start: int
    num_tokens: int
    samples: bool = True

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


def run_steps(model, steps: list[list[Chunk]], kernels: bool, device: torch.device):
    """Logits of each step and the pool after the last, on one path."""
    c = model.config
    memory = torch.zeros(
        12, c.num_layers, 2, c.num_kv_heads, PAGE_SIZE, c.head_dim, dtype=model.dtype, device=device
    )
    builder = BatchBuilder(PAGE_SIZE, device)
    attention_type = TritonAttention if kernels else ReferenceAttention
    logits = []
    with torch.inference_mode():
        for chunks in steps:
            batch = builder.build(chunks)
            attention = attention_type(memory, batch, c.head_dim**-0.5)
            logits.append(model(batch.input_ids, batch.positions, attention, batch.logits_indices))
    return logits, memory


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_path_matches_the_reference_path(dtype: torch.dtype) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = replace(NAMED_SHAPES["smollm2-135m"], num_layers=2, vocab_size=512)
    model = random_model(config, dtype, device, seed=0, max_positions=256)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=generator))
    prompts = [torch.randint(1, 512, (n,), generator=generator).tolist() for n in (21, 5, 40)]
    a, b, c = (Request([*p, 7], pages) for p, pages in zip(prompts, ([1, 2], [3], [4, 5, 6]), strict=True))
    steps = [
        [Chunk(a, 0, 21), Chunk(b, 0, 5)],  # two fresh prefills
        [Chunk(a, 21, 1), Chunk(b, 5, 1), Chunk(c, 0, 40)],  # decodes beside a new, page-crossing chunk
    ]
    expected, expected_memory = run_steps(model, steps, kernels=False, device=device)
    actual, actual_memory = run_steps(model, steps, kernels=True, device=device)
    tol = TOLERANCES[dtype]
    for step_logits, step_expected in zip(actual, expected, strict=True):
        assert step_logits.shape == step_expected.shape
        torch.testing.assert_close(step_logits, step_expected, atol=tol, rtol=tol)
    torch.testing.assert_close(actual_memory.float(), expected_memory.float(), atol=tol, rtol=tol)
    assert expected_memory[6].abs().sum() > 0  # the last chunk reached its third page


def test_the_attention_callable_picks_the_layer_ops() -> None:
    assert ops_of(lambda layer, q, k, v: q) is REFERENCE_OPS
    ops = kernel_ops()
    assert ops.rotary_in_attention and ops is not REFERENCE_OPS
