"""`loraplex up` as a newcomer runs it: a subprocess on free ports, the printed curl line and Python
snippet run as pasted, Ctrl-C stopping every process it started, and a second start reusing the data."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.readme import DEMO_CAPITALS, run_readme_snippets, uppercase_share

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

LORAPLEX = str(Path(sys.executable).with_name("loraplex"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def children_of(pid: int) -> set[int]:
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Up:
    """One `loraplex up` run: started, read until its banner is complete."""

    def __init__(self, data_dir: Path, *flags: str):
        self.port = free_port()
        self.process = subprocess.Popen(
            [LORAPLEX, "up", "--port", str(self.port), "--data-dir", str(data_dir), *flags],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        deadline = time.monotonic() + 300
        assert self.process.stdout is not None
        while (
            not self.lines
            or self.lines[-1] != "Ctrl-C stops everything; the next `loraplex up` keeps the data."
        ):
            line = self.process.stdout.readline()
            if not line:
                raise AssertionError(f"loraplex up ended early: {self.process.stderr.read()}")  # type: ignore[union-attr]
            self.lines.append(line.rstrip("\n"))
            assert time.monotonic() < deadline, "loraplex up did not print its banner in time"

    def block(self, name: str) -> str:
        start = self.lines.index(f"--- {name} ---")
        end = self.lines.index("--- end ---", start)
        return "\n".join(self.lines[start + 1 : end])

    def value(self, label: str) -> str:
        line = next(line for line in self.lines if line.strip().startswith(label))
        return line.split()[-1]

    def interrupt(self) -> int:
        self.process.send_signal(signal.SIGINT)
        return self.process.wait(60)


def test_up_serves_the_demo_and_stops_everything(tmp_path: Path) -> None:
    data = tmp_path / "data"
    first = Up(data)
    try:
        children = children_of(first.process.pid)
        assert children, "the engine should run as a child process"
        assert f"http://127.0.0.1:{first.port}" in first.lines[1]

        curl = subprocess.run(first.block("curl"), shell=True, capture_output=True, text=True, timeout=120)
        assert curl.returncode == 0, curl.stderr
        assert '"model":"demo-uppercase"' in curl.stdout.replace(" ", "")
        content = httpx.Response(200, content=curl.stdout).json()["choices"][0]["message"]["content"]
        assert uppercase_share(content) >= DEMO_CAPITALS, content

        snippet = tmp_path / "snippet.py"
        snippet.write_text(first.block("python"))
        python = subprocess.run([sys.executable, str(snippet)], capture_output=True, text=True, timeout=120)
        assert python.returncode == 0, python.stderr
        assert uppercase_share(python.stdout) >= DEMO_CAPITALS, python.stdout

        run_readme_snippets(first.port, first.value("API key"), tmp_path)

        console = httpx.get(f"http://127.0.0.1:{first.port}/console/sign-in")
        assert console.status_code == 200 and "Sign in" in console.text
        key, password = first.value("API key"), first.value("console")
    finally:
        code = first.interrupt()
    assert code == 0
    assert not any(alive(pid) for pid in children), "a process started by loraplex up outlived it"

    # The second start proves the data is reused; the first ran `up`'s defaults, compiled decode included.
    second = Up(data, "--no-compile-decode")
    try:
        assert second.value("API key") == key and second.value("console") == password  # the same demo, reused
        admin = second.lines[6].split()[-1]
        tenants = httpx.get(
            f"http://127.0.0.1:{second.port}/admin/v1/tenants", headers={"Authorization": f"Bearer {admin}"}
        ).json()
        assert [t["name"] for t in tenants] == ["demo"]
        reply = httpx.post(
            f"http://127.0.0.1:{second.port}/v1/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": "demo-uppercase", "prompt": "Hello", "max_tokens": 4},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
    finally:
        assert second.interrupt() == 0


def test_up_refuses_a_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [LORAPLEX, "up", "--port", str(port), "--data-dir", str(tmp_path)],
            capture_output=True, text=True, timeout=60, env={**os.environ},
        )  # fmt: skip
    assert result.returncode == 2 and "in use" in result.stderr
