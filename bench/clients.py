"""`python -m loraplex.bench clients`: two benchmark clients nobody here wrote, guidellm 0.8.1 and
inference-perf 0.7.0, against `loraplex up` through its gateway, as a user would point them at it.

The platform is started here (`loraplex up` on a free port, its data under the work dir) unless --url names
a running one (then --api-key too). Both clients count tokens with the model's tokenizer exported by
`loraplex tokenizer export` (engine/tokenizer_export.py), talk to the OpenAI-compatible gateway with the demo
tenant's API key, and run short, fixed-size loads for each model asked (the demo adapter and the base model
by default): `--requests` streaming completions at `--concurrency`, `--prompt-tokens` in and exactly
`--output-tokens` out.

Printed per client and model: requests completed, errors (and incomplete requests), seconds, requests/s and
output tokens/s, as each client reports them in its own result files. Any error, a run that completed no
request, or a client that fails makes the command exit 1 with the client's own words: this bench is the
test that these clients work, not only a measurement.

Each client runs from its own venv under the work dir (client_venvs.py), made on first use.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .client_venvs import DEFAULT_ROOT, SetupFailed, guidellm_venv, inference_perf_venv

BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEMO_ADAPTER = "demo-uppercase"
# The two generation endpoints both clients can drive, by this bench's name for each.
ENDPOINTS = {"completions": "completions", "chat": "chat/completions"}
BANNER_END = "Ctrl-C stops everything; the next `loraplex up` keeps the data."


class ClientFailed(RuntimeError):
    """A client exited non-zero or wrote no result: the message carries its output's tail."""


@dataclass
class ClientResult:
    client: str
    model: str
    endpoint: str
    requests: int
    errors: int
    incomplete: int
    seconds: float
    requests_per_s: float
    output_tokens_per_s: float

    @property
    def failed(self) -> bool:
        return self.errors > 0 or self.incomplete > 0 or self.requests == 0


# -- the platform -------------------------------------------------------------------------------------------


@dataclass
class Platform:
    url: str
    api_key: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def platform(args: argparse.Namespace) -> Iterator[Platform]:
    """The gateway to benchmark: --url as given, or `loraplex up` started here and stopped (Ctrl-C, as a
    user stops it) when the benchmark ends."""
    if args.url:
        if not args.api_key:
            raise SystemExit("bench clients: --url needs --api-key (or LORAPLEX_API_KEY)")
        yield Platform(args.url.rstrip("/"), args.api_key)
        return
    port = _free_port()
    command = [
        sys.executable, "-m", "loraplex.cli.main", "up", "--port", str(port),
        "--data-dir", str(args.work_dir / "up"),
    ]  # fmt: skip
    log = (args.work_dir / "up.log").open("w")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        yield Platform(f"http://127.0.0.1:{port}", _read_banner(process, args.work_dir / "up.log"))
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def _read_banner(process: subprocess.Popen[str], log: Path, timeout_s: float = 600) -> str:
    """The demo tenant's API key, from the banner `loraplex up` prints once it serves."""
    assert process.stdout is not None
    deadline = time.monotonic() + timeout_s
    key = None
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            raise ClientFailed(f"loraplex up exited with status {process.wait()}:\n{tail}")
        if line.strip().startswith("API key"):
            key = line.split()[-1]
        if line.rstrip("\n") == BANNER_END and key is not None:
            return key
    raise ClientFailed(f"loraplex up did not print its banner in {timeout_s:.0f} s (see {log})")


# -- the clients --------------------------------------------------------------------------------------------


