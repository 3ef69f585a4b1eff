"""Prewarm, the gateway's driver: a pod that joins an adapter's replica set loads the adapter before it takes
the adapter's traffic.

The router's placement (routing.py) announces every replica-set change. For each pod a change adds, this
asks the engine there to register and load the adapter (wire.PREWARM_PATH) in the background; which pods
are warming, and the order the router tries a set's members in meanwhile, is `warming.Warming`'s
bookkeeping (the same object `bench cluster` drives on simulated pods). A pod that cannot be warmed
(refused, unreachable, timed out) stops warming: requests may reach it then and load the adapter
themselves, as without prewarm.

Bookkeeping is per control-plane replica and in memory: a replica that missed a change only routes a
request to a cold member once, exactly as without prewarm.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

import httpx

from loraplex import wire

from .routing import Change
from .warming import Warming

log = logging.getLogger(__name__)

# Adapters whose engine registrations are remembered (the most recently routed), and per adapter digest
# the tenants' adapters that share it (each is its own registration on an engine).
MAX_REMEMBERED = 4096
MAX_REFS_PER_KEY = 4
PREWARM_TIMEOUT_S = 120.0


class Prewarmer:
    def __init__(
        self,
        post: Callable[[str, wire.AdapterRef], Coroutine[Any, Any, None]],
        max_remembered: int = MAX_REMEMBERED,
    ):
        self._post = post
        self._max = max_remembered
        self._refs: OrderedDict[str, list[wire.AdapterRef]] = OrderedDict()
        self.state = Warming()
        self._tasks: dict[tuple[str, str], asyncio.Task[None]] = {}

    @property
    def warmed(self) -> int:  # prewarms that answered (tests and logs)
        return self.state.warmed

    @property
    def failed(self) -> int:
        return self.state.failed

    @classmethod
    def over_http(cls, http: httpx.AsyncClient, engine_token: str) -> Prewarmer:
        async def post(pod: str, ref: wire.AdapterRef) -> None:
            body = wire.AdapterRegistration(ref.name, ref.uri, ref.sha256).body()
            response = await http.post(
                f"{pod}{wire.PREWARM_PATH}",
                json=body,
                headers={wire.INTERNAL_TOKEN_HEADER: engine_token},
                timeout=PREWARM_TIMEOUT_S,
            )
            response.raise_for_status()

        return cls(post)

    # -- inputs -------------------------------------------------------------------------------------

    def remember(self, key: str, ref: wire.AdapterRef) -> None:
        """The adapter behind placement key `key`, as a request for it names it (before routing)."""
        refs = self._refs.pop(key, [])
        if ref not in refs:
            refs = [ref, *refs][:MAX_REFS_PER_KEY]
        self._refs[key] = refs
        while len(self._refs) > self._max:
            self._refs.popitem(last=False)

    def on_change(self, change: Change) -> None:
        """A replica set changed (routing.Placement's listener): warm the pods it added, and keep the pods
        it removed as a fallback until they are warm."""
        refs = self._refs.get(change.key)
        if not refs or not change.added:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # placed outside the server's loop (a script): nobody to await the loads
            return
        for pod in self.state.on_change(change):
            self.state.started(pod, change.key)
            self._tasks[(pod, change.key)] = loop.create_task(self._warm(pod, change.key, list(refs)))

    # -- what the router asks -----------------------------------------------------------------------

    def warming(self, pod: str, key: str) -> bool:
        return self.state.warming(pod, key)

    def arrange(self, key: str, members: list[str], healthy: Iterable[str]) -> list[str]:
        """Members in the order to try them (`Warming.arrange`): not warming, then the pods the adapter
        moved from, then the warming ones."""
        return self.state.arrange(key, members, healthy)

    async def close(self) -> None:
        """Stop the prewarms in flight (the server is stopping: nobody will route to their pods)."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def settle(self) -> None:
        """Wait for every prewarm in flight (tests; a shutdown)."""
        while self._tasks:
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    # -- inside -------------------------------------------------------------------------------------

    async def _warm(self, pod: str, key: str, refs: list[wire.AdapterRef]) -> None:
        ok = False
        try:
            for ref in refs:
                await self._post(pod, ref)
            ok = True
            log.info("prewarmed adapter on a new replica", extra={"replica": pod, "adapter": key})
        except Exception as exc:  # the pod serves it cold if asked: as without prewarm
            log.warning(
                "prewarm failed; the replica loads the adapter on demand",
                extra={"replica": pod, "adapter": key, "error": f"{type(exc).__name__}: {exc}"[:300]},
            )
        finally:  # a cancelled prewarm (shutdown) ends too, counted as failed
            self._tasks.pop((pod, key), None)
            self.state.finished(pod, key, ok)
