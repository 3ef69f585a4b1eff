"""Replica discovery: the ready engine pods of each InferenceDeployment, followed from the Kubernetes API.

A deployment row whose endpoints are `["kubernetes://<namespace>/<name>"]` is served by the Pods labelled
`app.kubernetes.io/name=loraplex-engine,app.kubernetes.io/instance=<name>` in that namespace. Each such
target gets one `PodWatch` thread (the official client is synchronous): one LIST, then a WATCH from the
LIST's resourceVersion, continued from the last version seen when the server ends the stream; a 410 Gone
or a broken stream re-LISTs, after a backoff when it failed. While the API server is unreachable the last
known pods are kept: the gateway still falls over a refused connection, so stale beats empty.

Only the InferenceDeployment's own pods count: a pod whose owner chain (ReplicaSet, Deployment
`<name>-engine`, the InferenceDeployment) does not check out is listed as not ready, with the reason
(pod_owners.py), whatever its labels say.

Static `http://` endpoints (`loraplex up`) pass through unchanged. Nothing runs at import; the app's
lifespan starts and stops the threads.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from .pod_owners import EngineOwners, OwnersUnknown

if TYPE_CHECKING:
    from kubernetes.client import CoreV1Api

log = logging.getLogger("loraplex.web.discovery")

SCHEME = "kubernetes://"
ENGINE_PORT = 8000
ENGINE_LABEL = "app.kubernetes.io/name=loraplex-engine"
DiscoveryMode = Literal["auto", "on", "off"]

# DNS-1123 labels: what Kubernetes accepts as a namespace, and (63 characters at most) as a label value,
# which the InferenceDeployment's name becomes on its pods. Anchored, no nested quantifiers: linear time.
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
_TARGET = re.compile(rf"kubernetes://(?P<namespace>{_DNS_LABEL})/(?P<name>{_DNS_LABEL})")
MAX_WATCH_LINE = 4 * 1024 * 1024  # one pod's JSON is a few KiB; more is not a pod


class KubernetesUnavailable(RuntimeError):
    """Discovery was asked for (LORAPLEX_KUBERNETES_DISCOVERY=on) but no cluster configuration is found."""


@dataclass(frozen=True)
class DeploymentTarget:
    namespace: str
    name: str

    @property
    def uri(self) -> str:
        return f"{SCHEME}{self.namespace}/{self.name}"

    @property
    def selector(self) -> str:
        return f"{ENGINE_LABEL},app.kubernetes.io/instance={self.name}"


def is_kubernetes_uri(endpoint: str) -> bool:
    return endpoint.startswith(SCHEME)


def parse_target(endpoint: str) -> DeploymentTarget:
    """`kubernetes://<namespace>/<inferencedeployment>` as a target; ValueError saying what is wrong."""
    if len(endpoint) > len(SCHEME) + 127:
        raise ValueError("a kubernetes:// endpoint is at most kubernetes:// + 63 + / + 63 characters")
    match = _TARGET.fullmatch(endpoint)
    if match is None:
        raise ValueError(
            f"{endpoint[:160]!r} is not kubernetes://<namespace>/<inferencedeployment name> "
            "(lowercase letters, digits and '-', 63 characters at most each, no trailing slash)"
        )
    return DeploymentTarget(match["namespace"], match["name"])


@dataclass(frozen=True)
class PodReplica:
    """One engine pod as the gateway sees it: routable when `ready`, else `detail` says why not."""

    pod: str
    endpoint: str | None
    ready: bool
    detail: str
    # Being deleted but still serving (its preStop hands its adapters over before SIGTERM): no new
    # placements, but requests for the adapters it holds may still go there until their new pods are warm.
    leaving: bool = False


def replica_of(pod: dict[str, Any]) -> PodReplica:
    """Ready = the Ready condition is True, the pod has an IP, and it is not being deleted."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    ip = status.get("podIP")
    endpoint = f"http://{_host(ip)}:{_engine_port(pod)}" if isinstance(ip, str) and ip else None
    conditions = status.get("conditions") or []
    ready_condition = next((c for c in conditions if isinstance(c, dict) and c.get("type") == "Ready"), None)
    name = str(meta.get("name") or "?")
    if meta.get("deletionTimestamp"):
        serving = ready_condition is not None and ready_condition.get("status") == "True"
        return PodReplica(name, endpoint, False, "terminating", leaving=serving and endpoint is not None)
    if ready_condition is None or ready_condition.get("status") != "True":
        reason = (ready_condition or {}).get("reason") or status.get("phase") or "starting"
        return PodReplica(name, endpoint, False, f"not ready ({reason})")
    if endpoint is None:
        return PodReplica(name, None, False, "no pod IP yet")
    return PodReplica(name, endpoint, True, "ready")


