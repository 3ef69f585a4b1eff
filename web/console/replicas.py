"""The health of a deployment's engine replicas, asked for when an admin opens the page.

Each replica is probed at once (concurrently, two seconds at most): `/ready` says whether it serves
(200) or why not (503 with a reason); a replica without `/ready` is judged by `/health`. The replicas of a
`kubernetes://` deployment are the pods discovery sees: ready ones are probed too, the others show why
Kubernetes does not count them ready.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace

import httpx

from ..schemas import DeploymentPublic

PROBE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class ReplicaHealth:
    endpoint: str
    state: str  # "ready", "not ready" or "unreachable"
    detail: str
    latency_ms: int | None
    pod: str | None = None  # the engine pod, for a discovered replica


async def probe(client: httpx.AsyncClient, endpoint: str) -> ReplicaHealth:
    started = time.monotonic()
    try:
        response = await client.get(f"{endpoint}/ready", timeout=PROBE_TIMEOUT_S)
        if response.status_code == 404:
            response = await client.get(f"{endpoint}/health", timeout=PROBE_TIMEOUT_S)
    except httpx.TimeoutException:
        return ReplicaHealth(endpoint, "unreachable", f"no answer within {PROBE_TIMEOUT_S:.0f} s", None)
    except httpx.HTTPError as exc:
        return ReplicaHealth(endpoint, "unreachable", type(exc).__name__, None)
    latency = int((time.monotonic() - started) * 1000)
    if response.status_code == 200:
        return ReplicaHealth(endpoint, "ready", "serving", latency)
    reason = ""
    try:
        body = response.json()
        reason = str(body.get("reason") or body.get("status") or "") if isinstance(body, dict) else ""
    except ValueError:
        pass
    return ReplicaHealth(endpoint, "not ready", reason or f"HTTP {response.status_code}", latency)


async def probe_all(client: httpx.AsyncClient, endpoints: list[str]) -> dict[str, ReplicaHealth]:
    unique = list(dict.fromkeys(endpoints))
    results = await asyncio.gather(*(probe(client, e) for e in unique))
    return {r.endpoint: r for r in results}


async def deployment_health(
    client: httpx.AsyncClient, rows: list[DeploymentPublic]
) -> dict[str, list[ReplicaHealth]]:
    """Each deployment's replicas (static URLs, discovered pods), probed where there is a URL to ask."""
    wanted = [r.endpoint for d in rows for r in d.replicas if r.endpoint and r.ready is not False]
    probed = await probe_all(client, wanted)
    health: dict[str, list[ReplicaHealth]] = {}
    for row in rows:
        entries = health.setdefault(row.name, [])
        for replica in row.replicas:
            if replica.endpoint and replica.ready is not False:
                entries.append(replace(probed[replica.endpoint], pod=replica.pod))
            else:  # Kubernetes says not ready: the gateway skips it, so there is nothing to probe
                entries.append(
                    ReplicaHealth(
                        replica.endpoint or "no IP yet", "not ready", replica.detail, None, replica.pod
                    )
                )
    return health
