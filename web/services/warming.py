"""Which pods are loading which adapter ahead of its traffic (prewarm), and the order that follows from it.

Bookkeeping only: no I/O, no event loop, no clock. The gateway's `Prewarmer` (prewarm.py) drives it over
HTTP, and `bench cluster` drives the same object on its simulated pods, so the simulation routes around
warming pods exactly as the gateway does.

A pod that a replica-set change adds is *warming* from `started(pod, key)` until `finished(pod, key, ok)`:
the router tries it after the members that hold the adapter already, and after the pods that held it before
the change (a set moved by a pod joining the deployment, or a pod leaving it while it still serves), so no
request pays a load that a warm pod could have spared it. Whatever the outcome, `finished` ends the warming:
a pod that could not be warmed then takes requests and loads the adapter for them, as without prewarm.
"""

from __future__ import annotations

from collections.abc import Iterable

from .routing import Change


class Warming:
    def __init__(self) -> None:
        self._warming: dict[str, set[str]] = {}  # key -> pods loading it now
        self._handing_over: dict[str, tuple[str, ...]] = {}  # key -> pods that held it before a move
        self.warmed = 0  # prewarms that ended well (tests, logs, the bench's report)
        self.failed = 0

    # -- inputs -------------------------------------------------------------------------------------

    def on_change(self, change: Change) -> tuple[str, ...]:
        """A replica set changed: the pods to warm now (the caller `started` each it sends a load to). The
        pods it removed stay the fallback until the added ones are warm. An empty set's first pod is not
        warmed: the request that placed it is already on its way, and the engine loads it for that."""
        if not change.added or change.reason == "placed":
            return ()
        if change.removed:
            before = (*self._handing_over.get(change.key, ()), *change.removed)
            self._handing_over[change.key] = tuple(dict.fromkeys(before))
        warming = self._warming.get(change.key, set())
        return tuple(p for p in change.added if p not in warming)

    def started(self, pod: str, key: str) -> None:
        self._warming.setdefault(key, set()).add(pod)

    def finished(self, pod: str, key: str, ok: bool) -> None:
        """The load on `pod` answered (`ok`) or failed; either way the pod takes the adapter's traffic."""
        pods = self._warming.get(key)
        if pods is None or pod not in pods:
            return  # not warming (a late answer after a restart of the bookkeeping): nothing to end
        pods.discard(pod)
        if ok:
            self.warmed += 1
        else:
            self.failed += 1
        if not pods:
            del self._warming[key]
            self._handing_over.pop(key, None)

    # -- what the router asks -----------------------------------------------------------------------

    def warming(self, pod: str, key: str) -> bool:
        return pod in self._warming.get(key, ())

    def in_flight(self) -> list[tuple[str, str]]:
        """Every (pod, key) warming now."""
        return [(pod, key) for key, pods in self._warming.items() for pod in sorted(pods)]

    def arrange(self, key: str, members: list[str], healthy: Iterable[str]) -> list[str]:
        """Members in the order to try them: those not warming (in the order given), then the pods that
        held the adapter before the change (while any member warms), then the warming members."""
        pods = self._warming.get(key, set())
        warming = [m for m in members if m in pods]
        if not warming:
            self._handing_over.pop(key, None)
            return members
        ready = [m for m in members if m not in pods]
        alive = set(healthy)
        previous = [p for p in self._handing_over.get(key, ()) if p in alive and p not in members]
        return ready + previous + warming
