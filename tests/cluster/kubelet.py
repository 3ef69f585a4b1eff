"""A kubelet of our own: every Pod the API server holds runs as a local process in its own network namespace.

Per pod, one thread does what a kubelet and a container runtime do for one container:
- a network namespace with its own IP (network.py), /etc/hosts with the cluster's Service names;
- env resolved as Kubernetes does (value with $(VAR) expansion, valueFrom secretKeyRef / configMapKeyRef /
  fieldRef, envFrom with prefix), volumes as directories (emptyDir, secret, configMap, with items) bound at
  their mountPath in the pod's private mount namespace (podinit.py), the service account directory with a
  kubeconfig in it (see `SERVICE_ACCOUNT_DIR`), and the termination log file;
- the container's command and args, as the manifest says; the image's entrypoint is this repository's
  virtualenv (PATH starts with its bin/, so `loraplex`, `kopf`, `uvicorn` are what the image would run);
- startup, readiness and liveness HTTP probes to podIP:port, restarts with back-off under restartPolicy,
  and the pod's status (phase, podIP, Ready, containerStatuses with restartCount and lastState.terminated
  whose message is the termination log, or the log's tail under FallbackToLogsOnError).
Deleting a Pod is graceful, as a kubelet does it (the API server keeps the object meanwhile, apiserver.py):
the container's preStop hook (exec) runs while the pod still serves and its probes still count, then its
process group gets SIGTERM (SIGKILL after the grace period), its namespace goes, and the kubelet lets the
API server remove the object (it drops `KUBELET_FINALIZER`).

What it does not do, so the test does not pretend it does: images (every pod runs this checkout's code),
securityContext (processes run as the test's user), resource limits, and more than one container per pod.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.cluster.apiserver import KUBELET_FINALIZER
from tests.cluster.kube import ApiError, Client, secret_data
from tests.cluster.network import Network

logger = logging.getLogger(__name__)

PODINIT = Path(__file__).with_name("podinit.py")
# Clients in a pod find the API server through this kubeconfig: the harness's stand-in for in-cluster
# config (the emulator speaks plain HTTP, and in-cluster config insists on HTTPS and a CA).
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# Probes are sampled at least this often (a 20 s period would slow the test down); they fail after the
# manifest's own time (period x threshold), see Probe.
MAX_PROBE_PERIOD = 1.0
MAX_GRACE_SECONDS = 10.0
MAX_TERMINATION_MESSAGE = 4096  # Kubernetes' own limit for the termination message


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ConfigError(RuntimeError):
    """The pod cannot start yet (a missing Secret or key): CreateContainerConfigError, retried."""


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: known names are replaced, $$ escapes, unknown references stay."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", replace, text)


def die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass(frozen=True)
class Image:
    """What a container image contributes, as its Dockerfile says: ENTRYPOINT, CMD, ENV and files baked in
    (bound read-only at their path). The code itself is always this checkout's virtualenv."""

    entrypoint: tuple[str, ...] = ("loraplex",)
    cmd: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    files: tuple[tuple[str, str], ...] = ()  # (path in the image, path on this machine)


@dataclass
class Probe:
    """A probe sampled every `interval` seconds (at most MAX_PROBE_PERIOD), failing as the manifest says:
    after failing for failureThreshold of its own periods, so a faster sample never shortens the allowance."""

    kind: str
    spec: dict[str, Any]
    last: float = 0.0
    failing_since: float | None = None

    @property
    def interval(self) -> float:
        return min(self.period, MAX_PROBE_PERIOD)

    @property
    def period(self) -> float:
        return float(self.spec.get("periodSeconds", 10))

    @property
    def allowance(self) -> float:
        return self.period * (int(self.spec.get("failureThreshold", 3)) - 1)

    def record(self, ok: bool, at: float) -> bool:
        """Whether the probe has now failed (past its threshold)."""
        if ok:
            self.failing_since = None
            return False
        if self.failing_since is None:
            self.failing_since = at
        return at - self.failing_since >= self.allowance


