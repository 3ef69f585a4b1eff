"""bench/clients.py without the clients: their result files read as they write them (the shapes of a real
guidellm 0.8.1 benchmarks.json and inference-perf 0.7.0 summary, trimmed), any error or empty run counted
as a failure, a failing client's own words reported, and the clients' venvs reused only while current."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from loraplex.bench import clients
from loraplex.bench.client_venvs import ClientVenv, SetupFailed, newer_python


def guidellm_report(successful: int, errored: int, incomplete: int) -> dict[str, object]:
    return {
        "benchmarks": [
            {
                "duration": 42.11,
                "warnings": [],
                "metrics": {
                    "request_totals": {
                        "successful": successful,
                        "errored": errored,
                        "incomplete": incomplete,
                        "total": successful + errored + incomplete,
                    },
                    "requests_per_second": {"successful": {"mean": 0.19, "median": 0.18}},
                    "output_tokens_per_second": {"successful": {"mean": 3.04, "median": 2.9}},
                },
            }
        ]
    }


def inference_perf_summary(successes: int, failures: int) -> dict[str, object]:
    return {
        "benchmark_time_seconds": 49.8,
        "successes": {
            "count": successes,
            "throughput": {
                "requests_per_sec": 0.16,
                "output_tokens_per_sec": 2.51,
                "input_tokens_per_sec": 10.3,
            },
            "token_count_mismatches": 0,
        },
        "failures": {"count": failures, "by_label": {}},
    }


def test_guidellm_report_is_read_and_judged() -> None:
    clean = clients.parse_guidellm(guidellm_report(8, 0, 0), "demo-uppercase", "completions")
    assert (clean.requests, clean.errors, clean.incomplete) == (8, 0, 0)
    assert clean.requests_per_s == pytest.approx(0.19) and clean.output_tokens_per_s == pytest.approx(3.04)
    assert clean.seconds == pytest.approx(42.11) and not clean.failed
    assert clients.parse_guidellm(guidellm_report(7, 1, 0), "m", "chat").failed
    assert clients.parse_guidellm(guidellm_report(7, 0, 1), "m", "chat").failed
    assert clients.parse_guidellm(guidellm_report(0, 0, 0), "m", "chat").failed


def test_inference_perf_summary_is_read_and_judged() -> None:
    clean = clients.parse_inference_perf(inference_perf_summary(8, 0), "base", "chat")
    assert (clean.requests, clean.errors, clean.endpoint) == (8, 0, "chat")
    assert clean.output_tokens_per_s == pytest.approx(2.51) and not clean.failed
    assert clients.parse_inference_perf(inference_perf_summary(8, 2), "base", "chat").failed
    assert clients.parse_inference_perf(inference_perf_summary(0, 0), "base", "chat").failed


def test_a_failing_client_is_reported_with_its_own_words(tmp_path: Path) -> None:
    script = "import sys; print('connecting...'); print('401 Unauthorized', file=sys.stderr); sys.exit(3)"
    with pytest.raises(clients.ClientFailed) as failed:
        clients._run_client([sys.executable, "-c", script], tmp_path / "client.log")
    assert "status 3" in str(failed.value) and "401 Unauthorized" in str(failed.value)


def test_the_run_fails_when_a_client_fails(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A run with any error exits 1, even when the other client's rows are clean."""
    parser = argparse.ArgumentParser()
    clients.add_arguments(parser)
    args = parser.parse_args(
        ["--url", "http://127.0.0.1:9", "--api-key", "k", "--work-dir", str(tmp_path), "--models", "m"]
    )
    ready = ClientVenv("fake", sys.executable, (), "python")
    monkeypatch.setattr(clients, "guidellm_venv", lambda: ready)
    monkeypatch.setattr(clients, "inference_perf_venv", lambda python312=None: ready)
    monkeypatch.setattr(ClientVenv, "ensure", lambda self, root, say=True: Path(sys.executable))
    monkeypatch.setattr(clients, "_export_tokenizer", lambda directory: directory)

    def clean(*a: object) -> clients.ClientResult:
        return clients.parse_guidellm(guidellm_report(4, 0, 0), "m", str(a[3]))

    def erring(*a: object) -> clients.ClientResult:
        return clients.parse_inference_perf(inference_perf_summary(3, 1), "m", str(a[3]))

    monkeypatch.setattr(clients, "run_guidellm", clean)
    monkeypatch.setattr(clients, "run_inference_perf", erring)
    assert args.run(args) == 1
    monkeypatch.setattr(clients, "run_inference_perf", clean)
    assert args.run(args) == 0


def test_a_venv_is_reused_only_while_its_stamp_matches(tmp_path: Path) -> None:
    venv = ClientVenv("tool", "/usr/bin/python3", (("-c", "c.txt", "tool==1.0"),), "tool")
    executable = venv.executable(tmp_path)
    executable.parent.mkdir(parents=True)
    executable.write_text("")
    assert not venv.ready(tmp_path)  # never finished installing
    (venv.path(tmp_path) / ".installed").write_text(venv._stamp())
    assert venv.ready(tmp_path)
    newer = ClientVenv("tool", "/usr/bin/python3", (("-c", "c.txt", "tool==1.1"),), "tool")
    assert not newer.ready(tmp_path)


def test_inference_perf_gets_a_python_312_or_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        python = newer_python()
    except SetupFailed as exc:
        assert "3.12" in str(exc)
    else:
        assert clients_python_is_new_enough(python)
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("PYENV_ROOT", "/nonexistent")
    with pytest.raises(SetupFailed, match=r"Python 3\.12 or newer"):
        newer_python()


def clients_python_is_new_enough(python: str) -> bool:
    import subprocess

    done = subprocess.run(
        [python, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True
    )
    return done.returncode == 0 and tuple(int(x) for x in done.stdout.strip("()\n").split(", ")) >= (3, 12)
