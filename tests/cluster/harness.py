"""A cluster in a box: the API emulator, a controller loop, our kubelet and a pod network on one machine.

`ClusterInABox` starts, in order: the bridge (network.py); the strict API emulator (tests/operator) served
on the bridge's node address, so pods reach it; a thread that registers every applied CRD's kind with the
emulator (what the apiextensions server does); and one thread that runs the controllers (controllers.py)
and the kubelet (kubelet.py) every `TICK` seconds. Backing services that a cluster would get from outside
the chart (Postgres, an S3 server) are started on the node address by `postgres()` and `s3()`, and
`add_host()` gives them names in every pod's hosts file (as an external DNS record would).

Everything it creates (namespaces, veths, the bridge, processes, mount points, temp dirs) is removed by
`stop()`, which also runs at interpreter exit; `Network.sweep_stale()` removes what a killed run left.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import glob
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import kmock

from tests.cluster import leftovers
from tests.cluster.apiserver import ClusterApiServer
from tests.cluster.controllers import Controllers
from tests.cluster.kube import KINDS, Client, crd_kind
from tests.cluster.kubelet import Image, Kubelet, die_with_parent
from tests.cluster.network import Network
from tests.cluster.proxy import ServiceProxy
from tests.operator.cluster import wait_for

logger = logging.getLogger(__name__)
T = TypeVar("T")
TICK = 0.25
REPO = Path(__file__).resolve().parents[2]


class ClusterInABox:
    def __init__(
        self, image_env: dict[str, str] | None = None, images: dict[str, Image] | None = None
    ) -> None:
        Network.sweep_stale()
        leftovers.sweep()
        self.leftovers = leftovers.Leftovers()
        self.root = Path(tempfile.mkdtemp(prefix="lpx-cluster-"))
        self.leftovers.path_made(self.root)
        self.network = Network()
        self.proxy = ServiceProxy()
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self.loop.run_forever, name="apiserver", daemon=True)
        self._control_thread = threading.Thread(target=self._control_loop, name="controllers", daemon=True)
        self._stopping = threading.Event()
        self._image_env = image_env or {}
        self._images = images or {}
        self._children: list[subprocess.Popen[bytes]] = []
        self._cleanups: list[Callable[[], object]] = []
        self._started = False
        self.url = ""
        self.errors: list[str] = []

    # --- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> ClusterInABox:
        atexit.register(self.stop)
        self._started = True
        self.network.up()
        self._loop_thread.start()
        self._run(self._start_api())
        self.kubeconfig = self.root / "kubeconfig"
        self.kubeconfig.write_text(json.dumps(self.kubeconfig_for("default")))
        self.client = Client(self.url)
        self.controllers = Controllers(Client(self.url), self.network, self.proxy)
        self.kubelet = Kubelet(
            Client(self.url),
            self.network,
            self.root / "pods",
            self.url,
            Path(sys.executable).parent,
            REPO,
            image_env=self._image_env,
            images=self._images,
        )
        self.kubelet.on_path_made = self.leftovers.path_made
        self._control_thread.start()
        return self

    def stop(self) -> None:
        """Idempotent and never raising: every step runs even when an earlier one failed."""
        if not self._started:
            return
        self._started = False
        self._stopping.set()
        steps: list[Callable[[], object]] = [
            lambda: self._control_thread.join(timeout=30),
            lambda: self.kubelet.shutdown(),
            *reversed(self._cleanups),
            self._stop_children,
            self.proxy.close,
            lambda: self._run(self._stop_api(), timeout=5),  # open watches may hold it: the loop stops anyway
            lambda: self.loop.call_soon_threadsafe(self.loop.stop),
            lambda: self._loop_thread.join(timeout=10),
            self.network.down,
            lambda: shutil.rmtree(self.root, ignore_errors=True),
            self.leftovers.done,
        ]
        for step in steps:
            try:
                step()
            except Exception:
                logger.exception("cluster teardown step failed")
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)

    def __enter__(self) -> ClusterInABox:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout=timeout)

    # --- the API server ------------------------------------------------------------------------------
    async def _start_api(self) -> None:
        self.api = ClusterApiServer()
        for kind, info in KINDS.items():
            self.api.declare(info.key, kind, info.subresources, info.namespaced)
        await self.api.__aenter__()
        self.server = kmock.Server(self.api, host=self.network.gateway)
        await self.server.__aenter__()
        self.url = str(self.server.url).rstrip("/")
        self._crd_task = asyncio.ensure_future(self._register_crds())

    async def _stop_api(self) -> None:
        self._crd_task.cancel()
        await asyncio.gather(self._crd_task, return_exceptions=True)
        self.api.close_watches()
        await self.server.__aexit__(None, None, None)
        await self.api.__aexit__(None, None, None)

    async def _register_crds(self) -> None:
        """Serve each CustomResourceDefinition's kind once it is created, as the API server does."""
        crds = KINDS["CustomResourceDefinition"].key
        while True:
            for (resource, _, _), obj in list(self.api.objects.items()):
                if str(resource) != crds and getattr(resource, "plural", "") != "customresourcedefinitions":
                    continue
                if obj.deleted:
                    continue
                kind, info = crd_kind(obj.raw)
                if info.key not in {str(k) for k in self.api.resources}:
                    self.api.declare(info.key, kind, info.subresources, info.namespaced)
                KINDS.setdefault(kind, info)
            await asyncio.sleep(0.1)

    def kubeconfig_for(self, namespace: str) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "harness", "cluster": {"server": self.url}}],
            "users": [{"name": "admin", "user": {"token": "harness-admin"}}],
            "contexts": [
                {
                    "name": "harness",
                    "context": {"cluster": "harness", "user": "admin", "namespace": namespace},
                }
            ],
            "current-context": "harness",
        }

    # --- controllers and kubelet ---------------------------------------------------------------------
    def _control_loop(self) -> None:
        while not self._stopping.wait(TICK):
            for step in (self.controllers.step, self.kubelet.step):
                try:
                    step()
                except Exception as error:  # logged and kept: the test shows them if it fails
                    logger.exception("control loop step failed")
                    self.errors.append(repr(error))

    # --- backing services on the node address --------------------------------------------------------
    def spawn(self, argv: list[str], log_name: str, **kwargs: Any) -> subprocess.Popen[bytes]:
        """A host process (not a pod) that is stopped with the cluster."""
        log = (self.root / log_name).open("ab")
        try:
            process = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,  # dies with this process, however it ends
                **kwargs,
            )
        finally:
            log.close()
        self._children.append(process)
        return process

    def _stop_children(self) -> None:
        for process in reversed(self._children):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(5)

    def s3(self, port: int = 9000, names: tuple[str, ...] = ()) -> str:
        """moto's standalone S3 server on the node address; returns its endpoint URL. `names` are the host
        names clients will use (see add_host): moto serves path-style buckets there, as MinIO does."""
        address = self.network.gateway
        custom = ",".join(f"http://{name}:{port}" for name in names)
        env = {**os.environ, "MOTO_S3_CUSTOM_ENDPOINTS": custom} if custom else None
        self.spawn([sys.executable, "-m", "moto.server", "-H", address, "-p", str(port)], "moto.log", env=env)
        endpoint = f"http://{address}:{port}"
        wait_for(lambda: _connects(address, port), timeout=30, what="moto S3 server")
        return endpoint

    def postgres(self, port: int = 5432) -> str:
        """A throwaway Postgres listening on the node address; returns the server URL (database postgres)."""
        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
        bindir = Path(found[-1]).parent if found else Path(shutil.which("initdb") or "initdb").parent
        root = Path(tempfile.mkdtemp(prefix="lpx-cluster-pg-"))
        self.leftovers.path_made(root)
        self._cleanups.append(lambda: shutil.rmtree(root, ignore_errors=True))
        shutil.chown(root, "postgres")
        as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        run: dict[str, Any] = {"check": True, "capture_output": True, "timeout": 60}
        subprocess.run(
            [*as_postgres, str(bindir / "initdb"), "-D", str(root / "data"), "-U", "postgres",
             "--auth=trust", "--no-sync", "-E", "UTF8"],
            **run,
        )  # fmt: skip
        with (root / "data" / "pg_hba.conf").open("a") as hba:  # pods connect from the pod network
            hba.write(f"host all all {self.network.subnet} trust\n")
        options = (
            f"-p {port} -k {root} -c listen_addresses={self.network.gateway} -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
        )
        pg_ctl = [*as_postgres, str(bindir / "pg_ctl"), "-D", str(root / "data")]
        subprocess.run([*pg_ctl, "-o", options, "-l", str(root / "log"), "-w", "-t", "30", "start"], **run)
        postmaster = int((root / "data" / "postmaster.pid").read_text().split()[0])
        self.leftovers.daemon_started(postmaster, str(root))  # pg_ctl detached it: not our child
        self._cleanups.append(
            lambda: subprocess.run([*pg_ctl, "-m", "immediate", "stop"], capture_output=True, timeout=60)
        )
        return f"postgresql://postgres@{self.network.gateway}:{port}/postgres"

    # --- reading the cluster -------------------------------------------------------------------------
    def add_host(self, name: str, address: str) -> None:
        self.network.add_host(name, address)

    def workstation(self) -> str:
        """A network namespace on the pod network that is no pod: where a person runs kubectl and curl.
        It resolves the cluster's names like a pod does; removed with the network."""
        netns, _ = self.network.add_namespace()
        return netns

    def pods(
        self, selector: dict[str, str] | None = None, namespace: str | None = None
    ) -> list[dict[str, Any]]:
        return self.client.list("Pod", namespace, selector)

    def pod_log(self, namespace: str, name: str) -> str:
        return self.kubelet.log(namespace, name)

    def describe(self) -> str:
        """Every pod's phase and readiness with its log's tail: what a failed test prints."""
        lines = []
        for pod in self.pods():
            meta, status = pod["metadata"], pod.get("status") or {}
            lines.append(
                f"--- pod {meta.get('namespace')}/{meta['name']} phase={status.get('phase')} "
                f"ip={status.get('podIP')} statuses={status.get('containerStatuses')}"
            )
            log = self.pod_log(meta.get("namespace", "default"), meta["name"]).splitlines()
            probes = re.compile(
                r'"GET /(health|livez|ready|healthz|metrics)'
            )  # noise of the kubelet's probes
            lines.append("\n".join([line for line in log if not probes.search(line)][-40:]))
        lines.append(f"--- control loop errors: {self.errors[-5:]}")
        return "\n".join(lines)


def _connects(address: str, port: int) -> bool:
    import socket

    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((address, port)) == 0
