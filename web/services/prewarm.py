"""Prewarm: a pod that joins an adapter's replica set loads the adapter before it takes the adapter's traffic.

The router's placement (routing.py) announces every replica-set change. For each pod a change adds, this
asks the engine there to register and load the adapter (wire.PREWARM_PATH) in the background, and until
that answers the pod is *warming*: the router tries it after the members that hold the adapter already,
and after the pods that held it before the change (a set moved by a pod joining the deployment, or a pod
leaving it while it still serves), so no request pays a cold load that a warm pod could have spared it.
A pod that cannot be warmed (refused, unreachable, timed out) stops warming: requests may reach it then
and load the adapter themselves, as without prewarm. Its first placement on an empty set is not prewarmed:
a request is already waiting for it, and the engine loads it for that request.

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
        self._warming: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._handing_over: dict[str, tuple[str, ...]] = {}  # key -> pods that held it before a move
        self.warmed = 0  # prewarms that answered (tests and logs)
        self.failed = 0

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
        if change.reason == "placed":  # an empty set's first pod: its request is already on the way
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # placed outside the server's loop (a script): nobody to await the loads
            return
        if change.removed:
            self._handing_over[change.key] = tuple(
                dict.fromkeys((*self._handing_over.get(change.key, ()), *change.removed))
            )
        for pod in change.added:
            if (pod, change.key) not in self._warming:
                task = loop.create_task(self._warm(pod, change.key, list(refs)))
                self._warming[(pod, change.key)] = task

    # -- what the router asks -----------------------------------------------------------------------

    def warming(self, pod: str, key: str) -> bool:
        return (pod, key) in self._warming

    def arrange(self, key: str, members: list[str], healthy: Iterable[str]) -> list[str]:
        """Members in the order to try them: those not warming (in the order given), then the pods that
        held the adapter before the change (while any member warms), then the warming members."""
        warming = [m for m in members if self.warming(m, key)]
        if not warming:
            self._handing_over.pop(key, None)
            return members
        ready = [m for m in members if m not in warming]
        alive = set(healthy)
        previous = [p for p in self._handing_over.get(key, ()) if p in alive and p not in members]
        return ready + previous + warming

    async def close(self) -> None:
        """Stop the prewarms in flight (the server is stopping: nobody will route to their pods)."""
        tasks = list(self._warming.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def settle(self) -> None:
        """Wait for every prewarm in flight (tests; a shutdown)."""
        while self._warming:
            await asyncio.gather(*self._warming.values(), return_exceptions=True)

    # -- inside -------------------------------------------------------------------------------------

    async def _warm(self, pod: str, key: str, refs: list[wire.AdapterRef]) -> None:
        try:
            for ref in refs:
                await self._post(pod, ref)
            self.warmed += 1
            log.info("prewarmed adapter on a new replica", extra={"replica": pod, "adapter": key})
        except Exception as exc:  # the pod serves it cold if asked: as without prewarm
            self.failed += 1
            log.warning(
                "prewarm failed; the replica loads the adapter on demand",
                extra={"replica": pod, "adapter": key, "error": f"{type(exc).__name__}: {exc}"[:300]},
            )
        finally:
            self._warming.pop((pod, key), None)
            if not any(k == key for _, k in self._warming):
                self._handing_over.pop(key, None)
