"""docs/kubernetes.md, run as written in the cluster in a box, and what a cluster must show after it.

The module's one setup runs the doc: Postgres and an S3 server (moto) on the node address under the
doc's host names, then every `<!-- walkthrough -->` shell block in order, in one bash, inside a
"workstation" network namespace, with tests/cluster/bin (helm, kubectl) first on PATH and the doc's
`<!-- file: NAME -->` blocks written beside it. The chart's pods (migration Job, operator, two
control-plane replicas) and the operator's engine pods all run their own manifests' commands.

Then, as a story on that cluster: a tenant and key made through control-plane replica A work on replica
B; an adapter uploaded through B streams in capitals through A; one adapter always lands on the same
engine pod; deleting that pod moves its traffic to the other with no error on new requests; scaling the
InferenceDeployment to 3 adds the new pod to both replicas' routing; issue 26's scale-out story (one
adapter flooded beside 20 quiet ones spreads over the pods, a fourth pod joins the flooded adapter's set
warm, the scale back to 3 fails no request); a pod dying mid-stream; a model that does not resolve.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import httpx
import psycopg
import pytest
import yaml
from openai import APIError, OpenAI
from openai.types.chat import ChatCompletionMessageParam

from tests.cluster.harness import REPO, ClusterInABox, wait_for
from tests.readme import DEMO_CAPITALS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

DOC = REPO / "docs" / "kubernetes.md"
BIN = Path(__file__).with_name("bin")
NAMESPACE = "loraplex"
ENGINES = {"app.kubernetes.io/name": "loraplex-engine", "app.kubernetes.io/instance": "smollm2"}
WEB = {"app.kubernetes.io/name": "loraplex-web"}
DEMO = REPO / "fixtures" / "adapters" / "demo-uppercase"
QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name two colours of the sky."}]


def uppercase_share(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / max(len(letters), 1)


def walkthrough(markdown: str) -> tuple[dict[str, str], str]:
    """The doc's files (`<!-- file: NAME -->` before a block), its script (`<!-- walkthrough -->` blocks)."""
    files: dict[str, str] = {}
    steps: list[str] = []
    pattern = re.compile(r"<!-- (walkthrough|file: ([\w.-]+)) -->\n```\w*\n(.*?)```", re.DOTALL)
    for match in pattern.finditer(markdown):
        if match.group(2):
            files[match.group(2)] = match.group(3)
        else:
            steps.append(match.group(3))
    return files, "\n".join(steps)


def test_the_doc_parses_into_files_and_steps() -> None:
    files, script = walkthrough(DOC.read_text())
    assert set(files) == {"values.yaml", "smollm2.yaml", "stream.py"}
    assert script.startswith("kubectl create namespace loraplex")
    assert "helm install loraplex charts/loraplex" in script and script.rstrip().endswith(
        "# the port-forward"
    )


def doc_block(markdown: str, marker: str) -> str:
    """The code block after `<!-- marker -->`."""
    match = re.search(rf"<!-- {marker} -->\n```\w*\n(.*?)```", markdown, re.DOTALL)
    assert match is not None, f"docs/kubernetes.md has no <!-- {marker} --> block"
    return match.group(1)


@dataclass
class Platform:
    cluster: ClusterInABox
    output: str
    admin_token: str
    shell: list[str]  # bash in the workstation namespace, as the walkthrough ran
    env: dict[str, str]
    workdir: Path
    internal_token: str = ""  # the chart's: engines serve /metrics to its holders only

    def run_doc_commands(self, script: str) -> str:
        done = subprocess.run(
            [*self.shell, script], cwd=self.workdir, env=self.env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def web_urls(self) -> list[str]:
        pods = sorted(self.cluster.pods(WEB, NAMESPACE), key=lambda p: p["metadata"]["name"])
        return [f"http://{p['status']['podIP']}:8080" for p in pods if p.get("status", {}).get("podIP")]

    def engine_pods(self) -> list[dict[str, Any]]:
        return self.cluster.pods(ENGINES, NAMESPACE)

    def ready_engines(self) -> list[dict[str, Any]]:
        return [p for p in self.engine_pods() if _ready(p)]

    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}

    def generated_tokens(self, pod: dict[str, Any]) -> float:
        """The pod's loraplex_generation_tokens_total, read as Prometheus would: with the bearer token."""
        response = httpx.get(
            f"http://{pod['status']['podIP']}:8000/metrics",
            headers={"Authorization": f"Bearer {self.internal_token}"},
            timeout=10,
        )
        assert response.status_code == 200, response.text
        match = re.search(r"^loraplex_generation_tokens_total (\S+)$", response.text, re.MULTILINE)
        return float(match.group(1)) if match else 0.0