def _engine_port(pod: dict[str, Any]) -> int:
    """The container port named "http" (what the operator declares, as its autoscaler reads), else 8000."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in (container.get("ports") or []) if isinstance(container, dict) else []:
            if isinstance(port, dict) and port.get("name") == "http":
                number = port.get("containerPort")
                if isinstance(number, int) and 0 < number < 65536:
                    return number
    return ENGINE_PORT


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip  # an IPv6 pod IP goes in brackets in a URL


class WatchGone(Exception):
    """The API server no longer has the events after our resourceVersion (410): LIST again."""


class PodWatch:
    """Follows one target's pods in a thread: LIST, then WATCH, keeping `pods` current."""

    def __init__(
        self,
        api: CoreV1Api,
        target: DeploymentTarget,
        watch_timeout_s: float,
        backoff_s: tuple[float, float] = (0.5, 30.0),
    ):
        from kubernetes.client import AppsV1Api

        self.api = api
        self.target = target
        self.owners = EngineOwners(AppsV1Api(api.api_client), target.namespace, target.name)
        self.watch_timeout_s = watch_timeout_s
        self.backoff_min_s, self.backoff_max_s = backoff_s
        self.synced = threading.Event()  # set after the first successful LIST
        self.lists = 0  # LISTs done (tests and logs read it)
        self.last_error: str | None = None
        self._pods: dict[str, PodReplica] = {}
        # Each pod's latest object, and how often its owners could not be checked in a row: a check the
        # API server could not answer is asked again (a Ready pod may send no further event).
        self._seen: dict[str, dict[str, Any]] = {}
        self._rechecks: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._response: Any = None
        self._thread = threading.Thread(target=self._run, name=f"discovery-{target.uri}", daemon=True)

    # --- what the gateway reads ---------------------------------------------------------------------
    def replicas(self) -> list[PodReplica]:
        with self._lock:
            return sorted(self._pods.values(), key=lambda r: r.pod)

    def ready_endpoints(self) -> list[str]:
        return sorted({r.endpoint for r in self.replicas() if r.ready and r.endpoint})

    # --- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def request_stop(self) -> None:
        """Ask the thread to end, unblocking a read in progress (urllib3's shutdown is thread-safe)."""
        self._stop.set()
        response = self._response
        if response is not None:
            with contextlib.suppress(Exception):  # already closed: nothing to unblock
                response.shutdown()

    def stop(self, timeout: float = 5.0) -> None:
        self.request_stop()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # --- the loop ------------------------------------------------------------------------------------
    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                version = self._list()
                failures = 0
                while not self._stop.is_set():
                    version = self._watch(version)  # a clean end of stream: go on from where it was
            except WatchGone:
                log.info("watch of %s expired (410 Gone); listing again", self.target.uri)
            except Exception as exc:  # the API server is down, refuses us, or the stream broke
                if self._stop.is_set():
                    break
                failures += 1
                self.last_error = f"{type(exc).__name__}: {exc}"[:300]
                delay = min(self.backoff_max_s, self.backoff_min_s * 2 ** min(failures - 1, 16))
                delay *= random.uniform(0.8, 1.2)  # many control planes must not retry in step
                log.warning(
                    "discovery of %s failed (%s); retrying in %.1f s", self.target.uri, self.last_error, delay
                )
                self._stop.wait(delay)

    def _list(self) -> str:
        # Raw JSON (_preload_content=False: urllib3's response), as the watch reads it too.
        response: Any = self.api.list_namespaced_pod(
            self.target.namespace,
            label_selector=self.target.selector,
            _preload_content=False,
            _request_timeout=(5.0, 30.0),
        )
        body = json.loads(response.data)
        items = body.get("items") or []
        with self._lock:
            self._seen = {_name_of(item): item for item in items}
        pods = {}
        for item in items:
            replica = self._replica(item)
            pods[replica.pod] = replica
        with self._lock:
            changed = pods != self._pods
            self._pods = pods
        self.lists += 1
        self.last_error = None
        self.synced.set()
        if changed:
            log.info("%s: %d ready of %d pods", self.target.uri, len(self.ready_endpoints()), len(pods))
        return str((body.get("metadata") or {}).get("resourceVersion") or "")

    def _watch(self, version: str) -> str:
        """Apply events from `version` on until the server ends the stream; the last version seen."""
        try:
            self._response = self.api.list_namespaced_pod(
                self.target.namespace,
                label_selector=self.target.selector,
                watch=True,
                resource_version=version,
                allow_watch_bookmarks=True,
                timeout_seconds=max(1, int(self.watch_timeout_s)),
                _preload_content=False,
                # No bytes for this long (past the server's own timeout) means the stream is dead.
                _request_timeout=(5.0, self.watch_timeout_s + 30.0),
            )
        except Exception as exc:
            if getattr(exc, "status", None) == 410:  # some servers refuse an old version outright
                raise WatchGone() from exc
            raise
        try:
            # A stop asked while the WATCH was being opened found no response to shut down: it is seen
            # here (request_stop sets the flag before it looks for the response), not a timeout later.
            if self._stop.is_set():
                return version
            for line in _lines(self._response):
                version = self._apply(json.loads(line)) or version
                if self._stop.is_set():
                    break
        finally:
            response, self._response = self._response, None
            with contextlib.suppress(Exception):
                response.release_conn()
        return version

    def _replica(self, pod: dict[str, Any]) -> PodReplica:
        replica = replica_of(pod)
        if replica.endpoint is None:
            return replica  # no address to send anything to: the owners are checked once it has one
        try:
            problem = self.owners.problem(pod)
        except OwnersUnknown as exc:
            problem = f"its owners cannot be checked now ({exc}); asked again shortly"
            self._recheck_later(replica.pod)
        else:
            with self._lock:
                self._rechecks.pop(replica.pod, None)
            if problem is not None:
                log.warning("%s: pod %s is refused: %s", self.target.uri, replica.pod, problem)
        return _owned(replica, problem)

    def _recheck_later(self, name: str) -> None:
        with self._lock:
            tries = self._rechecks[name] = self._rechecks.get(name, 0) + 1
        delay = min(self.backoff_max_s, self.backoff_min_s * 2 ** min(tries - 1, 16))
        timer = threading.Timer(delay, self._recheck, (name,))
        timer.daemon = True
        timer.start()

    def _recheck(self, name: str) -> None:
        """Check the pod's owners again; its entry changes only if no newer event came meanwhile."""
        with self._lock:
            pod = self._seen.get(name)
            listed = name in self._pods
        if pod is None or self._stop.is_set():
            return
        if not listed:  # the LIST or event that asked for this has not stored its result yet
            self._recheck_later(name)
            return
        replica = self._replica(pod)
        with self._lock:
            current = self._pods.get(name) if self._seen.get(name) is pod else None
            if current is not None:
                self._pods[name] = replica
        if current is not None and replica.ready and not current.ready:
            log.info("%s: pod %s ready (its owners checked on a retry)", self.target.uri, name)

    def _apply(self, event: dict[str, Any]) -> str | None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise WatchGone()
            raise RuntimeError(f"watch error {obj.get('code')}: {obj.get('message')}")
        version = (obj.get("metadata") or {}).get("resourceVersion")
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            with self._lock:
                if kind == "DELETED":
                    self._seen.pop(_name_of(obj), None)
                else:
                    self._seen[_name_of(obj)] = obj
            replica = replica_of(obj) if kind == "DELETED" else self._replica(obj)
            with self._lock:
                before = self._pods.get(replica.pod)
                if kind == "DELETED":
                    self._pods.pop(replica.pod, None)
                else:
                    self._pods[replica.pod] = replica
            if before is None or kind == "DELETED" or before.ready != replica.ready:
                log.info("%s: pod %s %s (%s)", self.target.uri, replica.pod, kind.lower(), replica.detail)
        return str(version) if version else None


