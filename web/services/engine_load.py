"""Every engine's own queue, read by each control-plane replica: the shared half of the router's load signal.

A replica's router counts the requests it sent itself (routing.Outstanding): fresh, but blind to the other
replicas' requests. This reads each routed pod's /metrics every `interval_s` (the inference-gateway
protocol's `vllm:num_requests_waiting` + `vllm:num_requests_running`, behind the internal token) into a
routing.EngineMetrics, and the router takes the larger of the two per pod (routing.Combined). Every replica
then ranks pods by the same engine-reported load, plus what it sent itself since the last read, so replicas
that share the HRW orders also agree on which pods have room when a set grows (docs/placement.md).

The same read takes each engine's adapter budget (`loraplex_adapter_capacity_bytes`: pool bytes adapters
may hold while a full batch keeps its KV headroom), which the router's placement bounds each pod by
(routing.MeasuredCapacity); an engine that reports none is given LORAPLEX_PLACEMENT_POD_ADAPTER_BYTES. When
a pod's budget changes (its first read, a restart with another pool), the deployments it serves place
their sets again at once (Router.refit), so no pod stays assigned more than it reports.

A pod that does not answer keeps its last reading until it leaves the router's pods; then it is forgotten.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import httpx

from loraplex import wire

from .routing import Combined, EngineMetrics, MeasuredCapacity, Router

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 2.0


class EngineLoadScraper:
    def __init__(self, http: httpx.AsyncClient, engine_token: str, router: Router, interval_s: float):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, not {interval_s!r}")
        self.http, self.token, self.router, self.interval_s = http, engine_token, router, interval_s
        self.metrics = EngineMetrics()
        self.failures = 0  # reads that failed (logs and tests)
        self._task: asyncio.Task[None] | None = None
        self._known: set[str] = set()
        router.load = Combined(router.outstanding, self.metrics)
        router.capacity = MeasuredCapacity(self.metrics, router.policy.pod_adapter_bytes)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="engine-load-scraper")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def scrape_once(self) -> None:
        pods = self.router.known_pods()
        for gone in self._known - pods:
            self.metrics.forget(gone)
        self._known = pods
        await asyncio.gather(*(self._scrape(pod) for pod in sorted(pods)))

    async def _run(self) -> None:
        while True:
            await self.scrape_once()
            await asyncio.sleep(self.interval_s)

    async def _scrape(self, pod: str) -> None:
        try:
            response = await self.http.get(
                f"{pod}/metrics", headers={wire.INTERNAL_TOKEN_HEADER: self.token}, timeout=SCRAPE_TIMEOUT_S
            )
            response.raise_for_status()
            budget = self.metrics.adapter_capacity(pod)
            self.metrics.observe_text(pod, response.text)
        except (httpx.HTTPError, ValueError) as error:
            self.failures += 1
            log.debug("reading %s/metrics failed: %s", pod, error)
            return
        if self.metrics.adapter_capacity(pod) != budget:
            # At once, before another request is placed: the sets fit the budgets every pod reports now.
            log.info("%s reports an adapter budget of %s bytes", pod, self.metrics.adapter_capacity(pod))
            self.router.refit(pod)
