"""Tenants' shares of a bounded resource: the engine's waiting queue, the gateway's upstream connections.

One rule for both, so a tenant meets the same fairness at either end. With `capacity` places, `tenants`
tenants holding some (the asker counted, even while it holds none) and the asker holding `held`:

1. the whole is full (`total >= capacity`): refused, nobody's fault (`queue_full`);
2. `held < floor`: admitted: every tenant may always hold `floor` places while any is free;
3. `held >= share(tenants)`, where `share(T) = max(floor, (capacity - reserve) // T)`: refused, the asker
   holds its share already (`tenant_share_exceeded`);
4. `total >= capacity - reserve`: refused (`tenant_share_exceeded`): the last `reserve` places are kept
   for tenants still below their floor;
5. otherwise admitted.

What it guarantees (with `floor <= capacity - reserve`, which `Shares` requires): a request beyond its
tenant's floor never takes one of the last `reserve` places, so no tenant is ever admitted past
`capacity - reserve` places, and while one tenant floods, every other tenant is admitted up to its floor
as long as the others together hold fewer than `reserve`. The whole fills only with many tenants'
floors at once. A tenant that holds more than a newcomer's arrival leaves it keeps what it holds
(nothing is taken back) but gets no more until it is below its new share, so the holdings converge on
equal shares as places are given back.

Plain integers and dataclasses: no torch, no web framework (the gateway imports it).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import QUEUE_FULL, TENANT_SHARE_EXCEEDED


@dataclass(frozen=True)
class Refusal:
    """Why a tenant may not take a place now: `code` is the wire code, `message` says it in a sentence."""

    code: str
    message: str


@dataclass(frozen=True)
class Shares:
    """The rule above for one resource; `what` names it in refusals ("waiting requests on this engine")."""

    capacity: int
    floor: int
    reserve: int
    what: str = "places"

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"capacity must be 1 or more, got {self.capacity}")
        if self.floor < 0:
            raise ValueError(f"floor must be 0 or more, got {self.floor}")
        if not 0 <= self.reserve < self.capacity:
            raise ValueError(
                f"reserve must be 0 or more and below the capacity {self.capacity}, got {self.reserve}"
            )
        # A floor inside the reserve would let one tenant's floor alone fill the whole.
        if self.floor > self.capacity - self.reserve:
            raise ValueError(
                f"floor must be at most capacity - reserve = {self.capacity - self.reserve}, got {self.floor}"
            )

    @classmethod
    def of(cls, capacity: int, floor: int, reserve_fraction: float, what: str = "places") -> Shares:
        """Shares with `reserve_fraction` of the capacity reserved (rounded down, so a capacity of 1 keeps
        none) and the floor no higher than what the reserve leaves."""
        if not (math.isfinite(reserve_fraction) and 0 <= reserve_fraction < 1):
            raise ValueError(f"reserve_fraction must be at least 0 and below 1, got {reserve_fraction}")
        reserve = min(int(capacity * reserve_fraction), capacity - 1)
        return cls(capacity, min(floor, capacity - reserve), reserve, what)

    def share(self, tenants: int) -> int:
        """The most one tenant may hold while `tenants` tenants (at least 1) hold some."""
        return max(self.floor, (self.capacity - self.reserve) // max(1, tenants))

    def refuse(self, held: int, total: int, tenants: int) -> Refusal | None:
        """None: the asker, holding `held` of `total`, may take one more. `tenants` counts the tenants
        holding some, the asker included even while it holds none (its arrival shrinks the shares)."""
        if total >= self.capacity:
            return Refusal(QUEUE_FULL, f"all {self.capacity} {self.what} are taken; retry shortly")
        if held < self.floor:
            return None
        share = self.share(tenants)
        if held >= share:
            return Refusal(
                TENANT_SHARE_EXCEEDED,
                f"this tenant already holds {held} {self.what}, its share of {self.capacity} while "
                f"{tenants} tenants hold some; retry when some of its requests have finished",
            )
        if total >= self.capacity - self.reserve:
            return Refusal(
                TENANT_SHARE_EXCEEDED,
                f"this tenant already holds {held} {self.what}, more than the {self.floor} every tenant "
                f"is kept, and the last {self.reserve} of {self.capacity} are kept for tenants below "
                "that; retry when some of its requests have finished",
            )
        return None


@dataclass
class Holdings:
    """How many places each tenant holds (tenants holding none are not kept), and the total."""

    counts: Counter[Hashable] = field(default_factory=Counter)

    @classmethod
    def of(cls, *parts: Mapping[Any, int]) -> Holdings:
        """The sum of `parts` (say, what the engine counted plus what is on its way to it)."""
        total: Counter[Hashable] = Counter()
        for part in parts:
            total.update(part)
        return cls(+total)  # unary plus drops the tenants at zero

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def held(self, tenant: Hashable) -> int:
        return self.counts.get(tenant, 0)

    def refusal(self, shares: Shares, tenant: Hashable) -> Refusal | None:
        held = self.held(tenant)
        return shares.refuse(held, self.total, len(self.counts) + (held == 0))

    def take(self, tenant: Hashable) -> None:
        self.counts[tenant] += 1

    def give(self, tenant: Hashable) -> None:
        """Give back a place `tenant` took (one it does not hold is a bug in the caller)."""
        left = self.counts[tenant] - 1
        if left < 0:
            raise ValueError(f"{tenant!r} gives back a place it does not hold")
        if left:
            self.counts[tenant] = left
        else:
            del self.counts[tenant]
