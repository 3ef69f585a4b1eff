"""The harness itself, with plain `python -m http.server` pods: each in its own network namespace on :8000,
env and volumes resolved as Kubernetes does, Services proxied and named, Jobs run, crashes reported, and
nothing left behind after a stop."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.cluster import leftovers
from tests.cluster.harness import ClusterInABox, wait_for
from tests.cluster.kubelet import expand
from tests.cluster.network import ETC_NETNS, Network

pytestmark = pytest.mark.timeout(120)
NS = "default"


def server_deployment(name: str, replicas: int = 2, script: str = "", **container: Any) -> dict[str, Any]:
    """`replicas` pods that run `script` and then serve /srv (an emptyDir) on :8000."""
    command = f"{script}\nexec python -m http.server 8000 --directory /srv"
    spec = {
        "name": "server",
        "image": "python:3.11",
        "command": ["sh", "-c", command],
        "ports": [{"name": "http", "containerPort": 8000}],
        "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
        "volumeMounts": [{"name": "srv", "mountPath": "/srv"}],
        **container,
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [spec], "volumes": [{"name": "srv", "emptyDir": {}}]},
            },
        },
    }


def service(name: str, port: int = 80) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"selector": {"app": name}, "ports": [{"port": port, "targetPort": "http"}]},
    }


def netns_list() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


def ready_pods(cluster: ClusterInABox, app: str, count: int) -> list[dict[str, Any]]:
    def check() -> list[dict[str, Any]] | None:
        pods = cluster.pods({"app": app})
        statuses = [(p.get("status") or {}).get("containerStatuses") or [{}] for p in pods]
        return pods if len(pods) == count and all(s[0].get("ready") for s in statuses) else None

    try:
        return wait_for(check, timeout=40, what=f"{count} ready {app} pods")
    except AssertionError:
        print(cluster.describe())
        raise


def test_every_pod_listens_on_8000_in_its_own_namespace_behind_a_service(cluster: ClusterInABox) -> None:
    cluster.client.create(server_deployment("hello", script="echo $HOSTNAME > /srv/name"))
    cluster.client.create(service("hello"))
    pods = ready_pods(cluster, "hello", 2)
    addresses = {p["status"]["podIP"] for p in pods}
    assert len(addresses) == 2
    for pod in pods:  # both on :8000, each answering with its own name
        reply = httpx.get(f"http://{pod['status']['podIP']}:8000/name", timeout=5)
        assert reply.text.strip() == pod["metadata"]["name"]
        assert pod["metadata"]["labels"]["pod-template-hash"] in pod["metadata"]["name"]
    address = wait_for(lambda: (cluster.client.get("Service", "hello") or {})["spec"].get("clusterIP"))
    expected = {p["metadata"]["name"] for p in pods}

    def names_through_service() -> set[str] | None:  # the proxy follows endpoints within a tick
        try:
            names = {httpx.get(f"http://{address}/name", timeout=5).text.strip() for _ in range(6)}
        except httpx.HTTPError:
            return None
        return names if names == expected else None

    names = wait_for(names_through_service, timeout=10, what="both pods behind the Service")
    # Inside a pod the Service resolves by its DNS names (the pod's own hosts file).
    netns = next(r.netns for r in cluster.kubelet.pods.values() if r.name == pods[0]["metadata"]["name"])
    hosts = (ETC_NETNS / netns / "hosts").read_text()
    assert f"{address} hello.default.svc.cluster.local" in hosts
    fetched = subprocess.run(
        ["ip", "netns", "exec", netns, "python3", "-c",
         "import urllib.request; print(urllib.request.urlopen('http://hello.default.svc/name').read().decode())"],
        capture_output=True, text=True, timeout=20, check=True,
    )  # fmt: skip
    assert fetched.stdout.strip() in names


def test_env_and_volumes_resolve_like_kubernetes(cluster: ClusterInABox) -> None:
    cluster.client.create(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "creds", "namespace": NS},
            "data": {"password": base64.b64encode(b"s3cret").decode()},
            "stringData": {"user": "alice"},
        }
    )
    cluster.client.create(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "settings", "namespace": NS},
         "data": {"MODE": "fast", "greeting.txt": "hi"}}
    )  # fmt: skip
    env = [
        {"name": "USER_NAME", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "user"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "URL", "value": "http://$(POD_IP):8000/$(MODE)"},
    ]
    script = (
        "env > /srv/env; cat /etc/creds/password > /srv/password;"
        " cat /etc/settings/greeting.txt > /srv/greeting; touch /etc/creds/x 2> /srv/readonly || true"
    )
    deployment = server_deployment(
        "envtest",
        replicas=1,
        script=script,
        env=env,
        envFrom=[
            {"configMapRef": {"name": "settings"}, "prefix": "CFG_"},
            {"configMapRef": {"name": "settings"}},
        ],
    )
    spec = deployment["spec"]["template"]["spec"]
    spec["containers"][0]["volumeMounts"] += [
        {"name": "creds", "mountPath": "/etc/creds", "readOnly": True},
        {"name": "settings", "mountPath": "/etc/settings"},
    ]
    spec["volumes"] += [
        {"name": "creds", "secret": {"secretName": "creds"}},
        {"name": "settings", "configMap": {"name": "settings"}},
    ]
    cluster.client.create(deployment)
    (pod,) = ready_pods(cluster, "envtest", 1)
    base = f"http://{pod['status']['podIP']}:8000"
    lines = httpx.get(f"{base}/env", timeout=5).text.splitlines()
    assert "USER_NAME=alice" in lines
    assert f"POD_IP={pod['status']['podIP']}" in lines
    assert f"POD_NAME={pod['metadata']['name']}" in lines
    assert f"URL=http://{pod['status']['podIP']}:8000/fast" in lines
    assert "CFG_MODE=fast" in lines and "MODE=fast" in lines
    assert "KUBECONFIG=/var/run/secrets/kubernetes.io/serviceaccount/kubeconfig" in lines
    assert httpx.get(f"{base}/password", timeout=5).text == "s3cret"
    assert httpx.get(f"{base}/greeting", timeout=5).text == "hi"
    assert "Read-only file system" in httpx.get(f"{base}/readonly", timeout=5).text
    # The mounts live in the pod's mount namespace only.
    assert not os.path.exists("/etc/creds/password")


def test_a_missing_secret_holds_the_pod_with_the_reason(cluster: ClusterInABox) -> None:
    env = [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "absent", "key": "k"}}}]
    cluster.client.create(server_deployment("nosecret", replicas=1, env=env))

    def waiting() -> dict[str, Any] | None:
        pods = cluster.pods({"app": "nosecret"})
        statuses = (pods[0].get("status") or {}).get("containerStatuses") if pods else None
        state = (statuses or [{}])[0].get("state", {})
        return (
            state.get("waiting")
            if state.get("waiting", {}).get("reason") == "CreateContainerConfigError"
            else None
        )

    assert wait_for(waiting, timeout=20)["message"] == 'secret "absent" not found'
    cluster.client.delete("Deployment", "nosecret")


def test_deleted_pod_is_stopped_and_replaced(cluster: ClusterInABox) -> None:
    cluster.client.create(server_deployment("phoenix", replicas=1))
    (pod,) = ready_pods(cluster, "phoenix", 1)
    name = pod["metadata"]["name"]
    runtime = cluster.kubelet.pods[f"{NS}/{name}"]
    process, netns = runtime.process, runtime.netns
    assert process is not None
    cluster.client.delete("Pod", name)
    wait_for(lambda: process.poll() is not None, timeout=20, what="the process to stop")
    wait_for(lambda: netns not in netns_list(), timeout=20, what="the namespace to go")
    (replacement,) = ready_pods(cluster, "phoenix", 1)
    assert replacement["metadata"]["name"] != name
    # Scaling follows spec.replicas both ways.
    cluster.client.patch("Deployment", "phoenix", {"spec": {"replicas": 3}})
    ready_pods(cluster, "phoenix", 3)
    cluster.client.patch("Deployment", "phoenix", {"spec": {"replicas": 1}})
    ready_pods(cluster, "phoenix", 1)
    status = wait_for(
        lambda: (
            (cluster.client.get("Deployment", "phoenix") or {}).get("status", {}).get("readyReplicas") == 1
        )
    )
    assert status


def test_a_deleted_pod_serves_through_its_pre_stop_hook_then_goes(cluster: ClusterInABox) -> None:
    """Graceful deletion, as the engines' scale-in hand-over relies on (operator/resources.py preStop)."""
    # 8 s: the checks made during the hook (1.5 s apart, then API reads and an HTTP call) must land inside
    # it on a loaded 2-core machine too; with 3 s they once did not.
    hook = {"preStop": {"exec": {"command": ["sleep", "8"]}}}
    cluster.client.create(server_deployment("lame-duck", replicas=1, lifecycle=hook))
    (pod,) = ready_pods(cluster, "lame-duck", 1)
    name, ip = pod["metadata"]["name"], pod["status"]["podIP"]
    process = cluster.kubelet.pods[f"{NS}/{name}"].process
    assert process is not None
    deleted_at = time.monotonic()
    cluster.client.delete("Pod", name)
    # During the hook the object stays, marked as being deleted, and the pod still runs, answers and is
    # Ready by its probe (the control plane's discovery calls such a pod "leaving": it still serves).
    during = cluster.client.get("Pod", name, NS)
    assert during is not None and during["metadata"].get("deletionTimestamp")
    assert during["metadata"]["deletionGracePeriodSeconds"] == 30
    time.sleep(1.5)
    assert process.poll() is None
    assert httpx.get(f"http://{ip}:8000/", timeout=5).status_code == 200
    during = cluster.client.get("Pod", name, NS) or {}
    conditions = (during.get("status") or {}).get("conditions") or []
    assert {"type": "Ready", "status": "True"}.items() <= next(
        c for c in conditions if c["type"] == "Ready"
    ).items()
    wait_for(lambda: cluster.client.get("Pod", name, NS) is None, timeout=20, what="the pod object to go")
    assert time.monotonic() - deleted_at >= 8.0, "the object went before the preStop hook ended"
    assert process.poll() is not None
    # Its replacement is deleted with no grace: gone at once, hook or not.
    (replacement,) = ready_pods(cluster, "lame-duck", 1)
    forced = time.monotonic()
    cluster.client.delete("Pod", replacement["metadata"]["name"], grace_seconds=0)
    assert cluster.client.get("Pod", replacement["metadata"]["name"], NS) is None
    assert time.monotonic() - forced < 3.0
    cluster.client.delete("Deployment", "lame-duck")


