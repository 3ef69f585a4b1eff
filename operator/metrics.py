"""Read the engine's Prometheus text from each ready pod; turn it into per-pod samples for the autoscaler.

The engine exports (unlabelled, or labelled and then summed per pod):
  loraplex_requests_waiting   gauge  requests admitted to the server but not yet scheduled
  loraplex_requests_running   gauge  requests in the running batch
  loraplex_pool_utilization   gauge  used fraction of the device page pool (0..1)
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

logger = logging.getLogger(__name__)


_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(?P<value>\S+)")


def parse_metric(text: str, name: str) -> float | None:
    """Sum of every sample of `name` (all label sets) in Prometheus text format; None when absent."""
    total: float | None = None
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if match is None or match["name"] != name:
            continue
        try:
            value = float(match["value"])
        except ValueError:
            logger.warning("unparsable sample for %s: %r", name, line)
            continue
        if math.isfinite(value):
            total = value + (total or 0.0)
    return total


def ready_pod_targets(pods: Sequence[Mapping[str, Any]], port_name: str = "http") -> list[str]:
    """http://IP:PORT of each Ready, not-terminating pod (the port is the engine container's named port)."""
    targets = []
    for pod in pods:
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue
        status = pod.get("status") or {}
        conditions = status.get("conditions") or []
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
        ip = status.get("podIP")
        port = _named_port(pod, port_name)
        if ready and ip and port:
            targets.append(f"http://{ip}:{port}")
    return targets


def _named_port(pod: Mapping[str, Any], port_name: str) -> int | None:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == port_name:
                return int(port["containerPort"])
    return None


async def scrape(
    session: aiohttp.ClientSession, targets: list[str], name: str, timeout_s: float
) -> list[float]:
    """One sample per pod that answered in time; a silent pod is left out (the autoscaler handles that)."""

    async def one(base: str) -> float | None:
        try:
            async with session.get(f"{base}/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                resp.raise_for_status()
                return parse_metric(await resp.text(), name)
        except (aiohttp.ClientError, TimeoutError) as error:
            logger.info("no metrics from %s: %s", base, error)
            return None

    results = await asyncio.gather(*(one(target) for target in targets))
    return [value for value in results if value is not None]
