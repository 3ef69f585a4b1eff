"""`loraplex serve` as Kubernetes runs it: a process, settings from LORAPLEX_* variables, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.readme import run_readme_snippets

from .conftest import BASE, DEMO_ADAPTER, free_port

LORAPLEX = str(Path(sys.executable).parent / "loraplex")


class StreamReader(threading.Thread):
    """Reads one SSE completion stream to its end (or until the server cuts it)."""

    def __init__(self, url: str, max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.events: list[str] = []
        self.first = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"model": BASE, "prompt": "Once upon a time", "max_tokens": self.max_tokens, "stream": True}
        try:
            with httpx.stream(
                "POST", f"{self.url}/v1/completions", json={**body, "ignore_eos": True}, timeout=60
            ) as r:
                if r.status_code != 200:
                    raise AssertionError(f"{r.status_code}: {r.read().decode()}")
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        self.first.set()
        except (httpx.HTTPError, AssertionError) as exc:
            self.error = exc
        finally:
            self.first.set()

    @property
    def completed(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"

    def finish_reason(self) -> str | None:
        reasons = [json.loads(e)["choices"][0]["finish_reason"] for e in self.events if e != "[DONE]"]
        return reasons[-1] if reasons else None


@pytest.mark.slow
def test_serve_runs_the_readme_snippets_then_sigterm_drains_within_a_bound(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "LORAPLEX_DEVICE": "cpu",
        "LORAPLEX_NUM_PAGES": "128",
        "LORAPLEX_MAX_NUM_SEQS": "4",
        "LORAPLEX_DRAIN_TIMEOUT_S": "6",
        "LORAPLEX_MODEL_FORMAT": "gguf",  # the operator's ConfigMap carries variables serve does not use
        "LORAPLEX_CONTROL_PLANE_URL": "http://control-plane",
        # As the engine image runs it: a CUDA image never compiles the CPU decode step (issue 30), which
        # test_up runs end to end with serve's defaults; here a cold compile would be 50-70 CPU-s.
        "LORAPLEX_COMPILE_DECODE": "false",
    }
    command = [LORAPLEX, "serve", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"]
    process = subprocess.Popen(
        [*command, "--adapter", f"demo-uppercase={DEMO_ADAPTER}"],  # the README's adapter, by its name
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, process.communicate()[0]
            assert time.monotonic() < deadline, "the server never became ready"
            try:
                if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
        assert "\nloraplex_pool_pages_total 128.0" in metrics  # LORAPLEX_NUM_PAGES reached the engine
        assert "demo-uppercase" in httpx.get(f"{url}/v1/models", timeout=5).text
        # The README's snippets as printed (tests/test_up.py runs them against `loraplex up`): without a
        # token the engine ignores the API key, and streams end as OpenAI's, with usage only when asked.
        run_readme_snippets(port, "lpx_...", tmp_path)

        short, endless = StreamReader(url, 12), StreamReader(url, 1500)
        for reader in (short, endless):
            reader.start()
            assert reader.first.wait(60) and reader.events, reader.error
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)

        short.join(60)
        assert short.completed and short.finish_reason() == "length"  # a running request finished
        assert process.wait(timeout=60) == 0
        drained_in = time.monotonic() - signalled
        endless.join(10)
        assert not endless.completed  # cut off at the bound, not run to its 1500 tokens
        assert 5 <= drained_in < 30
        output = process.communicate()[0]
        assert "draining" in output
        assert "decode eager" in output  # LORAPLEX_COMPILE_DECODE=false reached the engine
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_serve_refuses_bad_settings_clearly() -> None:
    result = subprocess.run(
        [LORAPLEX, "serve", "--adapter", "missing-equals-sign"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "NAME=PATH_OR_URI" in result.stderr
