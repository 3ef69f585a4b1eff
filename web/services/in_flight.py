"""Requests in flight through this gateway replica: caps per tenant and per API key, and each tenant's
share of the replica's upstream connections to the engines.

A request holds a `Ticket` from its admission until it is settled (a stream: until it is closed), and
holds at most one upstream connection all that while; so counting tickets per tenant counts the tenant's
upstream connections, and the shares rule of wire/shares.py over them keeps one tenant from taking the
pool (`upstream_connections`, the size of the replica's HTTP pool for requests) from the others.

Counts are this replica's own, in memory: a replica that dies takes its requests with it, so nothing can
be left counted for a request that no longer runs (a count in the database could). With N replicas a
tenant may have N times the caps in flight; each replica still keeps its own share of its own pool.
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from dataclasses import dataclass, field

from loraplex import wire
from loraplex.wire.shares import Holdings, Shares

from ..settings import Settings
from .keys import Principal

# Seconds a refused client is told to wait: in-flight requests end in seconds, not minutes.
RETRY_AFTER_S = 1


class Busy(Exception):
    """This request may not start now (429): the error says which cap or share, in OpenAI's terms."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.error = wire.WireError(message, wire.RATE_LIMITED, code)
        self.retry_after = RETRY_AFTER_S


@dataclass
class Ticket:
    """One request's place: given back once, by `release` (again: nothing happens)."""

    owner: InFlight | None
    tenant: uuid.UUID
    key: uuid.UUID | None
    released: bool = False

    def release(self) -> None:
        if not self.released and self.owner is not None:
            self.released = True
            self.owner._leave(self)


@dataclass
class InFlight:
    """This replica's tickets by tenant and by key, and the rules they are held to."""

    tenant_cap: int
    key_cap: int
    upstream: Shares
    _tenants: Holdings = field(default_factory=Holdings)
    _keys: Counter[uuid.UUID] = field(default_factory=Counter)
    # Admission runs in worker threads (beside the quota's database reads), release on the event loop.
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def of(cls, settings: Settings) -> InFlight:
        return cls.made(
            settings.tenant_max_in_flight,
            settings.key_max_in_flight,
            settings.upstream_connections,
            settings.upstream_tenant_floor,
            settings.upstream_reserve_fraction,
        )

    @classmethod
    def made(
        cls, tenant_cap: int, key_cap: int, connections: int, floor: int, reserve_fraction: float
    ) -> InFlight:
        upstream = Shares.of(connections, floor, reserve_fraction, "of this gateway's upstream connections")
        return cls(tenant_cap, key_cap, upstream)

    @classmethod
    def defaults(cls) -> InFlight:
        """With the settings' defaults (for a Gateway made without an app)."""
        fields = Settings.model_fields
        return cls.made(
            *(
                fields[name].default
                for name in (
                    "tenant_max_in_flight",
                    "key_max_in_flight",
                    "upstream_connections",
                    "upstream_tenant_floor",
                    "upstream_reserve_fraction",
                )
            )
        )

    def enter(self, principal: Principal, tenant_cap: int | None = None) -> Ticket:
        """A ticket for one more request of `principal`, or Busy naming the cap or share it would pass.
        `tenant_cap`: the tenant's own (its quota's max_in_flight); None: this replica's default."""
        cap = self.tenant_cap if tenant_cap is None else tenant_cap
        tenant, key = principal.tenant_id, principal.key_id
        with self._lock:
            if key is not None and self._keys[key] >= self.key_cap:
                raise Busy(
                    f"this API key has {self._keys[key]} requests in flight, the most one key may have; "
                    "retry when one has finished",
                    wire.TOO_MANY_IN_FLIGHT,
                )
            held = self._tenants.held(tenant)
            if held >= cap:
                raise Busy(_over_cap(held, cap), wire.TOO_MANY_IN_FLIGHT)
            refusal = self._tenants.refusal(self.upstream, tenant)
            if refusal is not None:
                raise Busy(refusal.message, refusal.code)
            self._tenants.take(tenant)
            if key is not None:
                self._keys[key] += 1
        return Ticket(self, tenant, key)

    def held(self, principal: Principal) -> tuple[int, int]:
        """(the tenant's tickets, the key's tickets) now."""
        with self._lock:
            key = principal.key_id
            return self._tenants.held(principal.tenant_id), self._keys[key] if key is not None else 0

    def _leave(self, ticket: Ticket) -> None:
        with self._lock:
            self._tenants.give(ticket.tenant)
            if ticket.key is not None:
                self._keys[ticket.key] -= 1
                if not self._keys[ticket.key]:
                    del self._keys[ticket.key]


def _over_cap(held: int, cap: int) -> str:
    if cap == 0:
        return "this tenant's quota allows no requests in flight; ask an admin to raise max_in_flight"
    return (
        f"this tenant has {held} requests in flight, its limit is {cap} (max_in_flight); retry when one "
        "has finished"
    )
