"""The Helm chart: CRDs in sync with crds/, lint clean, renders, and every rendered object validates."""

from __future__ import annotations

import asyncio
import base64
import datetime
import json
import re
import threading
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp.web
import helm_python as helm
import kmock
import kubernetes_validate
import pytest
import yaml
from kmock._internal import enums, rendering

from loraplex.operator.generate_chart_crds import expected
from tests.operator.apiserver import StrictApiServer
from tests.operator.helpers import KUBE_VERSION, ROOT, crd

CHART = ROOT / "charts" / "loraplex"
VALUE_FILES = {"default": None, "gpu": CHART / "values-gpu.yaml"}
# The least an install must set: the chart refuses to install without an adapter store (templates/
# validate.yaml). `render` adds it under values that set no store of their own.
STORE = {"adapterStore": {"uri": "s3://loraplex-adapters/test"}}


def merged(base: dict[str, Any], over: dict[str, Any] | None) -> dict[str, Any]:
    """`over` on top of `base`, nested mappings merged key by key."""
    result = dict(base)
    for key, value in (over or {}).items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merged(result[key], value)
        else:
            result[key] = value
    return result


def manifests(values: dict[str, Any] | None) -> dict[str, str]:
    """The chart rendered with exactly `values` (no store added)."""
    return dict(helm.Chart.load(CHART).render(values, name="loraplex", namespace="loraplex", is_install=True))


def render(values: dict[str, Any] | None) -> list[dict[str, Any]]:
    texts = manifests(merged(STORE, values))
    objects = (yaml.safe_load_all(text) for path, text in texts.items() if not path.endswith("NOTES.txt"))
    return [doc for docs in objects for doc in docs if doc]


def notes(values: dict[str, Any] | None) -> str:
    return next(text for path, text in manifests(merged(STORE, values)).items() if path.endswith("NOTES.txt"))


def test_notes_name_the_token_secret_and_the_store() -> None:
    text = notes({"adapterStore": {"existingSecret": "adapter-store"}})
    assert "internalTokenSecretRef: {name: loraplex-secrets, key: internal-token}" in text
    assert "adapterStore: {uri: s3://loraplex-adapters/test, secretRef: {name: adapter-store}}" in text
    assert "for evaluation" in text  # the in-chart Postgres
    quiet = notes({"postgresql": {"enabled": False}, "database": {"url": "postgresql://x"}})
    assert "WARNING" not in quiet and "for evaluation" not in quiet
    spread = notes(
        {"adapterStore": {"existingSecret": "adapter-store"}, "web": {"discovery": {"namespaces": ["a"]}}}
    )
    assert "copy it into every other" in spread


@pytest.mark.parametrize(
    ("store", "words"),
    [
        (None, "adapterStore.uri is empty: uploaded adapters would stay in each control-plane pod's scratch"),
        ({"uri": ""}, "Set adapterStore.uri to s3://bucket/prefix"),
        ({"uri": "/var/lib/loraplex/adapters"}, "is a directory inside each control-plane pod"),
        ({"uri": "file:///srv/adapters", "endpointUrl": "http://minio:9000"}, "engine pods cannot read"),
        ({"uri": "s3://"}, "is not s3://bucket/prefix"),
        ({"uri": "s3://Bad_Bucket/x"}, "a lowercase bucket name"),
    ],
)
def test_values_that_cannot_serve_an_adapter_refuse_to_install(
    store: dict[str, Any] | None, words: str
) -> None:
    """The default values (two web replicas, each with its own scratch directory) and every store the
    engines cannot read fail the render, saying what to set."""
    values = None if store is None else {"adapterStore": store}
    with pytest.raises(helm.HelmError, match=re.escape(words)):
        manifests(values)


def test_a_bucket_installs_and_reaches_the_web_pods() -> None:
    objects = render(
        {"adapterStore": {"uri": "s3://team-bucket/adapters", "endpointUrl": "http://minio:9000"}}
    )
    env = container_env(deployment(objects, "web"))
    assert env["LORAPLEX_ADAPTER_STORE"]["value"] == "s3://team-bucket/adapters"
    assert env["LORAPLEX_S3_ENDPOINT_URL"]["value"] == "http://minio:9000"
    # An operator-only install uploads nothing: it needs no store (each CR names its own).
    operator_only = manifests({"web": {"enabled": False}})
    assert not any("loraplex-web" in text for path, text in operator_only.items() if "web-" in path)


