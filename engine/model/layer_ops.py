"""The norm, residual and activation steps of a decoder layer: plain torch, or fused Triton kernels.

The model (llama.py) stays one forward; which implementation of these elementwise steps it runs comes
with the attention callable it is handed, since both are one choice of the runner: the reference
attention brings nothing (the plain-torch ops below, the CPU path), the Triton attention brings
`kernel_ops()` and also rotates q and k inside its KV write (`rotary_in_attention`), so a kernel-path
decode layer launches one kernel per norm, activation and rotary instead of 2-8 each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch

from ..kernels import reference


@dataclass(frozen=True)
class LayerOps:
    # (x [T, hidden], weight, eps) -> normed [T, hidden]
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    # (hidden, delta, weight, eps) -> (hidden + delta, its norm)
    add_rms_norm: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
    ]
    # gate_up [T, 2 I] -> silu(gate) * up [T, I]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]
    # True: the model passes q and k unrotated with rope=(cos, sin) and attention rotates them.
    rotary_in_attention: bool


REFERENCE_OPS = LayerOps(reference.rms_norm, reference.add_rms_norm, reference.silu_mul, False)


@cache
def kernel_ops() -> LayerOps:
    """The Triton kernels (imported on first use: the CPU path never needs Triton)."""
    from ..kernels import activation, rms_norm

    return LayerOps(rms_norm.rms_norm, rms_norm.add_rms_norm, activation.silu_mul, True)


def ops_of(attention: object) -> LayerOps:
    """The layer ops that go with an attention callable: its `layer_ops`, else plain torch."""
    ops = getattr(attention, "layer_ops", None)
    return ops if isinstance(ops, LayerOps) else REFERENCE_OPS
