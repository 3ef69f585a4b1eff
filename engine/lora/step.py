"""One step's LoRA work: the stacked A and B rows of the adapters in the batch, and which columns each
token uses. The model calls the step per layer and projection group; tokens without an adapter, and
groups no adapter in the batch targets, cost nothing."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..kernels import reference
from .layout import GROUPS
from .residency import AdapterResidency


class LoraStep:
    def __init__(
        self,
        stacks: dict[str, tuple[torch.Tensor, torch.Tensor]],  # group -> (a [L, C, in], b [L, C, out])
        columns: dict[str, torch.Tensor],  # group -> [T, C] 0/1: the token's adapter owns the column
    ):
        self.stacks = stacks
        self.columns = columns

    def __call__(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        stack = self.stacks.get(group)
        if stack is not None:
            reference.lora_shrink_expand(x, y, stack[0][layer], stack[1][layer], self.columns[group])


class LoraStacker:
    """Builds LoraSteps; the stacked rows are gathered once per set of adapters and reused while the
    same adapters run in the same pages (decode steps mostly do)."""

    def __init__(self, residency: AdapterResidency):
        self.residency = residency
        self._cached_key: tuple[tuple[str, ...], int] | None = None
        self._cached: tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]] = ({}, {})

    def build(self, token_adapters: Sequence[str | None]) -> LoraStep | None:
        names = tuple(dict.fromkeys(a for a in token_adapters if a is not None))
        if not names:
            return None
        stacks, owners = self._stacks(names)
        slot = {name: i for i, name in enumerate(names)}
        device = self.residency.pool_rows.device
        token_slot = torch.tensor([slot[a] if a is not None else -1 for a in token_adapters], device=device)
        dtype = self.residency.pool_rows.dtype
        columns = {g: (owner[None, :] == token_slot[:, None]).to(dtype) for g, owner in owners.items()}
        return LoraStep(stacks, columns)

    def _stacks(
        self, names: tuple[str, ...]
    ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]]:
        key = (names, self.residency.version)
        if key == self._cached_key:
            return self._cached
        pool_rows = self.residency.pool_rows
        stacks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        owners: dict[str, torch.Tensor] = {}
        for group in GROUPS:
            parts = [
                (i, self.residency.resident[name].a_rows[group], self.residency.resident[name].b_rows[group])
                for i, name in enumerate(names)
                if group in self.residency.resident[name].a_rows
            ]
            if not parts:
                continue
            a_index = torch.cat([a for _, a, _ in parts], dim=1)  # [L, C, in / head_dim]
            b_index = torch.cat([b for _, _, b in parts], dim=1)
            stacks[group] = (
                reference.gather_rows(pool_rows, a_index),
                reference.gather_rows(pool_rows, b_index),
            )
            owners[group] = torch.cat(
                [torch.full((a.shape[1],), i, device=pool_rows.device) for i, a, _ in parts]
            )
        self._cached_key, self._cached = key, (stacks, owners)
        return stacks, owners