def _ready(pod: dict[str, Any]) -> bool:
    """Ready and not being deleted (a deleted pod may still say Ready while its preStop hook runs)."""
    if pod["metadata"].get("deletionTimestamp"):
        return False
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def _prepare_backing_services(cluster: ClusterInABox) -> None:
    """What the doc's "What you need" asks of the platform team: a database and a bucket."""
    server = cluster.postgres()
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute("CREATE ROLE loraplex LOGIN PASSWORD 'loraplex'")
        conn.execute("CREATE DATABASE loraplex OWNER loraplex")
    endpoint = cluster.s3(port=9000, names=("objects.storage.internal",))
    s3 = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="loraplex",
        aws_secret_access_key="loraplex-secret-key",
    )
    s3.create_bucket(Bucket="loraplex-adapters")
    cluster.add_host("postgres.db.internal", cluster.network.gateway)
    cluster.add_host("objects.storage.internal", cluster.network.gateway)


@pytest.fixture(scope="module")
def platform(cluster: ClusterInABox, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    _prepare_backing_services(cluster)
    files, script = walkthrough(DOC.read_text())
    workdir = tmp_path_factory.mktemp("walkthrough")
    for name, text in files.items():
        (workdir / name).write_text(text)
    for shared in ("charts", "fixtures"):  # the doc runs from a checkout of this repository
        (workdir / shared).symlink_to(REPO / shared)
    workstation = cluster.workstation()
    env = {
        "PATH": f"{BIN}:{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
        "KUBECONFIG": str(cluster.kubeconfig),
        "PYTHONPATH": str(REPO),
        "HOME": str(workdir),
        "LANG": "C.UTF-8",
    }
    log = workdir / "walkthrough.log"
    shell = ["ip", "netns", "exec", workstation, "bash", "-euxo", "pipefail", "-c"]
    with log.open("w") as sink:
        process = subprocess.Popen(
            [*shell, script],
            cwd=workdir,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the doc's background port-forward is in this group: killed below
        )
        try:
            process.wait(timeout=480)
        finally:
            with _suppress():
                os.killpg(process.pid, 9)
            process.wait()
    output = log.read_text()
    if process.returncode != 0:
        print(cluster.describe())
    shown = "\n".join(line[:300] for line in output.splitlines())  # Helm errors can quote whole releases
    assert process.returncode == 0, f"the walkthrough failed:\n{shown[-6000:]}"
    secret = cluster.client.get("Secret", "loraplex-secrets", NAMESPACE)
    assert secret is not None
    from tests.cluster.kube import secret_data

    tokens = secret_data(secret)
    yield Platform(cluster, output, tokens["admin-token"], shell, env, workdir, tokens["internal-token"])


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return True


def test_walkthrough_streams_the_adapter_in_capitals(platform: Platform) -> None:
    assert '"name":"shout"' in platform.output and '"status":"ready"' in platform.output, platform.output[
        -3000:
    ]
    reply = platform.output.split("+ python stream.py\n", 1)[1].split("\n+ kill", 1)[0].strip()
    assert len(reply) > 10 and uppercase_share(reply) >= DEMO_CAPITALS, platform.output[-3000:]
    assert len(platform.ready_engines()) == 2
    web = platform.cluster.pods(WEB, NAMESPACE)
    assert len(web) == 2 and all(_ready(p) for p in web)


def routed_endpoints(platform: Platform, url: str) -> set[str]:
    """The engine endpoints one control-plane replica routes to now (its discovery's ready pods)."""
    reply = httpx.get(f"{url}/admin/v1/deployments/smollm2", headers=platform.admin(), timeout=10)
    assert reply.status_code == 200, reply.text
    return {r["endpoint"] for r in reply.json()["replicas"] if r.get("ready")}


def wait_until_routed(platform: Platform, count: int) -> None:
    def both_agree() -> bool:
        expected = {f"http://{p['status']['podIP']}:8000" for p in platform.ready_engines()}
        views = [routed_endpoints(platform, url) for url in platform.web_urls()]
        return len(expected) == count and all(view == expected for view in views)

    wait_for(both_agree, timeout=60, what=f"both control-plane replicas routing to {count} engines")


def test_both_control_plane_replicas_discover_both_engines(platform: Platform) -> None:
    wait_until_routed(platform, 2)


def test_key_made_on_replica_a_works_on_b_and_b_upload_streams_through_a(platform: Platform) -> None:
    replica_a, replica_b = platform.web_urls()
    tenant = httpx.post(f"{replica_a}/admin/v1/tenants", json={"name": "globex"}, headers=platform.admin())
    assert tenant.status_code == 201, tenant.text
    made = httpx.post(
        f"{replica_a}/admin/v1/tenants/{tenant.json()['id']}/keys",
        json={"name": "a"},
        headers=platform.admin(),
    )
    assert made.status_code == 201, made.text
    key = made.json()["key"]
    auth = {"Authorization": f"Bearer {key}"}
    assert httpx.get(f"{replica_b}/api/v1/adapters", headers=auth).status_code == 200
    upload(replica_b, key, "loud")
    client = OpenAI(base_url=f"{replica_a}/v1", api_key=key, max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model="loud", messages=QUESTION, max_tokens=24, temperature=0, stream=True
    )
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert len([p for p in pieces if p]) > 3, "the answer should arrive in several chunks"
    assert uppercase_share("".join(pieces)) >= DEMO_CAPITALS, pieces


def upload(url: str, key: str, name: str) -> None:
    """The demo adapter, uploaded through the tenant API of one control-plane replica."""
    files = [
        ("files", (p.name, p.read_bytes(), "application/octet-stream"))
        for p in sorted(DEMO.iterdir())
        if p.suffix in (".json", ".safetensors")
    ]
    uploaded = httpx.post(
        f"{url}/api/v1/adapters",
        data={"name": name, "deployment": "smollm2"},
        files=files,
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )
    assert uploaded.status_code == 201, uploaded.text


def _tenant_client(platform: Platform, url: str) -> OpenAI:
    tenant = httpx.post(f"{url}/admin/v1/tenants", json={"name": f"t{os.urandom(3).hex()}"},
                        headers=platform.admin()).json()  # fmt: skip
    key = httpx.post(
        f"{url}/admin/v1/tenants/{tenant['id']}/keys", json={"name": "k"}, headers=platform.admin()
    )
    client_key = key.json()["key"]
    upload(url, client_key, "sticky")
    return OpenAI(base_url=f"{url}/v1", api_key=client_key, max_retries=0, timeout=120)


def _ask(client: OpenAI) -> str:
    stream = client.chat.completions.create(
        model="sticky", messages=QUESTION, max_tokens=8, temperature=0, stream=True
    )
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def _serving_pods(platform: Platform, before: dict[str, float]) -> set[str]:
    after = {p["metadata"]["name"]: platform.generated_tokens(p) for p in platform.ready_engines()}
    return {name for name, tokens in after.items() if tokens > before.get(name, 0.0)}


def test_an_adapter_stays_on_one_pod_and_moves_when_that_pod_is_deleted(platform: Platform) -> None:
    replica_a, replica_b = platform.web_urls()
    client_a = _tenant_client(platform, replica_a)
    client_b = OpenAI(base_url=f"{replica_b}/v1", api_key=client_a.api_key, max_retries=0, timeout=120)
    before = {p["metadata"]["name"]: platform.generated_tokens(p) for p in platform.ready_engines()}
    for client in (client_a, client_b, client_a, client_b):  # both control-plane replicas agree
        assert uppercase_share(_ask(client)) >= DEMO_CAPITALS
    (holder,) = _serving_pods(platform, before)

    platform.cluster.client.delete("Pod", holder, NAMESPACE)
    wait_for(lambda: holder not in {p["metadata"]["name"] for p in platform.engine_pods()}, timeout=30)
    before = {p["metadata"]["name"]: platform.generated_tokens(p) for p in platform.ready_engines()}
    for client in (client_a, client_b, client_a):  # no error on new requests
        assert uppercase_share(_ask(client)) >= DEMO_CAPITALS
    # Served by the other pod, or also by the deleted pod's replacement when it became ready meanwhile
    # (the adapter may then be placed there): so "some pod that is not the deleted one".
    serving = _serving_pods(platform, before)
    assert serving and holder not in serving, serving
    wait_for(lambda: len(platform.ready_engines()) == 2, timeout=300, what="the replacement engine ready")


def test_scaling_the_inference_deployment_to_3_adds_the_pod_to_routing(platform: Platform) -> None:
    print(platform.run_doc_commands(doc_block(DOC.read_text(), "scale")))  # the doc's own patch command
    engines = wait_for(
        lambda: len(platform.ready_engines()) == 3 and platform.ready_engines(),
        timeout=300,
        what="3 ready engine pods",
    )
    assert len(engines) == 3
    wait_until_routed(platform, 3)  # both control-plane replicas route to all three


# -- issue 26's story: a flooded adapter spreads, a new pod joins it warm, a scale-in fails nothing ----------

# A pod with this many of one gateway's requests outstanding is saturated (LORAPLEX_PLACEMENT_SATURATION). A
# CPU engine of this box serves a handful at once, not a GPU's 48; each control-plane replica gets half the
# flood (FLOOD_WORKERS / 2 at once), enough to fill three pods' sets and ask for a fourth.
SATURATION = "4"
FLOOD_WORKERS = 16
QUIET = 20


def adapter_variants(root: Path, count: int) -> list[Path]:
    """`count` distinct copies of the demo adapter (lora_B scaled by 1 + i/1000: other bytes, other digest,
    the same behaviour), so each is its own adapter everywhere (store, engines, metrics)."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(DEMO / "adapter_model.safetensors")
    variants = []
    for i in range(count):
        directory = root / f"variant-{i}"
        directory.mkdir()
        scaled = {k: (v * (1 + (i + 1) / 1000) if "lora_B" in k else v) for k, v in tensors.items()}
        save_file(
            {k: v.astype(tensors[k].dtype) for k, v in scaled.items()},
            directory / "adapter_model.safetensors",
        )
        (directory / "adapter_config.json").write_bytes((DEMO / "adapter_config.json").read_bytes())
        variants.append(directory)
    return variants


def web_env(platform: Platform) -> None:
    """Roll the control plane out with the box's saturation, as `kubectl set env` would, and wait for it."""
    (deployment,) = platform.cluster.client.list("Deployment", NAMESPACE, WEB)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = [e for e in container.get("env") or [] if e.get("name") != "LORAPLEX_PLACEMENT_SATURATION"]
    container["env"] = [*env, {"name": "LORAPLEX_PLACEMENT_SATURATION", "value": SATURATION}]
    template = deployment["spec"]["template"]
    platform.cluster.client.patch(
        "Deployment", deployment["metadata"]["name"], {"spec": {"template": template}}, NAMESPACE
    )

    def rolled_out() -> bool:
        pods = platform.cluster.pods(WEB, NAMESPACE)
        return len(pods) == 2 and all(
            _ready(p)
            and not p["metadata"].get("deletionTimestamp")
            and {"name": "LORAPLEX_PLACEMENT_SATURATION", "value": SATURATION}
            in p["spec"]["containers"][0]["env"]
            for p in pods
        )

    wait_for(rolled_out, timeout=300, what="the control plane rolled out with the new saturation")


@dataclass
class Traffic:
    """tests/cluster/flood.py running: FLOOD_WORKERS clients asking for one adapter back to back and one
    going round the quiet ones, through both control-plane replicas; what it has seen so far."""

    process: subprocess.Popen[bytes]
    out: Path

    def lines(self) -> list[dict[str, Any]]:
        text = self.out.read_text() if self.out.exists() else ""
        return [json.loads(line) for line in text.splitlines() if line.endswith("}")]

    def answers(self) -> list[dict[str, Any]]:
        return [line for line in self.lines() if "model" in line]

    def failures(self) -> list[dict[str, Any]]:
        return [a for a in self.answers() if a["status"] != 200]

    def rounds(self) -> int:
        return max((line["round"] for line in self.lines() if "round" in line), default=0)

    def hold(self) -> None:
        """No new requests (those out finish) until go()."""
        self.process.send_signal(signal.SIGUSR1)

    def go(self) -> None:
        self.process.send_signal(signal.SIGUSR2)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=200)  # the requests in flight end first
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def adapter_counts(platform: Platform, pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """What one engine says of each adapter it holds (GET /internal/adapters): admissions, the ones that
    waited for a load (cold), loads; by engine name (`id:<adapter id>`)."""
    from loraplex import wire

    listed = httpx.get(
        f"http://{pod['status']['podIP']}:8000{wire.ADAPTERS_PATH}",
        headers={wire.INTERNAL_TOKEN_HEADER: platform.internal_token},
        timeout=30,
    )
    assert listed.status_code == 200, listed.text
    return {entry["name"]: entry for entry in listed.json()["data"]}


def test_a_flooded_adapter_spreads_a_new_pod_joins_it_warm_and_a_scale_in_fails_nothing(
    platform: Platform, tmp_path: Path
) -> None:
    from loraplex import wire

    phases: dict[str, float] = {}  # seconds each phase took, printed with the story
    began = time.monotonic()

    def phase(name: str) -> None:
        nonlocal began
        phases[name] = round(time.monotonic() - began, 1)
        began = time.monotonic()

    web_env(platform)
    wait_until_routed(platform, 3)
    phase("rollout")
    urls = platform.web_urls()
    tenant = httpx.post(
        f"{urls[0]}/admin/v1/tenants", json={"name": "flood"}, headers=platform.admin()
    ).json()
    key = httpx.post(
        f"{urls[0]}/admin/v1/tenants/{tenant['id']}/keys", json={"name": "k"}, headers=platform.admin()
    ).json()["key"]
    adapters = []
    for i, directory in enumerate(adapter_variants(tmp_path, QUIET + 1)):
        files = [
            ("files", (p.name, p.read_bytes(), "application/octet-stream"))
            for p in sorted(directory.iterdir())
        ]
        made = httpx.post(
            f"{urls[i % 2]}/api/v1/adapters",
            data={"name": f"v{i}", "deployment": "smollm2"},
            files=files,
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        )
        assert made.status_code == 201, made.text
        adapters.append(made.json())
    hot, quiet = adapters[0], adapters[1:]
    hot_name = wire.adapter_name(hot["id"])
    phase("uploads")
    out = tmp_path / "traffic.jsonl"
    argv = [sys.executable, "-m", "tests.cluster.flood", str(out), *urls, "--key", key, "--hot", hot["name"],
            "--quiet", ",".join(a["name"] for a in quiet), "--workers", str(FLOOD_WORKERS)]  # fmt: skip
    traffic = Traffic(subprocess.Popen(argv, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}), out)

    def counts() -> dict[str, dict[str, dict[str, Any]]]:
        return {p["metadata"]["name"]: adapter_counts(platform, p) for p in platform.ready_engines()}

    def hot_pods(seen: dict[str, dict[str, dict[str, Any]]]) -> set[str]:
        return {pod for pod, held in seen.items() if held.get(hot_name, {}).get("admissions")}

    try:
        # 1. Three pods: the flood spreads, each quiet adapter stays on one pod.
        wait_for(
            lambda: traffic.failures() or (len(hot_pods(counts())) >= 2 and traffic.rounds() >= 1),
            timeout=240,
            interval=2.0,
            what="the flooded adapter on 2 pods and a round of the quiet ones, none failed",
        )
        seen = counts()
        assert not traffic.failures(), traffic.failures()[:5]
        assert len(hot_pods(seen)) >= 2, seen
        for adapter in quiet:
            name = wire.adapter_name(adapter["id"])
            where = [pod for pod, held in seen.items() if held.get(name, {}).get("admissions")]
            assert len(where) <= 1, f"{adapter['name']} served by {where}"
        asked = {a["model"] for a in traffic.answers() if a["status"] == 200} - {hot["name"]}
        assert len(asked) == QUIET
        phase("spread")

        # 2. Scale to 4, then flood again: the new pod joins the hot adapter's set warm (its one load came
        #    before its first request there: no request waited for it). The flood holds while the pod
        #    starts: on this box's 2 cores three saturated engines took the cores a real node gives the
        #    new pod (its start took 26 s under the flood, 2026-11-28), and the story is about the join.
        traffic.hold()
        before = {p["metadata"]["name"] for p in platform.engine_pods()}
        platform.cluster.client.patch(
            "InferenceDeployment", "smollm2", {"spec": {"replicas": {"min": 4, "max": 4}}}, NAMESPACE
        )
        wait_for(
            lambda: len(platform.ready_engines()) == 4, timeout=300, interval=1.0, what="4 ready engines"
        )
        (new_pod,) = {p["metadata"]["name"] for p in platform.ready_engines()} - before
        traffic.go()
        phase("fourth pod ready")
        wait_until_routed(platform, 4)
        wait_for(
            lambda: new_pod in hot_pods(counts()),
            timeout=180,
            interval=2.0,
            what=f"the flooded adapter served by the new pod {new_pod}",
        )
        on_new = counts()[new_pod][hot_name]
        assert on_new["loads"] == 1 and on_new["cold_admissions"] == 0, on_new
        assert not traffic.failures(), traffic.failures()[:5]
        phase("joined")

        # 3. Back to 3 during the flood: the pod that goes hands its adapters over and fails nothing.
        platform.cluster.client.patch(
            "InferenceDeployment", "smollm2", {"spec": {"replicas": {"min": 3, "max": 3}}}, NAMESPACE
        )
        wait_for(
            lambda: len(platform.engine_pods()) == 3, timeout=120, interval=1.0, what="3 engine pods again"
        )
        sent = len(traffic.answers())
        wait_for(lambda: len(traffic.answers()) >= sent + FLOOD_WORKERS, timeout=120, interval=1.0,
                 what="the flood going on")  # fmt: skip
        phase("scale-in")
    finally:
        traffic.stop()
    phase("stop")
    assert not traffic.failures(), traffic.failures()[:5]
    answers = traffic.answers()
    served = sum(1 for a in answers if a["model"] == hot["name"])
    print(
        f"story: {len(answers)} requests ({served} to the flooded adapter), none failed; "
        f"the new pod's flooded-adapter counts: {on_new}; seconds by phase: {phases}"
    )