@dataclass
class PodRuntime:
    """One pod's process, namespace and files; driven by its own thread (`run`)."""

    kubelet: Kubelet
    namespace: str
    name: str
    uid: str
    stop_requested: threading.Event = field(default_factory=threading.Event)
    process: subprocess.Popen[bytes] | None = None
    netns: str = ""
    ip: str = ""
    restarts: int = 0
    last_terminated: dict[str, Any] | None = None
    ready: bool = False
    started: bool = False
    finished: dict[str, Any] | None = None  # restartPolicy Never/OnFailure: the final termination
    thread: threading.Thread | None = None
    terminating: threading.Thread | None = None  # the graceful deletion under way (`terminate`)
    unsynced: bool = False  # the last status write failed (the API server was slow): written again
    gone: bool = False  # stopped and released: the kubelet forgets it

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def root(self) -> Path:
        return self.kubelet.root / f"{self.namespace}_{self.name}_{self.uid[:8]}"

    # --- lifecycle (thread) ---------------------------------------------------------------------------
    def run(self, pod: dict[str, Any]) -> None:
        client = Client(self.kubelet.client.server)
        try:
            self._run(client, pod)
        except Exception as error:
            logger.exception("pod %s: kubelet thread failed", self.key)
            with contextlib.suppress(Exception):
                self._write_status(client, pod, phase="Failed", message=f"kubelet: {error}")
        finally:
            self._kill()
            if self.netns:
                self.kubelet.network.remove_namespace(self.netns)
            client.close()

    def _run(self, client: Client, pod: dict[str, Any]) -> None:
        containers = pod["spec"].get("containers") or []
        if len(containers) != 1 or pod["spec"].get("initContainers"):
            self._write_status(client, pod, phase="Failed", message="the harness runs exactly one container")
            self.stop_requested.wait()
            return
        container = containers[0]
        self.root.mkdir(parents=True, exist_ok=True)
        self.netns, self.ip = self.kubelet.network.add_namespace()
        self.kubelet.network.write_hosts(self.netns, self.name)
        policy = pod["spec"].get("restartPolicy", "Always")
        backoff = 1.0
        while not self.stop_requested.is_set():
            try:
                launch = self._prepare(client, pod, container)
            except ConfigError as error:
                self._write_status(
                    client, pod, waiting={"reason": "CreateContainerConfigError", "message": str(error)}
                )
                self.stop_requested.wait(1.0)
                continue
            self._start(launch)
            self._write_status(client, pod)
            code = self._supervise(client, pod, container)
            if code is None:  # stopped by deletion
                return
            terminated = self._terminated(code, container)
            if policy == "Never" or (policy == "OnFailure" and code == 0):
                self.finished = terminated
                self._write_status(client, pod)
                self.stop_requested.wait()
                return
            self.last_terminated = terminated
            self.restarts += 1
            self.ready = self.started = False
            self._write_status(
                client, pod, waiting={"reason": "CrashLoopBackOff", "message": f"back-off {backoff:.0f}s"}
            )
            self.stop_requested.wait(backoff)
            backoff = min(backoff * 2, 10.0)

    def _prepare(self, client: Client, pod: dict[str, Any], container: dict[str, Any]) -> dict[str, Any]:
        image = self.kubelet.image(container.get("image", ""))
        env = self.kubelet.base_env(pod)
        env.update(dict(image.env))
        env.update(self._container_env(client, pod, container))
        mounts = self._mounts(client, pod, container)
        mounts += [[host, path, True] for path, host in image.files]
        # Kubernetes' rules: command replaces ENTRYPOINT (and drops CMD); args alone replace CMD.
        command = container.get("command") or list(image.entrypoint)
        args = container.get("args") if container.get("command") or container.get("args") else list(image.cmd)
        argv = [expand(part, env) for part in [*command, *(args or [])]]
        termination = self.root / "termination-log"
        termination.write_text("")
        mounts.append(
            [str(termination), container.get("terminationMessagePath", "/dev/termination-log"), False]
        )
        for source, target, _ in mounts:
            self.kubelet.ensure_mountpoint(target, is_file=Path(source).is_file())
        return {
            "mounts": mounts,
            "env": env,
            "argv": argv,
            "cwd": container.get("workingDir") or str(self.kubelet.workdir),
            # The "image": this checkout and its venv. A real image keeps its code outside any volume, so a
            # volume mounted above them (an emptyDir at /tmp with the checkout under /tmp) must not hide them.
            "image_paths": [str(self.kubelet.workdir), str(Path(sys.prefix))],
            "termination_log": str(termination),
        }

    def _container_env(
        self, client: Client, pod: dict[str, Any], container: dict[str, Any]
    ) -> dict[str, str]:
        env: dict[str, str] = {}
        ns = self.namespace
        for source in container.get("envFrom") or []:
            prefix = source.get("prefix", "")
            if "configMapRef" in source:
                ref = source["configMapRef"]
                data = self._config_map(client, ref["name"], ref.get("optional", False))
            else:
                ref = source["secretRef"]
                data = self._secret(client, ref["name"], ref.get("optional", False))
            env.update({prefix + k: v for k, v in data.items()})
        for item in container.get("env") or []:
            if "valueFrom" not in item:
                env[item["name"]] = expand(str(item.get("value", "")), env)
                continue
            source = item["valueFrom"]
            if "secretKeyRef" in source or "configMapKeyRef" in source:
                is_secret = "secretKeyRef" in source
                ref = source["secretKeyRef" if is_secret else "configMapKeyRef"]
                optional = bool(ref.get("optional", False))
                data = (self._secret if is_secret else self._config_map)(client, ref["name"], optional)
                if ref["key"] not in data:
                    if optional:
                        continue
                    kind = "secret" if is_secret else "configmap"
                    raise ConfigError(f"couldn't find key {ref['key']} in {kind} {ns}/{ref['name']}")
                env[item["name"]] = data[ref["key"]]
            elif "fieldRef" in source:
                env[item["name"]] = self._field(pod, source["fieldRef"]["fieldPath"])
            else:
                raise ConfigError(
                    f"env {item['name']}: only secretKeyRef, configMapKeyRef and fieldRef are supported"
                )
        return env

    def _field(self, pod: dict[str, Any], path: str) -> str:
        meta = pod["metadata"]
        fields = {
            "metadata.name": meta["name"],
            "metadata.namespace": meta.get("namespace", "default"),
            "metadata.uid": meta.get("uid", ""),
            "status.podIP": self.ip,
            "status.hostIP": self.kubelet.network.gateway,
            "spec.nodeName": self.kubelet.node_name,
            "spec.serviceAccountName": pod["spec"].get("serviceAccountName", "default"),
        }
        match = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
        if match:
            return str((meta.get(match.group(1)) or {}).get(match.group(2), ""))
        if path not in fields:
            raise ConfigError(f"fieldRef {path} is not supported by the harness")
        return str(fields[path])

    def _secret(self, client: Client, name: str, optional: bool) -> dict[str, str]:
        secret = client.get("Secret", name, self.namespace)
        if secret is None:
            if optional:
                return {}
            raise ConfigError(f'secret "{name}" not found')
        return secret_data(secret)

    def _config_map(self, client: Client, name: str, optional: bool) -> dict[str, str]:
        config = client.get("ConfigMap", name, self.namespace)
        if config is None:
            if optional:
                return {}
            raise ConfigError(f'configmap "{name}" not found')
        return {k: str(v) for k, v in (config.get("data") or {}).items()}

    def _mounts(self, client: Client, pod: dict[str, Any], container: dict[str, Any]) -> list[list[Any]]:
        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        mounts: list[list[Any]] = []
        for mount in container.get("volumeMounts") or []:
            volume = volumes.get(mount["name"])
            if volume is None:
                raise ConfigError(f"volumeMount {mount['name']}: no such volume")
            source = self._volume_dir(client, volume)
            if mount.get("subPath"):
                source = source / mount["subPath"]
            mounts.append([str(source), mount["mountPath"], bool(mount.get("readOnly", False))])
        automount = pod["spec"].get("automountServiceAccountToken", True)
        if automount:
            mounts.append([str(self._service_account_dir(pod)), SERVICE_ACCOUNT_DIR, True])
        return mounts

    def _volume_dir(self, client: Client, volume: dict[str, Any]) -> Path:
        path = self.root / "volumes" / volume["name"]
        if "emptyDir" in volume:
            path.mkdir(parents=True, exist_ok=True)  # kept across container restarts, as emptyDir is
            return path
        if "secret" in volume or "configMap" in volume:
            if "secret" in volume:
                ref = volume["secret"]
                data = self._secret(client, ref["secretName"], ref.get("optional", False))
            else:
                ref = volume["configMap"]
                data = self._config_map(client, ref["name"], ref.get("optional", False))
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
            items = ref.get("items") or [{"key": k, "path": k} for k in data]
            for item in items:
                if item["key"] not in data:
                    raise ConfigError(f"volume {volume['name']}: no key {item['key']}")
                target = path / item["path"]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(data[item["key"]])
            return path
        raise ConfigError(
            f"volume {volume['name']}: only emptyDir, secret and configMap volumes are supported"
        )

    def _service_account_dir(self, pod: dict[str, Any]) -> Path:
        path = self.root / "serviceaccount"
        path.mkdir(parents=True, exist_ok=True)
        (path / "namespace").write_text(self.namespace)
        (path / "token").write_text(f"harness-token-{pod['spec'].get('serviceAccountName', 'default')}")
        (path / "kubeconfig").write_text(json.dumps(self.kubelet.kubeconfig(self.namespace)))
        return path

    def _start(self, launch: dict[str, Any]) -> None:
        spec_path = self.root / "launch.json"
        spec_path.write_text(json.dumps(launch))
        log = (self.root / "log").open("ab")
        try:
            self.process = subprocess.Popen(
                ["ip", "netns", "exec", self.netns, sys.executable, str(PODINIT), str(spec_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: deletion signals every process of the pod
                preexec_fn=die_with_parent,
            )
        finally:
            log.close()
        self.started_at = now()

    def _supervise(self, client: Client, pod: dict[str, Any], container: dict[str, Any]) -> int | None:
        """Probe until the process exits (its code) or the pod is deleted (None)."""
        assert self.process is not None
        probes = {
            kind: Probe(kind, container[f"{kind}Probe"])
            for kind in ("startup", "readiness", "liveness")
            if container.get(f"{kind}Probe")
        }
        self.started = "startup" not in probes
        self.ready = "readiness" not in probes and self.started
        if self.ready:
            self._write_status(client, pod)
        ports = {p.get("name"): p["containerPort"] for p in container.get("ports") or []}
        while not self.stop_requested.wait(0.2):
            code = self.process.poll()
            if code is not None:
                return code
            changed = False
            for probe in probes.values():
                if probe.kind != "startup" and not self.started:
                    continue
                if probe.kind == "startup" and self.started:
                    continue
                if time.monotonic() - probe.last < probe.interval:
                    continue
                probe.last = time.monotonic()
                ok = self._probe(probe.spec, ports)
                failed = probe.record(ok, probe.last)
                if probe.kind == "startup":
                    if ok:
                        self.started = changed = True
                        self.ready = "readiness" not in probes
                    elif failed:
                        logger.warning("pod %s: startup probe failed, restarting", self.key)
                        self._kill()
                elif probe.kind == "readiness":
                    want = ok or (self.ready and not failed)
                    changed |= want != self.ready
                    self.ready = want
                elif probe.kind == "liveness" and failed:
                    logger.warning("pod %s: liveness probe failed, restarting", self.key)
                    self._kill()
            if changed or self.unsynced:
                self._write_status(client, pod)
        return None

    def _probe(self, spec: dict[str, Any], ports: dict[str | None, int]) -> bool:
        action = spec.get("httpGet")
        if action is None:
            return True  # exec/tcpSocket probes are not used by our manifests; count them as passing
        port = action["port"]
        port = ports.get(port, port) if isinstance(port, str) else port
        url = f"http://{self.ip}:{port}{action.get('path', '/')}"
        try:
            response = httpx.get(url, timeout=float(spec.get("timeoutSeconds", 1)))
        except httpx.HTTPError:
            return False
        return 200 <= response.status_code < 400

    def _terminated(self, code: int, container: dict[str, Any]) -> dict[str, Any]:
        message = (self.root / "termination-log").read_text(errors="replace")[-MAX_TERMINATION_MESSAGE:]
        policy = container.get("terminationMessagePolicy", "File")
        if not message.strip() and policy == "FallbackToLogsOnError" and code != 0:
            message = self.log_tail(MAX_TERMINATION_MESSAGE)
        return {
            "exitCode": code if code >= 0 else 128 - code,
            "reason": "Completed" if code == 0 else "Error",
            "message": message,
            "startedAt": getattr(self, "started_at", now()),
            "finishedAt": now(),
        }

    def log_tail(self, size: int = 4000) -> str:
        path = self.root / "log"
        if not path.exists():
            return ""
        with path.open("rb") as handle:
            handle.seek(max(0, path.stat().st_size - size))
            return handle.read().decode(errors="replace")

    def _kill(self) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(self.kubelet.grace_seconds)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        # Children that left the group (none of ours do) would be caught by PDEATHSIG of their parent.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)

    def _write_status(
        self,
        client: Client,
        pod: dict[str, Any],
        phase: str | None = None,
        message: str = "",
        waiting: dict[str, Any] | None = None,
    ) -> None:
        if self.stop_requested.is_set():
            return
        container = (pod["spec"].get("containers") or [{}])[0]
        state: dict[str, Any]
        if self.finished is not None:
            state = {"terminated": self.finished}
            phase = phase or ("Succeeded" if self.finished["exitCode"] == 0 else "Failed")
        elif waiting is not None or self.process is None:
            state = {"waiting": waiting or {"reason": "ContainerCreating"}}
            phase = phase or ("Running" if self.restarts else "Pending")
        else:
            state = {"running": {"startedAt": getattr(self, "started_at", now())}}
            phase = phase or "Running"
        ready = self.ready and self.finished is None and waiting is None
        status: dict[str, Any] = {
            "phase": phase,
            "hostIP": self.kubelet.network.gateway,
            "podIP": self.ip or None,
            "podIPs": [{"ip": self.ip}] if self.ip else [],
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Initialized", "status": "True"},
                {"type": "ContainersReady", "status": str(ready)},
                {"type": "Ready", "status": str(ready), "lastTransitionTime": now()},
            ],
            "containerStatuses": [
                {
                    "name": container.get("name", ""),
                    "image": container.get("image", ""),
                    "ready": ready,
                    "started": self.started,
                    "restartCount": self.restarts,
                    "state": state,
                    "lastState": {"terminated": self.last_terminated} if self.last_terminated else {},
                }
            ],
        }
        if message:
            status["message"] = message
        try:
            client.patch("Pod", self.name, {"status": status}, self.namespace, sub="status")
            self.unsynced = False
        except ApiError:  # deleted meanwhile: the kubelet loop stops this thread
            pass
        except httpx.HTTPError as error:  # a slow API server must not kill the pod: the next tick retries
            logger.warning("pod %s: status not written (%s), retrying", self.key, error)
            self.unsynced = True

    def stop(self) -> None:
        self.stop_requested.set()

    def terminate(self, pod: dict[str, Any]) -> None:
        """Begin the pod's graceful deletion in a thread of its own (the pod thread keeps probing)."""
        self.terminating = threading.Thread(
            target=self._terminate, args=(pod,), name=f"terminate-{self.key}", daemon=True
        )
        self.terminating.start()

    def _terminate(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        grace = float(
            meta.get("deletionGracePeriodSeconds") or pod["spec"].get("terminationGracePeriodSeconds") or 30
        )
        container = (pod["spec"].get("containers") or [{}])[0]
        hook = ((container.get("lifecycle") or {}).get("preStop") or {}).get("exec") or {}
        process = self.process
        if hook.get("command") and self.netns and process is not None and process.poll() is None:
            started = time.monotonic()
            try:
                subprocess.run(
                    ["ip", "netns", "exec", self.netns, *hook["command"]],
                    env=self.kubelet.base_env(pod),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    timeout=grace,
                    check=False,
                )
            except subprocess.TimeoutExpired:
                logger.warning("pod %s: preStop hook outlived the grace period (%.0f s)", self.key, grace)
            logger.info("pod %s: preStop hook took %.1f s", self.key, time.monotonic() - started)
        self.stop()  # the pod thread sends SIGTERM, waits, kills and removes the namespace
        if self.thread is not None:
            self.thread.join(timeout=self.kubelet.grace_seconds + 15)
        self.release(Client(self.kubelet.client.server), pod)
        self.gone = True

    def release(self, client: Client, pod: dict[str, Any]) -> None:
        """Drop the kubelet's finalizer: the API server removes the deleted pod's object."""
        finalizers = [f for f in pod["metadata"].get("finalizers") or [] if f != KUBELET_FINALIZER]
        with contextlib.suppress(ApiError):  # already gone (a forced delete)
            client.patch("Pod", self.name, {"metadata": {"finalizers": finalizers}}, self.namespace)
        client.close()


class Kubelet:
    """Runs every Pod of the API server (one node); `step()` starts new pods and stops deleted ones."""

    def __init__(
        self,
        client: Client,
        network: Network,
        root: Path,
        api_server: str,
        venv_bin: Path,
        workdir: Path,
        image_env: dict[str, str] | None = None,
        images: dict[str, Image] | None = None,
    ) -> None:
        self.client = client
        self.network = network
        self.root = root
        self.api_server = api_server
        self.venv_bin = venv_bin
        self.workdir = workdir
        self.image_env = image_env or {}
        self.images = images or {}
        self.node_name = "harness-node"
        self.grace_seconds = MAX_GRACE_SECONDS
        self.pods: dict[str, PodRuntime] = {}
        self._created_mountpoints: list[Path] = []
        self.on_path_made: Callable[[Path], None] = lambda path: None  # the harness records it (leftovers)
        self._mountpoint_lock = threading.Lock()

    def kubeconfig(self, namespace: str) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "harness", "cluster": {"server": self.api_server}}],
            "users": [{"name": "pod", "user": {"token": "harness-token"}}],
            "contexts": [
                {"name": "pod", "context": {"cluster": "harness", "user": "pod", "namespace": namespace}}
            ],
            "current-context": "pod",
        }

    def base_env(self, pod: dict[str, Any]) -> dict[str, str]:
        """What a container has before its manifest's env: the image's env and the kubelet's."""
        path = f"{self.venv_bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        home = self.root / f"{pod['metadata'].get('namespace', 'default')}_{pod['metadata']['name']}_home"
        home.mkdir(parents=True, exist_ok=True)
        env = {
            "PATH": path,
            "HOME": str(home),
            "HOSTNAME": pod["metadata"]["name"],
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            "VIRTUAL_ENV": str(self.venv_bin.parent),
            **self.image_env,
        }
        if pod["spec"].get("automountServiceAccountToken", True):
            env["KUBECONFIG"] = f"{SERVICE_ACCOUNT_DIR}/kubeconfig"
        return env

    def image(self, reference: str) -> Image:
        """The image by repository (tag and digest ignored: every image runs this checkout)."""
        repository = reference.split("@", 1)[0]
        if ":" in repository.rsplit("/", 1)[-1]:
            repository = repository.rsplit(":", 1)[0]
        return self.images.get(repository, Image())

    def ensure_mountpoint(self, target: str, is_file: bool = False) -> None:
        """Create a missing mount point on the host (a bind mount needs one); removed again at teardown."""
        path = Path(target)
        if path.parts[1:2] == ("dev",):
            return  # every pod has a private /dev (podinit.py): made there, never on the host
        with self._mountpoint_lock:
            if path.exists():
                return
            missing = [p for p in [path, *path.parents] if not p.exists()]
            if is_file:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch()
            else:
                path.mkdir(parents=True)
            self._created_mountpoints.extend(missing)
            for made in missing:
                self.on_path_made(made)

    def step(self) -> None:
        pods = self.client.list("Pod")
        live = {}
        for pod in pods:
            meta = pod["metadata"]
            key = f"{meta.get('namespace', 'default')}/{meta['name']}"
            if meta.get("deletionTimestamp"):
                self._delete(key, pod, live)
                continue
            live[key] = meta.get("uid", "")
            runtime = self.pods.get(key)
            if runtime is not None and runtime.uid == live[key]:
                continue
            if runtime is not None:  # same name, new pod (a StatefulSet-like recreate)
                self._stop(key)
            runtime = PodRuntime(self, meta.get("namespace", "default"), meta["name"], meta.get("uid", ""))
            runtime.thread = threading.Thread(target=runtime.run, args=(pod,), name=f"pod-{key}", daemon=True)
            self.pods[key] = runtime
            runtime.thread.start()
        for key in [k for k, runtime in self.pods.items() if live.get(k) != runtime.uid]:
            self._stop(key)

    def _delete(self, key: str, pod: dict[str, Any], live: dict[str, str]) -> None:
        """A pod being deleted: terminate it gracefully once; it stays ours until its thread is done."""
        meta = pod["metadata"]
        runtime = self.pods.get(key)
        if runtime is None or runtime.uid != meta.get("uid"):
            if KUBELET_FINALIZER in (meta.get("finalizers") or []):  # never ran here: nothing to stop
                PodRuntime(self, meta.get("namespace", "default"), meta["name"], meta.get("uid", "")).release(
                    Client(self.client.server), pod
                )
            return
        if runtime.gone:
            self.pods.pop(key)
            return
        live[key] = runtime.uid
        if runtime.terminating is None:
            runtime.terminate(pod)

    def _stop(self, key: str) -> None:
        runtime = self.pods.pop(key)
        runtime.stop()  # the pod's thread kills its process and removes its namespace

    def shutdown(self) -> None:
        """Stop every pod and wait for its thread; remove the mount points this kubelet created."""
        for key in list(self.pods):
            runtime = self.pods[key]
            self._stop(key)
            if runtime.thread is not None:
                runtime.thread.join(timeout=self.grace_seconds + 15)
        for path in sorted(set(self._created_mountpoints), key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                path.unlink() if path.is_file() else path.rmdir()

    def log(self, namespace: str, name: str) -> str:
        runtime = self.pods.get(f"{namespace}/{name}")
        return runtime.log_tail(20000) if runtime else ""
