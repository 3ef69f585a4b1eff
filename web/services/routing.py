"""Adapter affinity: rendezvous hashing of an adapter over a deployment's replicas, skipping dead ones.

The same adapter lands on the same replica while it is up (its weights stay resident there); when that
replica goes, only its adapters move. Health is passive: a replica that refuses a connection is skipped
for `cooldown_s`, then tried again. A `kubernetes://<namespace>/<name>` endpoint stands for the ready
pods that discovery currently sees (web/services/discovery.py); plain URLs are used as given.
"""

from __future__ import annotations

import hashlib
import random
import time

from .discovery import Discovery

# Cooldown entries of replicas that are gone (pods come and go, each with a new IP) are dropped once the
# table holds this many, so it stays bounded however long the control plane runs.
MAX_COOLDOWN_ENTRIES = 4096


def rendezvous_order(key: str, endpoints: list[str]) -> list[str]:
    """Endpoints from most to least preferred for `key` (highest random weight first)."""

    def weight(endpoint: str) -> int:
        digest = hashlib.blake2b(f"{key}\n{endpoint}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big")

    return sorted(endpoints, key=weight, reverse=True)


class Router:
    def __init__(self, cooldown_s: float, discovery: Discovery | None = None):
        self.cooldown_s = cooldown_s
        self.discovery = discovery
        self._down_until: dict[str, float] = {}

    def replicas(self, endpoints: list[str]) -> list[str]:
        """The replica URLs a deployment's endpoints stand for right now."""
        if self.discovery is None:
            return [e for e in endpoints if not e.startswith("kubernetes://")]
        return self.discovery.expand(endpoints)

    def order(self, key: str | None, endpoints: list[str]) -> list[str]:
        """Healthy replicas in preference order, then the ones resting (a last resort, not a dead end).

        With no key (the base model alone) any replica will do, so the load is spread at random.
        """
        endpoints = self.replicas(endpoints)
        ranked = rendezvous_order(key, endpoints) if key else random.sample(endpoints, len(endpoints))
        now = time.monotonic()
        healthy = [e for e in ranked if self._down_until.get(e, 0.0) <= now]
        return healthy + [e for e in ranked if e not in healthy]

    def mark_down(self, endpoint: str) -> None:
        now = time.monotonic()
        if len(self._down_until) >= MAX_COOLDOWN_ENTRIES:
            self._down_until = {e: t for e, t in self._down_until.items() if t > now}
        self._down_until[endpoint] = now + self.cooldown_s

    def mark_up(self, endpoint: str) -> None:
        self._down_until.pop(endpoint, None)
