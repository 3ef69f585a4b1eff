"""One gateway request's metering: its quota admission, the minutes its tokens are charged to while it
runs, and the usage row written when it ends (exactly once, however it ends).

Async because a request's life is: admission and settlement go to the database in worker threads, while
a ticker on the event loop carries the request's remaining allowance into each new minute.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import anyio
from fastapi.concurrency import run_in_threadpool

from ..db.session import Database
from . import adapters, gateway, quotas, usage
from .in_flight import InFlight, Ticket
from .keys import Principal
from .tenants import quota_of

log = logging.getLogger("loraplex.web.gateway")

# How often an in-flight request looks whether a new minute began (to carry its reservation into it).
ROLL_CHECK_S = 0.5


class Call:
    """One gateway request's bookkeeping: its admission, the minutes its tokens are charged to, and the
    usage row written when it ends (exactly once, however it ends)."""

    def __init__(
        self,
        db: Database,
        principal: Principal,
        target: gateway.Target,
        endpoint: str,
        clock: Callable[[], float],
        in_flight: InFlight,
    ):
        self.db, self.principal, self.target, self.endpoint = db, principal, target, endpoint
        self.clock = clock
        self.in_flight = in_flight
        self.ticket: Ticket | None = None  # its place in flight, from admission until it finishes
        self.started = time.monotonic()
        self.started_at = clock()
        self.ledger: quotas.Ledger | None = None
        self.adapter_error: str | None = None  # the engine's reason, when it failed this adapter
        self._ticker: asyncio.Task[None] | None = None
        self._finished = False

    def admit(self, prompt_tokens: int, completion_limit: int) -> None:
        """A place in flight (Busy if the tenant's or key's cap, or its upstream share, is reached), then
        the quota's reservation (QuotaExceeded gives the place back)."""
        with self.db.session() as session:
            quota = quota_of(session, self.principal.tenant_id)
            self.ticket = self.in_flight.enter(self.principal, quota.max_in_flight)
            try:
                self.ledger = quotas.admit(
                    session, self.principal.tenant_id, quota, prompt_tokens, completion_limit, self.clock()
                )
            except BaseException:
                self.ticket.release()
                raise

    def start_ticker(self) -> None:
        """On the event loop, once admitted: follow the minutes while the request runs."""
        if self.ledger is not None and self.ledger.counted:
            self._ticker = asyncio.get_running_loop().create_task(self._tick())

    def produce(self, tokens: int) -> None:
        if self.ledger is not None:
            self.ledger.produce(tokens, self.clock())

    async def _tick(self) -> None:
        """Carries what the request may still produce into each new minute as the clock passes one."""
        minute = quotas.minute_of(self.clock())
        while True:
            await anyio.sleep(ROLL_CHECK_S)
            now = self.clock()
            if quotas.minute_of(now) != minute:
                minute = quotas.minute_of(now)
                # Shielded: the write and the ledger's note of it must not be split by a cancellation.
                with anyio.CancelScope(shield=True):
                    await self._write_ledger(now, final=False)

    async def _write_ledger(self, now: float, final: bool) -> bool:
        assert self.ledger is not None
        changes = self.ledger.pending(now, final)  # computed here, on the loop that feeds the ledger
        if not changes:
            return True
        written = await run_in_threadpool(self._apply, changes, now)
        if written:
            self.ledger.commit(changes)
        return written

    def _apply(self, changes: dict[int, int], now: float) -> bool:
        try:
            with self.db.session() as session:
                quotas.apply(session, self.principal.tenant_id, changes, now)
            return True
        except Exception:
            log.exception(
                "could not update the quota ledger", extra={"tenant": str(self.principal.tenant_id)}
            )
            return False

    async def finish(
        self,
        status: str,
        prompt: int,
        completion: int,
        exact: bool,
        produced_at_end: bool = False,
        cached: int = 0,
    ) -> None:
        """Settle the quota and record usage; never raises (the response is already decided).

        `produced_at_end`: the completion came in one piece (not streamed), so its tokens are spread
        over the minutes the request took rather than known minute by minute."""
        if self._finished:
            return
        self._finished = True
        if self.ticket is not None:  # first: the place is free before the database writes below
            self.ticket.release()
        with anyio.CancelScope(shield=True):
            if self._ticker is not None:
                self._ticker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._ticker
            now = self.clock()
            if self.ledger is not None:
                if produced_at_end:
                    self.ledger.spread(completion, self.started_at, now)
                self.ledger.settle_exact(prompt, completion, now)
                await self._write_ledger(now, final=True)
            await run_in_threadpool(self._record, status, prompt, completion, exact, cached)

    def _record(self, status: str, prompt: int, completion: int, exact: bool, cached: int = 0) -> None:
        try:
            with self.db.session() as session:
                if self.adapter_error is not None and self.target.adapter_id is not None:
                    adapters.mark_failed(session, self.target.adapter_id, self.adapter_error)
                usage.record(
                    session,
                    usage.Usage(
                        tenant_id=self.principal.tenant_id,
                        api_key_id=self.principal.key_id,
                        adapter_id=self.target.adapter_id,
                        adapter_version=self.target.adapter_version,
                        model=self.target.model,
                        endpoint=self.endpoint,
                        prompt_tokens=prompt,
                        completion_tokens=completion,
                        cached_tokens=cached,
                        exact=exact,
                        latency_ms=int((time.monotonic() - self.started) * 1000),
                        status=status,
                    ),
                )
        except Exception:
            log.exception("could not record usage", extra={"tenant": str(self.principal.tenant_id)})
