"""A pretend cluster on 127.0.0.1: the strict API server, fake engines, and a fake kubelet, in one thread.

The fake kubelet/deployment controller keeps, for every Deployment, `spec.replicas` Ready pods whose
`http` port is a real aiohttp server answering /metrics, and writes the Deployment's status; so the
operator's status and autoscaler code paths run unchanged. The test drives it through sync methods.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import aiohttp.web
import kmock

from tests.operator.apiserver import StrictApiServer

T = TypeVar("T")
NAMESPACE = "default"
PATHS = {
    "InferenceDeployment": "/apis/loraplex.dev/v1alpha1/namespaces/{ns}/inferencedeployments",
    "Deployment": "/apis/apps/v1/namespaces/{ns}/deployments",
    "Service": "/api/v1/namespaces/{ns}/services",
    "ConfigMap": "/api/v1/namespaces/{ns}/configmaps",
    "Pod": "/api/v1/namespaces/{ns}/pods",
    "PodDisruptionBudget": "/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets",
    "HorizontalPodAutoscaler": "/apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers",
    "InferencePool": "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools",
    "Event": "/api/v1/namespaces/{ns}/events",
    "ClusterKopfPeering": "/apis/kopf.dev/v1/clusterkopfpeerings",  # cluster-scoped: {ns} unused
}


class FakeEngine:
    """One engine pod's /metrics: the test sets the gauges, the adapters in flight and, as an engine behind
    the internal token, the token a scrape must bring (401 without it)."""

    def __init__(self) -> None:
        self.waiting = 0.0
        self.adapters: list[str] = []  # adapters with requests in flight (vllm:lora_requests_info)
        self.max_lora = 4
        self.token: str | None = None
        self.port = 0
        self._runner: aiohttp.web.AppRunner | None = None

    async def start(self) -> None:
        app = aiohttp.web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = aiohttp.web.AppRunner(app)
        await self._runner.setup()
        site = aiohttp.web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _metrics(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        if self.token is not None and request.headers.get("Authorization") != f"Bearer {self.token}":
            return aiohttp.web.Response(status=401)
        text = (
            "# TYPE loraplex_requests_waiting gauge\n"
            f"loraplex_requests_waiting {self.waiting}\n"
            "loraplex_requests_running 1\nloraplex_pool_utilization 0.5\n"
            f'vllm:lora_requests_info{{max_lora="{self.max_lora}",running_lora_adapters='
            f'"{",".join(self.adapters)}",waiting_lora_adapters=""}} 1700000000\n'
        )
        return aiohttp.web.Response(text=text)


class Cluster:
    def __init__(self, engines: int = 6) -> None:
        self.loop = asyncio.new_event_loop()
        self.engines = [FakeEngine() for _ in range(engines)]
        self._thread = threading.Thread(target=self.loop.run_forever, name="fake-cluster", daemon=True)
        self._stack: list[Any] = []
        self.url = ""

    # --- lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        self.run(self._start())

    def stop(self) -> None:
        try:
            self.run(self._stop(), timeout=15)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)

    async def _start(self) -> None:
        self.api = StrictApiServer()
        for key, kind, subresources in [
            ("loraplex.dev/v1alpha1/inferencedeployments", "InferenceDeployment", ("status", "scale")),
            ("apps/v1/deployments", "Deployment", ("status", "scale")),
            ("v1/pods", "Pod", ()),  # the fake kubelet writes pod status on create
            ("v1/services", "Service", ("status",)),
            ("v1/configmaps", "ConfigMap", ()),
            ("v1/events", "Event", ()),
            ("policy/v1/poddisruptionbudgets", "PodDisruptionBudget", ("status",)),
            ("autoscaling/v2/horizontalpodautoscalers", "HorizontalPodAutoscaler", ("status",)),
            # The Gateway API Inference Extension's pool, as its v1 CRD declares it.
            ("inference.networking.k8s.io/v1/inferencepools", "InferencePool", ("status",)),
        ]:
            self.api.declare(key, kind, subresources)
        # kopf waits to discover these two before it watches anything; with scanning off it never lists them
        # (kmock cannot route the cluster-scoped /api/v1/namespaces list).
        self.api.declare("v1/namespaces", "Namespace", (), False)
        # kopf's peering kind, as the chart's CRD declares it (cluster-scoped, no status subresource).
        self.api.declare("kopf.dev/v1/clusterkopfpeerings", "ClusterKopfPeering", (), False)
        self.api.declare(
            "apiextensions.k8s.io/v1/customresourcedefinitions", "CustomResourceDefinition", (), False
        )
        await self.api.__aenter__()
        self.server = kmock.Server(self.api)
        await self.server.__aenter__()
        self.url = str(self.server.url).rstrip("/")
        self.http = aiohttp.ClientSession()
        for engine in self.engines:
            await engine.start()
        self._kubelet = asyncio.ensure_future(self._kubelet_loop())

    async def _stop(self) -> None:
        self._kubelet.cancel()
        await asyncio.gather(self._kubelet, return_exceptions=True)
        for engine in self.engines:
            await engine.stop()
        await self.http.close()
        self.api.close_watches()
        await self.server.__aexit__(None, None, None)
        await self.api.__aexit__(None, None, None)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 20) -> T:
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout=timeout)

    def write_kubeconfig(self, path: Path) -> Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": "fake-token"}}],
            "contexts": [
                {"name": "fake", "context": {"cluster": "fake", "user": "tester", "namespace": NAMESPACE}}
            ],
            "current-context": "fake",
        }
        path.write_text(json.dumps(config))
        return path

    # --- API calls (sync, for the test body) -------------------------------------------------------------
    async def _request(
        self, method: str, path: str, body: Any = None, ctype: str = "application/json"
    ) -> Any:
        headers = {"Content-Type": ctype}
        data = None if body is None else json.dumps(body)
        async with self.http.request(method, self.url + path, data=data, headers=headers) as resp:
            payload = await resp.json(content_type=None)
            if resp.status == 404:
                return None
            if resp.status >= 300:
                raise RuntimeError(f"{method} {path}: {resp.status} {payload}")
            return payload

    def path(self, kind: str, name: str | None = None, ns: str = NAMESPACE) -> str:
        base = PATHS[kind].format(ns=ns)
        return f"{base}/{name}" if name else base

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        return self.run(self._request("POST", self.path(obj["kind"]), obj))

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        return self.run(self._request("GET", self.path(kind, name)))

    def list(self, kind: str) -> list[dict[str, Any]]:
        return self.run(self._request("GET", self.path(kind)))["items"]

    def patch(self, kind: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return self.run(self._request("PATCH", self.path(kind, name), patch, "application/merge-patch+json"))

    def delete(self, kind: str, name: str) -> None:
        self.run(self._request("DELETE", self.path(kind, name)))

    def set_load(self, waiting: float) -> None:
        for engine in self.engines:
            engine.waiting = waiting

    def set_adapters(self, count: int) -> None:
        """Every engine has `count` adapters with requests in flight."""
        for engine in self.engines:
            engine.adapters = [f"id:{i}" for i in range(count)]

    def require_token(self, token: str | None) -> None:
        for engine in self.engines:
            engine.token = token

    # --- the fake kubelet and deployment controller ------------------------------------------------------
    async def _kubelet_loop(self) -> None:
        while True:
            # A write that raced with the operator's fails; the next step catches up.
            with contextlib.suppress(aiohttp.ClientError, RuntimeError, KeyError):
                await self._kubelet_step()
            await asyncio.sleep(0.1)

    async def _kubelet_step(self) -> None:
        deployments = (await self._request("GET", self.path("Deployment")))["items"]
        pods = (await self._request("GET", self.path("Pod")))["items"]
        for dep in deployments:
            name = dep["metadata"]["name"]
            wanted = min(int(dep["spec"].get("replicas") or 0), len(self.engines))
            mine = sorted(
                (p for p in pods if p["metadata"].get("labels", {}).get("fake/deployment") == name),
                key=lambda p: p["metadata"]["name"],
            )
            for index in range(len(mine), wanted):
                await self._request("POST", self.path("Pod"), self._pod(dep, index))
            for pod in mine[wanted:]:
                await self._request("DELETE", self.path("Pod", pod["metadata"]["name"]))
            status = {
                "observedGeneration": dep["metadata"].get("generation", 1),
                "replicas": wanted,
                "updatedReplicas": wanted,
                "readyReplicas": wanted,
                "availableReplicas": wanted,
            }
            if {k: dep.get("status", {}).get(k) for k in status} != status:
                await self._request(
                    "PATCH",
                    self.path("Deployment", name) + "/status",
                    {"status": status},
                    "application/merge-patch+json",
                )

    def _pod(self, dep: dict[str, Any], index: int) -> dict[str, Any]:
        template = dep["spec"]["template"]
        container = dict(template["spec"]["containers"][0])
        container["ports"] = [{"name": "http", "containerPort": self.engines[index].port}]
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{dep['metadata']['name']}-{index}",
                "namespace": dep["metadata"]["namespace"],
                "labels": {**template["metadata"]["labels"], "fake/deployment": dep["metadata"]["name"]},
            },
            "spec": {"containers": [container]},
            "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
        }


def wait_for(check: Callable[[], T], timeout: float = 60.0, interval: float = 0.1, what: str = "") -> T:
    """Poll `check` until it returns something truthy; fail with `what` after `timeout` seconds."""
    import time

    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or check}; last value: {last!r}")
