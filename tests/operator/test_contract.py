"""What the chart and the operator start must be what the programs accept.

Every command line goes through the real parser (`loraplex`'s argparse tree, kopf's click group); every
LORAPLEX_* variable set on a container is a field of the settings class of the program it runs; every pod
spec passes Pod Security "restricted"; the CR examples validate and produce engine args the parser accepts.
"""

from __future__ import annotations

import argparse
import sqlite3
from pathlib import Path
from typing import Any

import click
import jsonschema
import pytest
from fastapi.testclient import TestClient
from kopf.cli import main as kopf_main
from pydantic_settings import BaseSettings

from loraplex.cli.main import build_parser
from loraplex.engine.server.settings import ALL_OPTIONS, ServerSettings
from loraplex.operator.config import OperatorConfig
from loraplex.operator.resources import desired_objects
from loraplex.operator.spec import parse
from loraplex.web.settings import Settings
from tests.operator.helpers import EXAMPLES, body, crd_schema, load_yaml
from tests.operator.test_chart import render

# Values that switch on every optional piece of env the chart can set.
FULL_VALUES: dict[str, Any] = {
    "adapterStore": {
        "uri": "s3://adapters/prod",
        "endpointUrl": "http://minio.storage.svc:9000",
        "region": "eu-west-1",
        "existingSecret": "store-keys",
    },
    "web": {"discovery": {"namespaces": ["loraplex", "team-a"]}},
}


def parse_loraplex(argv: list[str]) -> argparse.Namespace:
    """The real `loraplex` parser; argparse exits (SystemExit) on anything it rejects."""
    assert argv[0] == "loraplex", f"{argv} does not start the loraplex entry point"
    return build_parser().parse_args(argv[1:])


