"""`kubectl` and `helm` for the cluster in a box: the subset docs/kubernetes.md uses, against the emulator.

The walkthrough test runs the doc's shell blocks with tests/cluster/bin first on PATH, so each `kubectl` or
`helm` line runs here (KUBECONFIG names the emulator). `helm install` is Helm's own Go SDK (helm-python-sdk):
the real chart, hooks, `lookup` and `--wait`. The kubectl subcommands are small equivalents that go through
the API the same way kubectl does; anything else fails loudly rather than pretending.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.cluster.kube import KINDS, ApiError, Client, load_kinds_from

ALIASES = {
    "deployment": "Deployment",
    "deployments": "Deployment",
    "deploy": "Deployment",
    "pod": "Pod",
    "pods": "Pod",
    "po": "Pod",
    "secret": "Secret",
    "secrets": "Secret",
    "service": "Service",
    "services": "Service",
    "svc": "Service",
    "job": "Job",
    "jobs": "Job",
    "inferencedeployment": "InferenceDeployment",
    "inferencedeployments": "InferenceDeployment",
    "idep": "InferenceDeployment",
}


def _kind(name: str) -> str:
    kind = ALIASES.get(name.lower())
    if kind is None:
        raise SystemExit(f'error: the server doesn\'t have a resource type "{name}" (harness kubectl)')
    return kind


def _seconds(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    return float(text[:-1]) * units[text[-1]] if text and text[-1] in units else float(text)


def _wait(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            result = check()
        except httpx.HTTPError:  # a slow or busy API server: kubectl's wait retries too, until its timeout
            result = None
        if result:
            return result
        time.sleep(0.5)
    raise SystemExit(f"error: timed out waiting for {what}")


def _documents(path: str) -> list[dict[str, Any]]:
    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    return [doc for doc in yaml.safe_load_all(text) if doc]


def _ensure_crd_kinds(client: Client) -> None:
    """Kinds of the CRDs installed in the cluster (kubectl's discovery does this)."""
    if "InferenceDeployment" not in KINDS:
        load_kinds_from(client.list("CustomResourceDefinition"))


# --- kubectl ----------------------------------------------------------------------------------------------
def kubectl(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kubectl")
    parser.add_argument("-n", "--namespace", default=None)
    parser.add_argument("verb")
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    args, extra = parser.parse_known_args(argv)
    client = Client.from_kubeconfig()
    namespace = args.namespace or client.namespace
    _ensure_crd_kinds(client)
    rest = args.rest + extra
    handlers = {
        "create": _create,
        "apply": _apply,
        "get": _get,
        "wait": _wait_for,
        "rollout": _rollout,
        "port-forward": _port_forward,
        "delete": _delete,
        "patch": _patch,
    }
    if args.verb not in handlers:
        print(f"error: kubectl {args.verb} is not part of the harness's kubectl", file=sys.stderr)
        return 1
    try:
        return handlers[args.verb](client, namespace, rest)
    except ApiError as error:
        print(f"Error from server: {error}", file=sys.stderr)
        return 1


def _create(client: Client, namespace: str, rest: list[str]) -> int:
    if rest[:1] == ["namespace"]:
        client.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": rest[1]}})
        print(f"namespace/{rest[1]} created")
        return 0
    if rest[:2] == ["secret", "generic"]:
        parser = argparse.ArgumentParser(prog="kubectl create secret generic")
        parser.add_argument("name")
        parser.add_argument("--from-literal", action="append", default=[])
        parser.add_argument("--from-file", action="append", default=[])
        args = parser.parse_args(rest[2:])
        data: dict[str, str] = {}
        for literal in args.from_literal:
            key, _, value = literal.partition("=")
            data[key] = base64.b64encode(value.encode()).decode()
        for item in args.from_file:
            key, _, path = item.rpartition("=")
            data[key or Path(path).name] = base64.b64encode(Path(path).read_bytes()).decode()
        secret = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "data": data,
                  "metadata": {"name": args.name, "namespace": namespace}}  # fmt: skip
        client.create(secret, namespace)
        print(f"secret/{args.name} created")
        return 0
    print(f"error: kubectl create {' '.join(rest[:2])} is not part of the harness's kubectl", file=sys.stderr)
    return 1


def _apply(client: Client, namespace: str, rest: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kubectl apply")
    parser.add_argument("-f", "--filename", action="append", required=True)
    args = parser.parse_args(rest)
    for path in args.filename:
        for doc in _documents(path):
            existed = client.get(
                doc["kind"], doc["metadata"]["name"], doc["metadata"].get("namespace", namespace)
            )
            client.apply(doc, namespace)
            kind = doc["kind"].lower()
            print(f"{kind}/{doc['metadata']['name']} {'configured' if existed else 'created'}")
    return 0


def _resource(rest: list[str]) -> tuple[str, str | None, list[str]]:
    first, *others = rest
    if "/" in first:
        kind, name = first.split("/", 1)
        return _kind(kind), name, others
    if others and not others[0].startswith("-"):
        return _kind(first), others[0], others[1:]
    return _kind(first), None, others


def _get(client: Client, namespace: str, rest: list[str]) -> int:
    kind, name, options = _resource(rest)
    parser = argparse.ArgumentParser(prog="kubectl get")
    parser.add_argument("-o", "--output", default="")
    parser.add_argument("-l", "--selector", default="")
    args = parser.parse_args(options)
    if name:
        obj = client.get(kind, name, namespace)
        if obj is None:
            print(f'Error from server (NotFound): {kind.lower()}s "{name}" not found', file=sys.stderr)
            return 1
        objects = [obj]
    else:
        selector = dict(term.split("=", 1) for term in args.selector.split(",") if term)
        objects = client.list(kind, namespace, selector or None)
    if args.output.startswith("jsonpath="):
        value: Any = objects[0] if name else {"items": objects}
        for part in _jsonpath(args.output[len("jsonpath=") :]):
            value = value[int(part)] if isinstance(value, list) else value[part]
        sys.stdout.write(value if isinstance(value, str) else json.dumps(value))
        return 0
    if args.output in ("json", "yaml"):
        value = objects[0] if name else {"apiVersion": "v1", "kind": "List", "items": objects}
        print(json.dumps(value, indent=2) if args.output == "json" else yaml.safe_dump(value))
        return 0
    print(_table(kind, objects))
    return 0


def _jsonpath(expression: str) -> list[str]:
    """`{.data.admin-token}` or `{.items[0].metadata.name}` -> path parts (the forms the doc uses)."""
    inner = expression.strip().removeprefix("{").removesuffix("}").lstrip(".")
    parts: list[str] = []
    for piece in inner.split("."):
        while "[" in piece:
            head, _, tail = piece.partition("[")
            if head:
                parts.append(head)
            index, _, piece = tail.partition("]")
            parts.append(index)
        if piece:
            parts.append(piece)
    return parts


def _table(kind: str, objects: list[dict[str, Any]]) -> str:
    rows = [["NAME", "STATUS"]]
    for obj in objects:
        status = obj.get("status") or {}
        if kind == "Pod":
            ready = all(c.get("ready") for c in status.get("containerStatuses") or [{}])
            phase = status.get("phase", "Pending")
            restarts = sum(c.get("restartCount", 0) for c in status.get("containerStatuses") or [])
            rows.append([obj["metadata"]["name"], f"{phase} ready={ready} restarts={restarts}"])
        else:
            rows.append(
                [obj["metadata"]["name"], str(status.get("phase") or status.get("readyReplicas", ""))]
            )
    width = max(len(r[0]) for r in rows) + 3
    return "\n".join(r[0].ljust(width) + r[1] for r in rows)


def _condition(obj: dict[str, Any] | None, kind: str) -> bool:
    conditions = ((obj or {}).get("status") or {}).get("conditions") or []
    return any(c.get("type") == kind and c.get("status") == "True" for c in conditions)


def _wait_for(client: Client, namespace: str, rest: list[str]) -> int:
    kind, name, options = _resource(rest)
    parser = argparse.ArgumentParser(prog="kubectl wait")
    parser.add_argument("--for", dest="condition", required=True)
    parser.add_argument("--timeout", default="30s")
    args = parser.parse_args(options)
    if not name or not args.condition.startswith("condition="):
        print("error: the harness's kubectl waits for one named object's condition", file=sys.stderr)
        return 1
    wanted = args.condition.split("=", 1)[1]
    _wait(lambda: _condition(client.get(kind, name, namespace), wanted), _seconds(args.timeout),
          f"{kind.lower()}/{name} condition {wanted}")  # fmt: skip
    print(f"{kind.lower()}/{name} condition met")
    return 0


def _rollout(client: Client, namespace: str, rest: list[str]) -> int:
    if rest[:1] != ["status"]:
        print("error: the harness's kubectl knows `rollout status` only", file=sys.stderr)
        return 1
    kind, name, options = _resource(rest[1:])
    parser = argparse.ArgumentParser(prog="kubectl rollout status")
    parser.add_argument("--timeout", default="300s")
    args = parser.parse_args(options)

    def done() -> bool:
        obj = client.get(kind, str(name), namespace) or {}
        status, wanted = obj.get("status") or {}, int((obj.get("spec") or {}).get("replicas", 1))
        generation = (obj.get("metadata") or {}).get("generation", 1)
        return bool(
            obj
            and status.get("observedGeneration", 0) >= generation
            and status.get("updatedReplicas", 0) == wanted
            and status.get("readyReplicas", 0) == wanted
            and status.get("replicas", 0) == wanted
        )

    _wait(done, _seconds(args.timeout), f"{kind.lower()}/{name} to roll out")
    print(f'{kind.lower()} "{name}" successfully rolled out')
    return 0


def _patch(client: Client, namespace: str, rest: list[str]) -> int:
    kind, name, options = _resource(rest)
    parser = argparse.ArgumentParser(prog="kubectl patch")
    parser.add_argument("--type", default="strategic")
    parser.add_argument("-p", "--patch", required=True)
    args = parser.parse_args(options)
    if args.type != "merge" or not name:
        print(
            "error: the harness's kubectl applies `--type merge` patches to one named object", file=sys.stderr
        )
        return 1
    client.patch(kind, name, json.loads(args.patch), namespace)
    print(f"{kind.lower()}/{name} patched")
    return 0


def _delete(client: Client, namespace: str, rest: list[str]) -> int:
    kind, name, _ = _resource(rest)
    if not name or not client.delete(kind, name, namespace):
        print(f'Error from server (NotFound): {kind.lower()}s "{name}" not found', file=sys.stderr)
        return 1
    print(f'{kind.lower()} "{name}" deleted')
    return 0


def _port_forward(client: Client, namespace: str, rest: list[str]) -> int:
    """Listen on 127.0.0.1:LOCAL and pipe each connection to the Service's (or Pod's) address."""
    from tests.cluster.proxy import forward

    target, ports = rest[0], rest[1]
    local, _, remote = ports.partition(":")
    kind, name, _ = _resource([target])
    obj = client.get(kind, str(name), namespace)
    if obj is None:
        print(f'Error from server (NotFound): {kind.lower()}s "{name}" not found', file=sys.stderr)
        return 1
    address = obj["spec"].get("clusterIP") if kind == "Service" else obj["status"].get("podIP")
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", int(local)))
    server.listen(64)
    print(f"Forwarding from 127.0.0.1:{local} -> {remote or local}", flush=True)
    while True:
        connection, _ = server.accept()
        destination = (address, int(remote or local))
        threading.Thread(target=forward, args=(connection, destination, 10), daemon=True).start()


# --- helm -------------------------------------------------------------------------------------------------
def helm(argv: list[str]) -> int:
    import helm_python

    if argv[:1] != ["install"]:
        print("error: the harness's helm knows `helm install` only", file=sys.stderr)
        return 1
    parser = argparse.ArgumentParser(prog="helm install")
    parser.add_argument("release")
    parser.add_argument("chart")
    parser.add_argument("-n", "--namespace", default="default")
    parser.add_argument("-f", "--values", action="append", default=[])
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--create-namespace", action="store_true")
    parser.add_argument("--wait", action="store_true")
    parser.add_argument("--timeout", default="5m")
    args = parser.parse_args(argv[1:])
    values: dict[str, Any] = {}
    for path in args.values:
        _merge(values, yaml.safe_load(Path(path).read_text()) or {})
    for assignment in args.set:
        key, _, value = assignment.partition("=")
        node = values
        *parents, leaf = key.split(".")
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = yaml.safe_load(value)
    kubeconfig = Path(os.environ["KUBECONFIG"]).read_text()
    # The release record stays in this process (the emulator cannot store Helm's protobuf-encoded Secret):
    # enough for an install, which is all the walkthrough does.
    config = helm_python.Config(
        kubeconfig_content=kubeconfig, namespace=args.namespace, storage_driver="memory"
    )
    release = config.install(
        Path(args.chart),
        args.release,
        values,
        namespace=args.namespace,
        create_namespace=args.create_namespace,
        wait="legacy" if args.wait else None,  # legacy polls; the watcher needs protobuf watches
        timeout=int(_seconds(args.timeout)),
    )
    info = release.get("info") or {}
    print(f"NAME: {args.release}\nNAMESPACE: {args.namespace}\nSTATUS: {info.get('status', '')}")
    if info.get("notes"):
        print(f"NOTES:\n{info['notes']}")
    return 0


def _merge(into: dict[str, Any], other: dict[str, Any]) -> None:
    for key, value in other.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def main() -> int:
    tool, *argv = sys.argv[1:]
    return kubectl(argv) if tool == "kubectl" else helm(argv)


if __name__ == "__main__":
    sys.exit(main())