def _name_of(pod: dict[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("name") or "?")  # as replica_of names it


def _owned(replica: PodReplica, problem: str | None) -> PodReplica:
    """`replica`, unless its owners do not check out: then never ready, and the admin reads why."""
    if problem is None:
        return replica
    return PodReplica(replica.pod, replica.endpoint, False, f"not this InferenceDeployment's pod: {problem}")


def _lines(response: Any) -> Iterator[bytes]:
    """The newline-delimited JSON of a watch stream, each line bounded."""
    pending = b""
    for chunk in response.stream(64 * 1024, decode_content=True):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line.strip():
                yield line
        if len(pending) > MAX_WATCH_LINE:
            raise RuntimeError(f"a watch event longer than {MAX_WATCH_LINE} bytes")
    if pending.strip():
        yield pending


def cluster_configured() -> bool:
    """Is there a cluster to ask: in a pod (service account), or a kubeconfig file?"""
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return True
    kubeconfig = os.environ.get("KUBECONFIG", "")
    paths = [Path(p).expanduser() for p in kubeconfig.split(os.pathsep) if p] or [Path("~/.kube/config")]
    return any(p.expanduser().is_file() for p in paths)


def core_api() -> CoreV1Api:
    """A CoreV1Api from KUBECONFIG (or ~/.kube/config) when set, else the pod's service account."""
    from kubernetes import client, config

    configuration = client.Configuration()
    kubeconfig = os.environ.get("KUBECONFIG")
    if kubeconfig or not os.environ.get("KUBERNETES_SERVICE_HOST"):
        # Named explicitly: the client reads KUBECONFIG once, when it is imported.
        config.load_kube_config(config_file=kubeconfig or None, client_configuration=configuration)
    else:
        config.load_incluster_config(client_configuration=configuration)
    configuration.retries = 0  # our loop retries, with backoff; urllib3's own retries only delay that
    return client.CoreV1Api(client.ApiClient(configuration))


class Discovery:
    """Every followed target's pods, and the expansion of a deployment's endpoints into ready replicas."""

    def __init__(
        self,
        mode: DiscoveryMode = "auto",
        watch_timeout_s: float = 300.0,
        make_api: Callable[[], CoreV1Api] = core_api,
        backoff_s: tuple[float, float] = (0.5, 30.0),
    ):
        self.mode = mode
        self.watch_timeout_s = watch_timeout_s
        self.backoff_s = backoff_s
        self._make_api = make_api
        self._api: CoreV1Api | None = None
        self._watches: dict[DeploymentTarget, PodWatch] = {}
        self._lock = threading.Lock()
        self._running = False
        self.enabled = False

    def start(self, endpoints: Iterable[str] = ()) -> None:
        """Decide whether to discover (mode, cluster config) and follow the targets among `endpoints`."""
        if self.mode == "off":
            log.info("kubernetes discovery is off: kubernetes:// deployments have no replicas")
            return
        if self.mode == "auto" and not cluster_configured():
            log.info("no Kubernetes configuration found: kubernetes discovery stays off")
            return
        try:
            self._api = self._make_api()
        except Exception as exc:
            if self.mode == "on":
                raise KubernetesUnavailable(
                    "LORAPLEX_KUBERNETES_DISCOVERY=on but the Kubernetes configuration cannot be "
                    f"loaded: {exc}"
                ) from exc
            log.warning("kubernetes discovery stays off: %s", exc)
            return
        self.enabled = self._running = True
        for endpoint in endpoints:
            if is_kubernetes_uri(endpoint):
                try:
                    self.follow(parse_target(endpoint))
                except ValueError as exc:  # a row written before validation existed
                    log.warning("ignoring deployment endpoint: %s", exc)

    def stop(self) -> None:
        with self._lock:
            self._running = False
            watches, self._watches = list(self._watches.values()), {}
        for watch in watches:  # all asked at once, then each awaited: shutdown takes one wait, not N
            watch.request_stop()
        for watch in watches:
            watch.stop()

    def follow(self, target: DeploymentTarget) -> PodWatch | None:
        """The watch of `target`, started on first use; None while discovery is off."""
        with self._lock:
            if not self._running or self._api is None:
                return None
            watch = self._watches.get(target)
            if watch is None:
                watch = PodWatch(self._api, target, self.watch_timeout_s, self.backoff_s)
                self._watches[target] = watch
                watch.start()
            return watch

    def replicas(self, endpoint: str) -> list[PodReplica] | None:
        """The pods behind a kubernetes:// endpoint; None when discovery is off or it is malformed."""
        try:
            watch = self.follow(parse_target(endpoint))
        except ValueError:
            return None
        return watch.replicas() if watch is not None else None

    def state(self, endpoint: str) -> str:
        """One line for an admin: how the pods behind `endpoint` are followed, or why they are not."""
        if not self.enabled:
            return "kubernetes discovery is off (LORAPLEX_KUBERNETES_DISCOVERY)"
        try:
            watch = self.follow(parse_target(endpoint))
        except ValueError as exc:
            return str(exc)
        if watch is None:
            return "kubernetes discovery is stopped"
        pods = watch.replicas()
        ready = sum(1 for r in pods if r.ready)
        if not watch.synced.is_set():
            return f"listing pods ({watch.last_error})" if watch.last_error else "listing pods"
        text = f"{ready} ready of {len(pods)} pods"
        if watch.last_error:
            return f"{text}; the API server is failing, so this may be stale: {watch.last_error}"
        return text

    def leaving(self, endpoints: list[str]) -> list[str]:
        """The URLs of pods behind kubernetes:// endpoints that are being deleted but still serve."""
        out = [
            replica.endpoint
            for endpoint in endpoints
            if is_kubernetes_uri(endpoint)
            for replica in self.replicas(endpoint) or []
            if replica.leaving and replica.endpoint
        ]
        return list(dict.fromkeys(out))

    def expand(self, endpoints: list[str]) -> list[str]:
        """Static endpoints as they are, each kubernetes:// one as its ready pods' URLs (deduplicated)."""
        out: list[str] = []
        for endpoint in endpoints:
            if not is_kubernetes_uri(endpoint):
                out.append(endpoint)
                continue
            for replica in self.replicas(endpoint) or []:
                if replica.ready and replica.endpoint:
                    out.append(replica.endpoint)
        return list(dict.fromkeys(out))