def test_crashing_container_restarts_with_its_termination_message(cluster: ClusterInABox) -> None:
    script = "echo 'model not found' > /dev/termination-log; exit 3"
    host_had_one = os.path.exists("/dev/termination-log")
    cluster.client.create(server_deployment("crasher", replicas=1, script=script))

    def restarted() -> dict[str, Any] | None:
        pods = cluster.pods({"app": "crasher"})
        status = ((pods[0].get("status") or {}).get("containerStatuses") or [{}])[0] if pods else {}
        return status if status.get("restartCount", 0) >= 1 else None

    status = wait_for(restarted, timeout=30, what="a restart")
    terminated = status["lastState"]["terminated"]
    assert terminated["exitCode"] == 3
    assert terminated["message"].strip() == "model not found"
    assert host_had_one or not os.path.exists("/dev/termination-log")  # the pod's /dev is its own
    assert not status["ready"]
    cluster.client.delete("Deployment", "crasher")


def test_jobs_run_to_completion_or_report_failure(cluster: ClusterInABox) -> None:
    def job(name: str, script: str) -> dict[str, Any]:
        container = {"name": "job", "image": "python:3.11", "command": ["sh", "-c", script],
                     "terminationMessagePolicy": "FallbackToLogsOnError"}  # fmt: skip
        return {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": name, "namespace": NS},
            "spec": {
                "backoffLimit": 1,
                "template": {"spec": {"restartPolicy": "Never", "containers": [container]}},
            },
        }

    cluster.client.create(job("works", "echo done"))
    cluster.client.create(job("fails", "echo 'cannot reach the database' >&2; exit 1"))
    wait_for(
        lambda: (cluster.client.get("Job", "works") or {}).get("status", {}).get("succeeded") == 1, timeout=30
    )

    def failed() -> dict[str, Any] | None:
        conditions = (cluster.client.get("Job", "fails") or {}).get("status", {}).get("conditions") or []
        return next((c for c in conditions if c["type"] == "Failed"), None)

    condition = wait_for(failed, timeout=30, what="the failing Job's condition")
    assert condition["reason"] == "BackoffLimitExceeded"
    assert "cannot reach the database" in condition["message"]
    assert len(cluster.pods({"job-name": "fails"})) == 2  # the first try and one retry