def workloads(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Pod-owning objects by a short name: web, operator, migrate, postgresql, engine."""
    found = {}
    for obj in objects:
        if obj["kind"] in ("Deployment", "Job", "StatefulSet"):
            name = obj["metadata"]["name"].rsplit("-", 1)[-1]
            found[name] = obj
    return found


def container(workload: dict[str, Any]) -> dict[str, Any]:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return dict(containers[0])


def loraplex_env_names(workload: dict[str, Any], config_maps: list[dict[str, Any]] = ()) -> set[str]:  # type: ignore[assignment]
    names = {e["name"] for e in container(workload).get("env", [])}
    for config_map in config_maps:
        names |= set(config_map["data"])
    return {name for name in names if name.startswith("LORAPLEX_")}


def env_fields(settings_class: type[BaseSettings]) -> set[str]:
    names = {f"LORAPLEX_{name.upper()}" for name in settings_class.model_fields}
    if settings_class is ServerSettings:  # its options' old names are read too (LORAPLEX_POOL_FRACTION)
        names |= {variable for option in ALL_OPTIONS for variable in option.variables}
    return names


# --- the chart's control plane -------------------------------------------------------------------------


def test_web_command_is_the_control_plane_without_migration() -> None:
    web = container(workloads(render(FULL_VALUES))["web"])
    args = parse_loraplex([*web["command"], *web.get("args", [])])
    assert (args.command, args.action) == ("control-plane", None)
    assert args.host == "0.0.0.0" and args.port == web["ports"][0]["containerPort"] == 8080
    assert args.no_migrate and not args.migrate_only


def test_migration_hook_runs_control_plane_migrate() -> None:
    migrate = container(workloads(render(FULL_VALUES))["migrate"])
    args = parse_loraplex([*migrate["command"], *migrate.get("args", [])])
    assert (args.command, args.action) == ("control-plane", "migrate")


def test_the_parser_rejects_a_wrong_command() -> None:
    with pytest.raises(SystemExit):
        parse_loraplex(["loraplex", "control-plane", "migrat"])
    with pytest.raises(SystemExit):
        parse_loraplex(["loraplex", "serve", "--log-level", "info"])


def test_web_env_is_what_the_control_plane_reads() -> None:
    for values in (None, FULL_VALUES):
        objects = render(values)
        for name in ("web", "migrate"):
            unknown = loraplex_env_names(workloads(objects)[name]) - env_fields(Settings)
            assert not unknown, f"{name} sets {sorted(unknown)}, which web/settings.py does not read"


def test_operator_command_and_env_are_what_kopf_and_the_operator_read() -> None:
    for values in (None, {"operator": {"watchNamespaces": ["a", "b"], "logLevel": "debug"}}):
        operator = container(workloads(render(values))["operator"])
        argv = [*operator["command"], *operator.get("args", [])]
        assert argv[:2] == ["kopf", "run"]
        # kopf's own click command parses the line; make_context raises on an unknown option.
        with kopf_main.commands["run"].make_context("kopf run", argv[2:]) as context:
            assert context.params["modules"] == ("loraplex.operator.main",)
            assert not context.params["standalone"] and context.params["peering_name"] == "loraplex-operator"
            assert context.params["liveness_endpoint"] == "http://0.0.0.0:8080/healthz"
            assert context.params["clusterwide"] or context.params["namespaces"]
            assert context.params["debug"] == (values is not None)
        names = {e["name"] for e in operator["env"] if e["name"].startswith("LORAPLEX_")}
        known = {f"LORAPLEX_OPERATOR_{name.upper()}" for name in OperatorConfig.__dataclass_fields__}
        assert names and names <= known
    with pytest.raises(click.UsageError):
        kopf_main.commands["run"].make_context("kopf run", ["--no-such-flag"])


def test_control_plane_migrate_creates_the_schema(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    database = tmp_path / "cp.db"
    monkeypatch.setenv("LORAPLEX_DATABASE_URL", f"sqlite:///{database}")
    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(tmp_path / "data"))
    args = parse_loraplex(["loraplex", "control-plane", "migrate"])
    assert args.handler(args) == 0
    tables = {row[0] for row in sqlite3.connect(database).execute("select name from sqlite_master")}
    assert {"tenants", "api_keys", "alembic_version"} <= tables


def test_livez_answers_without_a_database_and_health_does_not(tmp_path: Path) -> None:
    from loraplex.web.app import create_app

    # Port 1 on loopback refuses at once: a database that is down.
    settings = Settings(
        database_url="postgresql+psycopg://nobody:x@127.0.0.1:1/none?connect_timeout=2",
        data_dir=tmp_path,
        kubernetes_discovery="off",
    )
    client = TestClient(create_app(settings))  # no lifespan: it would read the database
    assert client.get("/livez").json() == {"status": "ok"}
    health = client.get("/health")
    assert health.status_code == 503 and health.json()["database"] is False


# --- the operator's engine pods ------------------------------------------------------------------------


@pytest.mark.parametrize("example", [path.name for path in EXAMPLES])
def test_engine_args_parse_with_the_real_cli(example: str) -> None:
    objects = desired_objects(parse(body(example)))
    engine = container(workloads(objects)["engine"])
    args = parse_loraplex([*engine["command"], *engine["args"]])
    assert args.command == "serve"
    assert args.model == parse(body(example)).spec.model.uri
    assert args.port == engine["ports"][0]["containerPort"] == 8000


@pytest.mark.parametrize("example", [path.name for path in EXAMPLES])
def test_engine_env_is_what_the_engine_reads(example: str) -> None:
    objects = desired_objects(parse(body(example)))
    config_maps = [o for o in objects if o["kind"] == "ConfigMap"]
    names = loraplex_env_names(workloads(objects)["engine"], config_maps)
    unknown = names - env_fields(ServerSettings)
    assert not unknown, (
        f"the engine pod sets {sorted(unknown)}, which engine/server/settings.py does not read"
    )
    # And the settings class accepts the values as the pod would give them.
    values = {
        k.removeprefix("LORAPLEX_").lower(): v
        for c in config_maps
        for k, v in c["data"].items()
        if k.startswith("LORAPLEX_")
    }
    ServerSettings(**values)


@pytest.mark.parametrize("example", [path.name for path in EXAMPLES])
def test_examples_validate_against_the_crd_schema(example: str) -> None:
    errors = list(
        jsonschema.Draft4Validator(crd_schema()).iter_errors(load_yaml(Path(EXAMPLES[0].parent, example)))
    )
    assert not errors, [e.message for e in errors]


# --- Pod Security "restricted" -------------------------------------------------------------------------
# The checks of https://kubernetes.io/docs/concepts/security/pod-security-standards/ (baseline, then the
# restricted additions), over a pod spec as written: what the admission controller would refuse.

RESTRICTED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
    "persistentVolumeClaim", "projected", "secret",
}  # fmt: skip
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}  # fmt: skip
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """Every Pod Security "restricted" rule the pod spec breaks, as readable strings (empty: admitted)."""
    problems: list[str] = []
    pod_sc = pod.get("securityContext") or {}
    containers = [
        *(("container", c) for c in pod.get("containers", [])),
        *(("initContainer", c) for c in pod.get("initContainers", [])),
        *(("ephemeralContainer", c) for c in pod.get("ephemeralContainers", [])),
    ]
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            problems.append(f"pod {key} is true")
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            problems.append(f"volume {volume['name']} uses {sorted(kinds - RESTRICTED_VOLUMES)}")
    for sysctl in pod_sc.get("sysctls", []):
        if sysctl.get("name") not in SAFE_SYSCTLS:
            problems.append(f"sysctl {sysctl.get('name')} is not in the safe set")
    problems += _common_context_violations("pod", pod_sc)
    pod_non_root = pod_sc.get("runAsNonRoot") is True
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type") in ("RuntimeDefault", "Localhost")
    for kind, c in containers:
        where = f"{kind} {c.get('name')}"
        sc = c.get("securityContext") or {}
        problems += _common_context_violations(where, sc)
        if sc.get("privileged"):
            problems.append(f"{where} is privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{where} does not set allowPrivilegeEscalation: false")
        if sc.get("procMount", "Default") != "Default":
            problems.append(f"{where} procMount is {sc['procMount']}")
        if sc.get("runAsNonRoot") is False or not (pod_non_root or sc.get("runAsNonRoot") is True):
            problems.append(f"{where} may run as root (runAsNonRoot is not true)")
        seccomp = (sc.get("seccompProfile") or {}).get("type")
        if not (pod_seccomp or seccomp in ("RuntimeDefault", "Localhost")) or seccomp == "Unconfined":
            problems.append(f"{where} has no RuntimeDefault or Localhost seccomp profile")
        capabilities = sc.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            problems.append(f"{where} does not drop ALL capabilities")
        added = set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}
        if added:
            problems.append(f"{where} adds capabilities {sorted(added)}")
        for port in c.get("ports", []):
            if port.get("hostPort"):
                problems.append(f"{where} uses hostPort {port['hostPort']}")
    return problems


def _common_context_violations(where: str, sc: dict[str, Any]) -> list[str]:
    problems = []
    if sc.get("runAsUser") == 0:
        problems.append(f"{where} runs as uid 0")
    if (sc.get("windowsOptions") or {}).get("hostProcess"):
        problems.append(f"{where} is a Windows HostProcess")
    if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
        problems.append(f"{where} seccomp profile is Unconfined")
    if (sc.get("appArmorProfile") or {}).get("type") not in (None, "RuntimeDefault", "Localhost"):
        problems.append(f"{where} AppArmor profile is {sc['appArmorProfile']['type']}")
    selinux = sc.get("seLinuxOptions") or {}
    if selinux.get("type", "") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
        problems.append(f"{where} sets SELinux options beyond the allowed types")
    return problems


RESTRICTED_POD: dict[str, Any] = {
    "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
    "containers": [
        {
            "name": "c",
            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        }
    ],
    "volumes": [{"name": "tmp", "emptyDir": {}}],
}


@pytest.mark.parametrize(
    ("path", "value", "words"),
    [
        (("hostNetwork",), True, "hostNetwork"),
        (("volumes",), [{"name": "h", "hostPath": {"path": "/"}}], "hostPath"),
        (("securityContext", "runAsNonRoot"), False, "may run as root"),
        (("securityContext", "runAsUser"), 0, "uid 0"),
        (("securityContext", "seccompProfile"), {"type": "Unconfined"}, "Unconfined"),
        (("containers", 0, "securityContext", "allowPrivilegeEscalation"), True, "allowPrivilegeEscalation"),
        (("containers", 0, "securityContext", "capabilities"), {"drop": ["NET_RAW"]}, "drop ALL"),
        (("containers", 0, "securityContext", "capabilities", "add"), ["SYS_ADMIN"], "SYS_ADMIN"),
        (("containers", 0, "securityContext", "privileged"), True, "privileged"),
        (("containers", 0, "ports"), [{"containerPort": 80, "hostPort": 80}], "hostPort"),
        (("securityContext", "sysctls"), [{"name": "kernel.msgmax", "value": "1"}], "kernel.msgmax"),
    ],
)
def test_the_restricted_checker_catches_each_rule(path: tuple[Any, ...], value: Any, words: str) -> None:
    import copy

    pod = copy.deepcopy(RESTRICTED_POD)
    assert restricted_violations(pod) == []
    target: Any = pod
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    assert any(words in problem for problem in restricted_violations(pod)), restricted_violations(pod)


@pytest.mark.parametrize("values", [None, FULL_VALUES], ids=["default", "full"])
def test_every_chart_pod_is_restricted(values: dict[str, Any] | None) -> None:
    pods = workloads(render(values))
    assert {"web", "operator", "migrate", "postgresql"} <= set(pods)
    for name, workload in pods.items():
        assert restricted_violations(workload["spec"]["template"]["spec"]) == [], name


@pytest.mark.parametrize("example", [path.name for path in EXAMPLES])
def test_operator_engine_pods_are_restricted(example: str) -> None:
    engine = workloads(desired_objects(parse(body(example))))["engine"]
    assert restricted_violations(engine["spec"]["template"]["spec"]) == []
