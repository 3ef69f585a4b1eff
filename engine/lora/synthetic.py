"""Adapters made from a seed: weights generated when the host cache asks, never stored anywhere.

For benchmarks and tests at scale (a thousand adapters need not sit on disk or in memory): the same
seed always gives the same weights, so a run can be repeated and an evicted adapter reloaded exactly.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from loraplex.adapters import AdapterManifest, BaseShape, LoraConfig, ModuleLora
from loraplex.adapters.shapes import MODULE_PATHS

from .sources import LoraWeights


@dataclass(frozen=True)
class SyntheticAdapter:
    """A LoRA of `rank` on `targets` (short module names) of every layer, with weights drawn from `seed`.

    A and B are scaled so the adapter changes the model's outputs visibly but keeps them sane: the
    delta of a unit input is about `strength` in each output element."""

    base: BaseShape
    seed: int
    rank: int
    targets: tuple[str, ...] = ("q", "k", "v", "o")
    alpha: float | None = None  # None: equal to rank (scale 1)
    strength: float = 0.05

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"rank must be at least 1, got {self.rank}")
        unknown = [t for t in self.targets if t not in MODULE_PATHS]
        if unknown or not self.targets:
            raise ValueError(f"targets must be among {', '.join(MODULE_PATHS)}, got {self.targets}")

    @property
    def manifest(self) -> AdapterManifest:
        alpha = float(self.alpha if self.alpha is not None else self.rank)
        config = LoraConfig(
            r=self.rank, lora_alpha=alpha, target_modules=tuple(MODULE_PATHS[t] for t in self.targets)
        )
        modules = tuple(
            ModuleLora(layer, module, self.rank, alpha / self.rank, *self.base.features(module))
            for layer in range(self.base.num_layers)
            for module in self.targets
        )
        identity = f"synthetic:{self.seed}:{self.rank}:{','.join(self.targets)}:{alpha}:{self.strength}"
        parameters = sum(m.rank * (m.in_features + m.out_features) for m in modules)
        return AdapterManifest(
            sha256=hashlib.sha256(identity.encode()).hexdigest(),
            config=config,
            modules=modules,
            weights_bytes=4 * parameters,
            dtype="F32",
        )

    def load(self, dtype: torch.dtype) -> LoraWeights:
        generator = torch.Generator().manual_seed(self.seed)
        weights: LoraWeights = {}
        for lora in self.manifest.modules:
            a = torch.randn(lora.rank, lora.in_features, generator=generator) / lora.in_features**0.5
            b = torch.randn(lora.out_features, lora.rank, generator=generator)
            b *= self.strength / lora.rank**0.5
            weights[(lora.layer, lora.module)] = (a.to(dtype), b.to(dtype))
        return weights