def values(name: str) -> dict[str, Any]:
    """A values file as a user would pass it; `default` is the chart's defaults plus the required store."""
    path: Path | None = VALUE_FILES[name]
    return STORE if path is None else yaml.safe_load(path.read_text())


def test_chart_crds_are_generated_from_crds() -> None:
    for path, text in expected().items():
        assert path.exists(), f"{path} missing: run python -m loraplex.operator.generate_chart_crds"
        assert path.read_text() == text, (
            f"{path} is stale: run python -m loraplex.operator.generate_chart_crds"
        )


@pytest.mark.parametrize("name", sorted(VALUE_FILES))
def test_chart_lints_clean(name: str) -> None:
    report = helm.lint(CHART, values(name), strict=True, namespace="loraplex")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report


@pytest.mark.parametrize("name", sorted(VALUE_FILES))
def test_every_rendered_object_validates_strictly(name: str) -> None:
    objects = render(values(name))
    kinds = {obj["kind"] for obj in objects}
    assert kinds >= {
        "CustomResourceDefinition",
        "Deployment",
        "ServiceAccount",
        "ClusterRole",
        "Job",
        "Service",
    }
    for obj in objects:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def test_rendered_crd_equals_the_source_and_is_kept() -> None:
    rendered = next(obj for obj in render(None) if obj["kind"] == "CustomResourceDefinition")
    assert rendered["spec"] == crd()["spec"]
    assert rendered["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    unkept = next(o for o in render({"crds": {"keep": False}}) if o["kind"] == "CustomResourceDefinition")
    assert "helm.sh/resource-policy" not in unkept["metadata"]["annotations"]
    assert all(o["kind"] != "CustomResourceDefinition" for o in render({"crds": {"enabled": False}}))


def test_gpu_values_expose_the_control_plane_and_scope_the_operator() -> None:
    objects = render(values("gpu"))
    ingress = next(o for o in objects if o["kind"] == "Ingress")
    assert ingress["spec"]["tls"][0]["secretName"] == "llm-example-com-tls"
    operator = deployment(objects, "operator")
    assert operator["spec"]["template"]["spec"]["containers"][0]["args"] == [
        "--peering=loraplex-operator",
        "--namespace=loraplex",
    ]
    # The database URL comes from the existing Secret: the chart makes only the shared secrets.
    assert [o["metadata"]["name"] for o in objects if o["kind"] == "Secret"] == ["loraplex-secrets"]
    assert all(o["kind"] != "StatefulSet" for o in objects)
    env = container_env(deployment(objects, "web"))
    assert env["LORAPLEX_DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": "loraplex-database",
        "key": "url",
    }
    assert env["LORAPLEX_ADAPTER_STORE"]["value"] == "s3://loraplex-adapters/prod"
    assert env["AWS_REGION"]["value"] == "us-east-1"
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert env[key]["valueFrom"]["secretKeyRef"] == {"name": "loraplex-adapter-store", "key": key}
    migrate = next(o for o in objects if o["kind"] == "Job")
    assert migrate["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"


def deployment(objects: list[dict[str, Any]], component: str) -> dict[str, Any]:
    return next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith(component))


def container_env(workload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in workload["spec"]["template"]["spec"]["containers"][0]["env"]}


SHARED_SECRETS = {
    "LORAPLEX_KEY_PEPPER": "key-pepper",
    "LORAPLEX_SESSION_SECRET": "session-secret",
    "LORAPLEX_INTERNAL_TOKEN": "internal-token",
    "LORAPLEX_ADMIN_TOKEN": "admin-token",
}


def test_every_web_replica_reads_the_same_generated_secrets() -> None:
    objects = render(None)
    secret = next(o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"] == "loraplex-secrets")
    assert set(secret["data"]) == set(SHARED_SECRETS.values())
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert len(set(secret["data"].values())) == 4  # four independent random values
    assert all(len(base64.b64decode(value)) == 48 for value in secret["data"].values())
    env = container_env(deployment(objects, "web"))
    for name, key in SHARED_SECRETS.items():
        assert env[name]["valueFrom"]["secretKeyRef"] == {"name": "loraplex-secrets", "key": key}


def test_engine_namespaces_get_a_copy_of_the_internal_token_only() -> None:
    objects = render({"web": {"discovery": {"namespaces": ["loraplex", "team-a"]}}})
    secrets = {o["metadata"]["namespace"]: o for o in objects if o["metadata"]["name"] == "loraplex-secrets"}
    assert set(secrets) == {"loraplex", "team-a"}
    assert secrets["team-a"]["data"] == {"internal-token": secrets["loraplex"]["data"]["internal-token"]}


def test_an_existing_secret_replaces_the_generated_one() -> None:
    objects = render({"secrets": {"existingSecret": "platform-secrets"}})
    assert all(o["metadata"]["name"] != "loraplex-secrets" for o in objects if o["kind"] == "Secret")
    env = container_env(deployment(objects, "web"))
    assert {env[name]["valueFrom"]["secretKeyRef"]["name"] for name in SHARED_SECRETS} == {"platform-secrets"}


def test_in_chart_postgres_is_wired_to_the_control_plane() -> None:
    objects = render(None)  # postgresql.enabled is the evaluation default
    postgres = next(o for o in objects if o["kind"] == "StatefulSet")
    database = next(
        o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"] == "loraplex-database"
    )
    password = base64.b64decode(database["data"]["postgres-password"]).decode()
    url = base64.b64decode(database["data"]["database-url"]).decode()
    assert url == f"postgresql+psycopg://loraplex:{password}@loraplex-postgresql.loraplex.svc:5432/loraplex"
    pg_env = {e["name"]: e for e in postgres["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert pg_env["POSTGRES_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "loraplex-database"
    # The in-chart database does not exist before install: the migration runs after it.
    migrate = next(o for o in objects if o["kind"] == "Job")
    assert migrate["metadata"]["annotations"]["helm.sh/hook"] == "post-install,pre-upgrade"


def test_an_external_database_url_becomes_a_secret() -> None:
    url = "postgresql+psycopg://app:pw@db.example.com:5432/loraplex"
    objects = render({"postgresql": {"enabled": False}, "database": {"url": url}})
    database = next(
        o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"] == "loraplex-database"
    )
    assert base64.b64decode(database["data"]["database-url"]).decode() == url
    assert all(o["kind"] != "StatefulSet" for o in objects)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"postgresql": {"enabled": False}}, "set database.existingSecret"),
        ({"database": {"existingSecret": "db"}}, "set postgresql.enabled=false"),
    ],
)
def test_a_missing_or_ambiguous_database_fails_with_a_reason(change: dict[str, Any], words: str) -> None:
    with pytest.raises(helm.HelmError, match=words):
        render(change)