def test_stop_leaves_no_namespace_link_process_or_directory() -> None:
    box = ClusterInABox().start()
    try:
        box.client.create(server_deployment("lonely", replicas=1))
        ready_pods(box, "lonely", 1)
        runtime = next(iter(box.kubelet.pods.values()))
        process, root, tag = runtime.process, box.root, box.network.tag
        assert process is not None
    finally:
        box.stop()
    assert process.poll() is not None
    assert not root.exists()
    assert tag not in netns_list()
    assert tag not in subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    assert not list(ETC_NETNS.glob(f"{tag}-*"))


def test_sweep_removes_what_a_killed_run_left() -> None:
    stale = f"lpx{2**22 + 7}-{uuid.uuid4().hex[:4]}"  # a pid above any live one's range here
    subprocess.run(["ip", "netns", "add", stale], check=True)
    assert stale in Network.sweep_stale()
    assert stale not in netns_list()


def test_expand_follows_kubernetes_rules() -> None:
    env = {"A": "1", "B": "two"}
    assert expand("$(A)-$(B)-$(C)-$$(A)", env) == "1-two-$(C)-$(A)"


def test_sweep_undoes_what_a_killed_run_recorded(tmp_path: Path) -> None:
    made = tmp_path / "made-by-a-dead-run"
    (made / "inside").mkdir(parents=True)
    marker = f"lpx-sweep-{uuid.uuid4().hex}"
    # sys.executable, not `python3`: a pyenv shim runs bash scripts (with forks) before the real exec.
    daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", marker])
    bystander = subprocess.Popen(["sleep", "300"])  # alive, recorded, but not carrying the marker
    dead_pid = 2**22 + 11
    state = leftovers.STATE_DIR / f"{dead_pid}.jsonl"
    leftovers.STATE_DIR.mkdir(parents=True, exist_ok=True)
    state.write_text(
        f'{{"path": "{made}"}}\n{{"pid": {daemon.pid}, "marker": "{marker}"}}\n'
        f'{{"pid": {bystander.pid}, "marker": "{marker}"}}\n'
    )
    # Until its exec completes, the child's /proc cmdline is still pytest's: sweep only a marked daemon.
    wait_for(lambda: marker.encode() in Path(f"/proc/{daemon.pid}/cmdline").read_bytes(), 10, 0.01, "exec")
    try:
        leftovers.sweep()
        assert daemon.wait(10) == -9
        assert bystander.poll() is None
        assert not made.exists() and not state.exists()
    finally:
        bystander.kill()
        daemon.kill()