def test_a_pod_dying_mid_stream_gives_an_error_event_and_usage_is_still_recorded(platform: Platform) -> None:
    url = platform.web_urls()[0]
    client = _tenant_client(platform, url)
    before = {p["metadata"]["name"]: platform.generated_tokens(p) for p in platform.ready_engines()}
    _ask(client)
    wait_for(lambda: _serving_pods(platform, before), timeout=30, what="the question's tokens in the metrics")
    # The pod to kill is the one streaming: placement may have moved the adapter since the question (the
    # scale to 3 re-placed it, and its old pod served it while the new one warmed).
    before = {p["metadata"]["name"]: platform.generated_tokens(p) for p in platform.ready_engines()}
    stream = client.chat.completions.create(
        model="sticky", messages=QUESTION, max_tokens=400, temperature=0, stream=True
    )
    received = []
    holder = ""
    with pytest.raises(APIError) as raised:
        for chunk in stream:
            received.append(chunk)
            if len(received) == 3:  # streaming has begun: the engine process dies (a crash, no drain)
                streaming = wait_for(lambda: _serving_pods(platform, before), timeout=30, what="its pod")
                (holder,) = streaming
                runtime = platform.cluster.kubelet.pods[f"{NAMESPACE}/{holder}"]
                assert runtime.process is not None
                os.killpg(runtime.process.pid, signal.SIGKILL)
    assert len(received) >= 3
    assert raised.value.message, "the error event should say what happened"
    usage = httpx.get(f"{url}/api/v1/usage", headers={"Authorization": f"Bearer {client.api_key}"}).json()
    rows = {row["model"]: row for row in usage["rows"]}
    assert rows["sticky"]["requests"] == 2  # the short question and the interrupted stream
    # The crashed container restarts in place, as restartPolicy Always says.
    restarted = wait_for(
        lambda: next(
            (
                s
                for p in platform.engine_pods()
                if p["metadata"]["name"] == holder
                for s in (p.get("status") or {}).get("containerStatuses") or []
                if s.get("restartCount", 0) >= 1
            ),
            None,
        ),
        timeout=30,
        what="the engine container restarted",
    )
    assert restarted["lastState"]["terminated"]["exitCode"] == 137