def test_web_liveness_is_livez_and_readiness_is_health() -> None:
    container = deployment(render(None), "web")["spec"]["template"]["spec"]["containers"][0]
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"


def test_extra_env_reaches_web_migration_and_operator() -> None:
    extra = [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}]
    objects = render({"web": {"extraEnv": extra}, "operator": {"extraEnv": extra}})
    migrate = next(o for o in objects if o["kind"] == "Job")
    for workload in (deployment(objects, "web"), deployment(objects, "operator"), migrate):
        assert container_env(workload)["HTTPS_PROXY"] == extra[0]


def test_network_policy_lets_only_the_control_plane_and_operator_reach_engines() -> None:
    prometheus = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    objects = render({"networkPolicy": {"extraFrom": [prometheus]}})
    policy = next(o for o in objects if o["kind"] == "NetworkPolicy" and "engine" in o["metadata"]["name"])
    assert policy["spec"]["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "loraplex-engine"}}
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": 8000, "protocol": "TCP"}]
    peers = [
        p.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/name") for p in rule["from"]
    ]
    assert peers == ["loraplex-web", "loraplex-operator", None]
    assert rule["from"][2] == prometheus
    for peer in rule["from"][:2]:
        assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "loraplex"}}
        assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "loraplex"
    # The engine pods the operator makes carry the label the policy selects.
    from loraplex.operator.resources import selector_labels
    from loraplex.operator.spec import parse
    from tests.operator.helpers import body

    engine = selector_labels(parse(body()))
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= engine.items()
    assert all(o["kind"] != "NetworkPolicy" for o in render({"networkPolicy": {"enabled": False}}))


def test_values_schema_rejects_a_typo() -> None:
    chart = helm.Chart.load(CHART)
    with pytest.raises(helm.HelmError):
        chart.validate_schema({"operator": {"logLevl": "debug"}})
    with pytest.raises(helm.HelmError):
        chart.validate_schema({"web": {"replicas": -1}})
    chart.validate_schema(values("gpu"))


# --- a real install and upgrade (Helm's Go SDK) on the API emulator: `lookup` keeps the secrets -------