def _run_client(command: list[str], log: Path, env: dict[str, str] | None = None) -> None:
    with log.open("w") as out:
        done = subprocess.run(
            command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise ClientFailed(
            f"{Path(command[0]).name} exited with status {done.returncode} (log {log}):\n{tail}"
        )


def run_guidellm(
    executable: Path, target: Platform, model: str, endpoint: str, tokenizer: Path, args: argparse.Namespace
) -> ClientResult:
    out = args.work_dir / "results" / f"guidellm-{endpoint}-{_slug(model)}"
    out.mkdir(parents=True, exist_ok=True)
    report = out / "benchmarks.json"
    report.unlink(missing_ok=True)
    scenario = {
        "spec": {
            "backend": {
                "kind": "openai_http",
                "target": target.url,
                "model": model,
                "api_key": target.api_key,
                "request_format": f"/v1/{ENDPOINTS[endpoint]}",
            },
            "profile": {"kind": "concurrent", "streams": [args.concurrency]},
            "constraints": [{"kind": "max_requests", "count": args.requests}],
            "tokenizer": {"kind": "hf_auto", "model": str(tokenizer)},
            "data": [
                {
                    "kind": "synthetic_text",
                    "prompt_tokens": args.prompt_tokens,
                    "output_tokens": args.output_tokens,
                }
            ],
            "outputs": [{"kind": "json", "path": str(report)}],
        }
    }
    _write_private(out / "scenario.json", scenario)  # the key travels in the file, not in argv
    command = [
        str(executable),
        "run",
        "--scenario",
        str(out / "scenario.json"),
        "--disable-console-interactive",
    ]
    _run_client(
        command, out / "guidellm.log", {"GUIDELLM__LOGGING__LOG_FILE": str(out / "guidellm-debug.log")}
    )
    if not report.is_file():
        raise ClientFailed(f"guidellm wrote no {report.name} (log {out / 'guidellm.log'})")
    return parse_guidellm(json.loads(report.read_text()), model, endpoint)


def parse_guidellm(report: dict[str, Any], model: str, endpoint: str) -> ClientResult:
    """guidellm's benchmarks.json: its one benchmark's request totals and its own rate figures."""
    benchmark = report["benchmarks"][0]
    totals = benchmark["metrics"]["request_totals"]
    metrics = benchmark["metrics"]
    seconds = float(benchmark.get("duration") or 0.0)
    return ClientResult(
        client="guidellm",
        model=model,
        endpoint=endpoint,
        requests=int(totals["successful"]),
        errors=int(totals["errored"]),
        incomplete=int(totals["incomplete"]),
        seconds=seconds,
        requests_per_s=float(metrics["requests_per_second"]["successful"]["mean"]),
        output_tokens_per_s=float(metrics["output_tokens_per_second"]["successful"]["mean"]),
    )


def run_inference_perf(
    executable: Path, target: Platform, model: str, endpoint: str, tokenizer: Path, args: argparse.Namespace
) -> ClientResult:
    out = args.work_dir / "results" / f"inference-perf-{endpoint}-{_slug(model)}"
    reports = out / "reports"
    if reports.exists():
        for old in reports.glob("*.json"):
            old.unlink()
    reports.mkdir(parents=True, exist_ok=True)
    config = {
        "api": {"type": "chat" if endpoint == "chat" else "completion", "streaming": True},
        "server": {
            "type": "vllm",
            "model_name": model,
            "base_url": target.url,
            "api_key": target.api_key,
            "ignore_eos": True,
        },
        "tokenizer": {"pretrained_model_name_or_path": str(tokenizer)},
        "data": _inference_perf_data(endpoint, args),
        "load": {
            "type": "concurrent",
            "stages": [{"num_requests": args.requests, "concurrency_level": args.concurrency}],
        },
        "report": {"request_lifecycle": {"summary": True, "per_stage": False, "per_request": False}},
        "storage": {"local_storage": {"path": str(reports)}},
    }
    config_path = out / "config.yml"
    _write_private(config_path, config)  # JSON is YAML: no YAML writer needed here
    _run_client([str(executable), "--config_file", str(config_path)], out / "inference-perf.log")
    summary = reports / "summary_lifecycle_metrics.json"
    if not summary.is_file():
        raise ClientFailed(f"inference-perf wrote no {summary.name} (log {out / 'inference-perf.log'})")
    return parse_inference_perf(json.loads(summary.read_text()), model, endpoint)


def parse_inference_perf(summary: dict[str, Any], model: str, endpoint: str) -> ClientResult:
    """inference-perf's summary_lifecycle_metrics.json: successes, failures and its throughput figures."""
    successes, failures = summary["successes"], summary["failures"]
    throughput = successes["throughput"]
    return ClientResult(
        client="inference-perf",
        model=model,
        endpoint=endpoint,
        requests=int(successes["count"]),
        errors=int(failures["count"]),
        incomplete=0,
        seconds=float(summary.get("benchmark_time_seconds") or 0.0),
        requests_per_s=float(throughput["requests_per_sec"]),
        output_tokens_per_s=float(throughput["output_tokens_per_sec"]),
    )


def _inference_perf_data(endpoint: str, args: argparse.Namespace) -> dict[str, Any]:
    """Random token prompts for completions; for chat (which its random generator does not take),
    conversations whose system prompt (half the prompt) all requests share: the prefix cache's case."""
    if endpoint == "completions":
        return {
            "type": "random",
            "input_distribution": _fixed(args.prompt_tokens, args.requests),
            "output_distribution": _fixed(args.output_tokens, args.requests),
        }
    shared = args.prompt_tokens // 2
    return {
        "type": "shared_prefix",
        "shared_prefix": {
            "num_groups": 1,
            "num_prompts_per_group": args.requests,
            "system_prompt_len": shared,
            "question_len": args.prompt_tokens - shared,
            "output_len": args.output_tokens,
        },
    }


def _write_private(path: Path, value: dict[str, Any]) -> None:
    """JSON only its owner reads: it holds the tenant's API key."""
    path.unlink(missing_ok=True)
    path.touch(mode=0o600)
    path.write_text(json.dumps(value, indent=2))


def _fixed(tokens: int, count: int) -> dict[str, Any]:
    return {"type": "fixed", "min": tokens, "max": tokens, "mean": tokens, "std_dev": 0, "total_count": count}


def _slug(model: str) -> str:
    return model.replace("/", "--")


# -- the command --------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None, help="a running `loraplex up` (default: start one here)")
    parser.add_argument(
        "--api-key", default=os.environ.get("LORAPLEX_API_KEY"), help="its tenant API key (with --url)"
    )
    parser.add_argument(
        "--models",
        default=f"{DEMO_ADAPTER},{BASE_MODEL}",
        help=f"comma-separated models to load (default: {DEMO_ADAPTER},{BASE_MODEL})",
    )
    parser.add_argument("--clients", default="guidellm,inference-perf", help="which clients (default both)")
    parser.add_argument(
        "--endpoints", default="completions,chat", help="completions and/or chat (default both)"
    )
    parser.add_argument("--requests", type=int, default=16, help="requests per client and model (default 16)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=DEFAULT_ROOT,
        help=f"venvs, tokenizer, results (default {DEFAULT_ROOT})",
    )
    parser.add_argument("--python312", default=None, help="the Python 3.12+ for inference-perf's venv")
    parser.add_argument("--install-only", action="store_true", help="make the clients' venvs and stop")
    parser.add_argument("--json", action="store_true", help="also print one JSON line per result")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    args.work_dir = args.work_dir.resolve()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    unknown = set(clients) - {"guidellm", "inference-perf"}
    if unknown:
        raise SystemExit(f"bench clients: unknown client(s) {', '.join(sorted(unknown))}")
    try:
        executables = {
            "guidellm": guidellm_venv().ensure(args.work_dir) if "guidellm" in clients else None,
            "inference-perf": (
                inference_perf_venv(args.python312).ensure(args.work_dir)
                if "inference-perf" in clients
                else None
            ),
        }
    except SetupFailed as exc:
        print(f"bench clients: {exc}", file=sys.stderr)
        return 2
    if args.install_only:
        return 0
    tokenizer = _export_tokenizer(args.work_dir / "tokenizer")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    endpoints = [e.strip() for e in args.endpoints.split(",") if e.strip()]
    if set(endpoints) - set(ENDPOINTS):
        raise SystemExit(f"bench clients: --endpoints takes {' and '.join(ENDPOINTS)}")
    results: list[ClientResult] = []
    failures: list[str] = []
    runners = {"guidellm": run_guidellm, "inference-perf": run_inference_perf}
    with platform(args) as target:
        print(f"bench clients: {target.url}, tokenizer {tokenizer}", file=sys.stderr, flush=True)
        for client in clients:
            executable = executables[client]
            assert executable is not None
            for endpoint in endpoints:
                for model in models:
                    try:
                        results.append(runners[client](executable, target, model, endpoint, tokenizer, args))
                    except (ClientFailed, KeyError, IndexError, ValueError) as exc:
                        failures.append(f"{client} {endpoint} on {model}: {type(exc).__name__}: {exc}")
    _print(results, args)
    for r in results:
        if r.failed:
            failures.append(
                f"{r.client} {r.endpoint} on {r.model}: {r.errors} errors, {r.incomplete} incomplete"
            )
    for failure in failures:
        print(f"bench clients: FAILED {failure}", file=sys.stderr)
    return 1 if failures else 0


def _export_tokenizer(directory: Path) -> Path:
    from loraplex.engine.tokenizer_export import export_tokenizer, load_tokenizer

    tokenizer, context = load_tokenizer()
    return export_tokenizer(tokenizer, directory, context)


def _print(results: list[ClientResult], args: argparse.Namespace) -> None:
    print(
        f"# {args.requests} streaming completions per row at concurrency {args.concurrency}, "
        f"{args.prompt_tokens} prompt tokens, {args.output_tokens} output tokens"
    )
    columns = ("requests", "errors", "incompl", "seconds", "req/s", "out tok/s")
    print(f"{'client':<15} {'endpoint':<12} {'model':<36} " + " ".join(f"{c:>9}" for c in columns))
    for r in results:
        print(
            f"{r.client:<15} {r.endpoint:<12} {r.model:<36} {r.requests:>9} {r.errors:>9} {r.incomplete:>9} "
            f"{r.seconds:>9.1f} {r.requests_per_s:>9.2f} {r.output_tokens_per_s:>9.1f}"
        )
        if args.json:
            print(json.dumps(asdict(r)))