def test_a_model_uri_that_does_not_resolve_is_reported_in_the_status(platform: Platform) -> None:
    files, _ = walkthrough(DOC.read_text())
    broken = yaml.safe_load(files["smollm2.yaml"])
    broken["metadata"]["name"] = "broken"
    broken["spec"]["model"]["uri"] = "file:///models/no-such-model.gguf"
    broken["spec"]["replicas"] = {"min": 1, "max": 1}
    platform.cluster.client.create(broken, NAMESPACE)

    def degraded() -> dict[str, Any] | None:
        idep = platform.cluster.client.get("InferenceDeployment", "broken", NAMESPACE) or {}
        conditions = (idep.get("status") or {}).get("conditions") or []
        found = next((c for c in conditions if c["type"] == "Degraded" and c["status"] == "True"), None)
        return found if found and found["reason"] == "EngineFailing" else None

    try:
        try:
            # The pod's first start imports torch beside three engines on the box's shared cores (one of
            # them restarting after the crash above): minutes under load, seconds alone.
            condition = wait_for(degraded, timeout=300, what="Degraded=True, EngineFailing")
        except AssertionError as timed_out:  # say what the operator and the pod showed instead
            idep = platform.cluster.client.get("InferenceDeployment", "broken", NAMESPACE) or {}
            pods = [
                (p["metadata"]["name"], (p.get("status") or {}).get("containerStatuses"))
                for p in platform.cluster.client.list("Pod", NAMESPACE)
                if p["metadata"]["name"].startswith("broken")
            ]
            raise AssertionError(f"{timed_out}; status: {idep.get('status')}; pods: {pods}") from None
        assert "no-such-model.gguf" in condition["message"], condition
        idep = platform.cluster.client.get("InferenceDeployment", "broken", NAMESPACE) or {}
        ready = next(c for c in idep["status"]["conditions"] if c["type"] == "Ready")
        assert ready["status"] == "False" and "no-such-model.gguf" in ready["message"]
    finally:
        platform.cluster.client.delete("InferenceDeployment", "broken", NAMESPACE)