class HelmableApiServer(StrictApiServer):
    """The strict emulator plus what Helm's release actions need of an API server: a version the chart's
    kubeVersion accepts, a core group named "v1" (kmock says "/v1"), an (empty) OpenAPI document for Helm's
    validation, and server-side apply that creates a missing object (Helm 4 applies every object)."""

    async def _serve_server_version(self, request: rendering.Request) -> rendering.Payload:
        version = await super()._serve_server_version(request)
        return {**version, "minor": "33", "gitVersion": "v1.33.0"}

    async def _serve_version(self, request: rendering.Request) -> rendering.Payload:
        listing: dict[str, Any] = dict(await super()._serve_version(request))  # type: ignore[arg-type]
        return {**listing, "groupVersion": str(listing["groupVersion"]).lstrip("/")}

    async def _handle(self, request: rendering.Request) -> Any:
        if str(request.url.path).startswith("/openapi/v2"):
            # An empty protobuf message is an empty OpenAPI document: nothing to validate against.
            media = "application/com.github.proto-openapi.spec.v2.v1.0+protobuf"
            return aiohttp.web.Response(body=b"", headers={"Content-Type": media})
        if request.resource is not None and request.action == enums.action.UPDATE and request.name:
            key = (request.resource, request.namespace, request.name)
            if key not in self.objects or self.objects[key].deleted:
                data = request.data if isinstance(request.data, dict) else json.loads(request.data)
                meta = data.setdefault("metadata", {})
                now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                meta.update(uid=str(uuid.uuid4()), generation=1, creationTimestamp=now)
                meta["resourceVersion"] = self._next_version()
                self.objects[key] = data
        return await super()._handle(request)


HELM_RESOURCES = [
    ("v1/secrets", "Secret", True),
    ("v1/services", "Service", True),
    ("v1/serviceaccounts", "ServiceAccount", True),
    ("v1/namespaces", "Namespace", False),
    ("apps/v1/deployments", "Deployment", True),
    ("apps/v1/statefulsets", "StatefulSet", True),
    ("batch/v1/jobs", "Job", True),
    ("rbac.authorization.k8s.io/v1/roles", "Role", True),
    ("rbac.authorization.k8s.io/v1/rolebindings", "RoleBinding", True),
    ("rbac.authorization.k8s.io/v1/clusterroles", "ClusterRole", False),
    ("rbac.authorization.k8s.io/v1/clusterrolebindings", "ClusterRoleBinding", False),
    ("networking.k8s.io/v1/networkpolicies", "NetworkPolicy", True),
    ("apiextensions.k8s.io/v1/customresourcedefinitions", "CustomResourceDefinition", False),
]


@pytest.fixture
def api_server() -> Iterator[str]:
    """The emulator on a loop in a thread (Helm's calls block); yields its URL."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> tuple[HelmableApiServer, kmock.Server]:
        api = HelmableApiServer()
        for key, kind, namespaced in HELM_RESOURCES:
            api.declare(key, kind, (), namespaced)
        await api.__aenter__()
        server = kmock.Server(api)
        await server.__aenter__()
        return api, server

    api, server = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=20)
    try:
        yield str(server.url).rstrip("/")
    finally:

        async def stop() -> None:
            await server.__aexit__(None, None, None)
            await api.__aexit__(None, None, None)

        asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout=20)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


def live_secret(url: str, name: str) -> dict[str, str]:
    with urllib.request.urlopen(f"{url}/api/v1/namespaces/loraplex/secrets/{name}", timeout=10) as response:
        return dict(json.load(response)["data"])


def test_an_upgrade_keeps_the_generated_secrets(api_server: str) -> None:
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "emulator", "cluster": {"server": api_server}}],
        "users": [{"name": "tester", "user": {"token": "t"}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester"}}],
        "current-context": "emulator",
    }
    config = helm.Config(
        kubeconfig_content=json.dumps(kubeconfig), storage_driver="memory", namespace="loraplex"
    )
    # No Job controller in the emulator: the migration hook would never complete.
    chart_values = {**STORE, "web": {"migration": {"enabled": False}}}
    config.install(CHART, "loraplex", chart_values, namespace="loraplex", timeout=60)
    shared, database = (
        live_secret(api_server, "loraplex-secrets"),
        live_secret(api_server, "loraplex-database"),
    )
    assert set(shared) == set(SHARED_SECRETS.values())
    config.upgrade(
        CHART, "loraplex", {**chart_values, "web": {**chart_values["web"], "replicas": 3}}, timeout=60
    )
    assert live_secret(api_server, "loraplex-secrets") == shared
    # The hook Secret is deleted and re-created on upgrade, with the same in-chart Postgres password.
    assert live_secret(api_server, "loraplex-database") == database
