"""Admission by adapter: whether a waiting request may join the running batch as far as its adapter goes.

The scheduler's adapter policy, chosen when it is made: `AdapterAdmission` for an engine that serves
adapters (a request joins only when the pool can hold both its adapter's pages, unless resident, and the
pages of its first chunk, so no adapter is loaded for it in vain; a few adapter loads per step at most),
`BaseModelAdmission` for a scheduler without a registry (every request is the base model's). Bookkeeping
only, like the scheduler: no torch (tests/engine/test_torch_free.py).
"""

from __future__ import annotations

import enum

from .lora.registry import AdapterLoad, AdapterRegistry
from .pool import PagePool
from .request import Request


class Verdict(enum.Enum):
    JOIN = "join"  # the adapter is held for it (its pages handed out, the load planned if not resident)
    REFUSED = "refused"  # its adapter is refused: it will never run
    WAIT = "wait"  # this step's adapter loads are spent: it may join on a later step
    STARVED = "starved"  # the pool cannot hold its adapter beside its first chunk now


class AdapterAdmission:
    def __init__(self, registry: AdapterRegistry, pool: PagePool, max_loads_per_step: int = 4):
        """`max_loads_per_step`: loading an adapter costs pages and a copy, so when many new adapters
        wait only a few join per step, and one step's loads cannot crowd out the running batch's KV."""
        self.registry = registry
        self.pool = pool
        self.max_loads_per_step = max_loads_per_step
        self._loads = 0  # adapter loads begun this step

    def add(self, request: Request) -> None:
        """A request naming an adapter counts as its user until it ends."""
        if request.adapter is not None:
            self.registry.add_user(request.adapter)

    def begin_step(self) -> None:
        self._loads = 0

    def admit(self, request: Request, kv_pages: int) -> Verdict:
        """Whether `request` may join now with `kv_pages` more pages for its first chunk; JOIN holds its
        adapter (acquired once: a request put back for want of KV pages keeps nothing)."""
        name = request.adapter
        if name is None or request.holds_adapter:
            return Verdict.JOIN
        if name in self.registry.failed:
            return Verdict.REFUSED
        adapter_pages = self.registry.pages_needed(name)
        loading = adapter_pages > 0
        if loading and self._loads >= self.max_loads_per_step:
            return Verdict.WAIT
        can_free = self.pool.num_free + self.pool.reclaimable_pages()
        if (loading and can_free < adapter_pages + kv_pages) or not self.registry.acquire(name):
            return Verdict.STARVED
        self._loads += loading
        request.holds_adapter = True
        return Verdict.JOIN

    def ready(self, request: Request) -> bool:
        """Whether the request's adapter, if any, needs no load (it is resident, or held already)."""
        if request.adapter is None or request.holds_adapter:
            return True
        return (
            request.adapter not in self.registry.failed and self.registry.pages_needed(request.adapter) == 0
        )

    def pending_loads(self) -> list[AdapterLoad]:
        return self.registry.pending_loads()

    def release(self, request: Request) -> None:
        """The request gives its adapter back (preempted, put back, or ended)."""
        if request.holds_adapter:
            assert request.adapter is not None
            self.registry.release(request.adapter)
            request.holds_adapter = False

    def finished(self, request: Request) -> None:
        if request.adapter is not None:
            self.registry.remove_user(request.adapter)


class BaseModelAdmission:
    """No adapters served: every request is the base model's and joins as far as adapters go."""

    def add(self, request: Request) -> None:
        assert request.adapter is None, "a request names an adapter but the engine serves none"

    def begin_step(self) -> None:
        pass

    def admit(self, request: Request, kv_pages: int) -> Verdict:
        return Verdict.JOIN

    def ready(self, request: Request) -> bool:
        return True

    def pending_loads(self) -> list[AdapterLoad]:
        return []

    def release(self, request: Request) -> None:
        pass

    def finished(self, request: Request) -> None:
        pass


Admission = AdapterAdmission | BaseModelAdmission