def test_a_volume_over_the_checkout_s_folder_leaves_the_image_visible(tmp_path: Path) -> None:
    """A checkout under /tmp and a pod with an emptyDir at /tmp (the chart's engine pods have one): the pod
    still finds its "image" (the checkout, its cwd), and the volume still shadows everything else there."""
    parent = tmp_path / "shadowed"
    checkout = parent / "checkout"
    checkout.mkdir(parents=True)
    (checkout / "marker").write_text("image\n")
    (parent / "host-only").write_text("hidden by the volume")
    (parent / "secret").mkdir()
    (parent / "secret" / "token").write_text("secret\n")  # a volume's source that the first volume hides
    volume = tmp_path / "empty-dir"
    volume.mkdir()
    secret_at = tmp_path / "secret-at"
    secret_at.mkdir()
    spec = {
        "mounts": [[str(volume), str(parent), False], [str(parent / "secret"), str(secret_at), True]],
        "image_paths": [str(checkout)],
        "cwd": str(checkout),
        "argv": ["sh", "-c", f"cat marker {secret_at}/token; ls {parent}"],
        "env": {"PATH": os.environ["PATH"]},
        "termination_target": str(tmp_path / "termination"),
    }
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    podinit = Path(__file__).with_name("podinit.py")
    run = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", sys.executable, str(podinit), str(spec_path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["image", "secret", "checkout"]


def test_the_api_server_forgets_answered_requests(cluster: ClusterInABox) -> None:
    """kmock matches each request against its whole request history: kept unbounded, every request cost
    more than the last, and the walkthrough's API server ended up answering in tens of seconds. Only the
    requests in flight stay (the long watches of the controllers and the operator among them)."""
    before = len(cluster.api._requests)
    for _ in range(50):
        assert isinstance(cluster.client.list("ConfigMap", NS), list)
    assert len(cluster.api._requests) <= before + 1
