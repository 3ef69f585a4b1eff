"""The operator as a real process (`python -m kopf run -m loraplex.operator.main ...`) against the
pretend cluster, as the chart's pod runs it: for the tests that stop, kill or double it.

Each process has its own kubeconfig token, so the API emulator's `calls` tell the processes apart.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.operator.cluster import NAMESPACE, Cluster, wait_for
from tests.operator.helpers import ROOT

PEERING = "loraplex-operator"


class OperatorProcess:
    def __init__(
        self,
        cluster: Cluster,
        workdir: Path,
        name: str,
        peering: bool = True,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name  # also its bearer token and its kopf identity (POD_ID)
        self.log_path = workdir / f"{name}.log"
        kubeconfig = workdir / f"{name}.kubeconfig"
        kubeconfig.write_text(json.dumps(_kubeconfig(cluster.url, token=name)))
        argv = [
            sys.executable,
            "-m",
            "kopf",
            "run",
            "-m",
            "loraplex.operator.main",
            "-m",
            "tests.operator.kopf_in_emulator",
            f"--namespace={NAMESPACE}",
            f"--peering={PEERING}" if peering else "--standalone",
            "--verbose",
        ]
        environ = {
            **os.environ,
            "KUBECONFIG": str(kubeconfig),
            "POD_ID": name,
            # Whatever path the test run has, then the checkout (for `-m tests.operator.kopf_in_emulator`).
            "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)])),
            "LORAPLEX_OPERATOR_RESYNC_SECONDS": "1",
            "LORAPLEX_OPERATOR_AUTOSCALE_SECONDS": "1",
            "LORAPLEX_OPERATOR_PEERING_LIFETIME_SECONDS": "3",
            "LORAPLEX_OPERATOR_ALLOWED_SECRETS": f"{NAMESPACE}/loraplex-*",
            **(env or {}),
        }
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            argv, cwd=ROOT, env=environ, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, text: str, timeout: float = 60.0) -> None:
        def seen() -> bool:
            found = text in self.log()
            assert found or self.process.poll() is None, self._died()
            return found

        wait_for(seen, timeout=timeout, what=f"{self.name} to log {text!r}")

    def peering_state(self) -> str:
        """kopf's last peering decision, from its log: "active", "paused", or "waiting" before any.

        kopf starts every peered operator paused and logs only changes: one that sees a higher priority at
        its first look stays paused without a word, one that did not logs "Resuming" and, once it sees the
        other, "Pausing ... in favour of".
        """
        log = self.log()
        resumed = log.rfind("Resuming operations after the pause")
        paused = log.rfind("Pausing operations in favour of")
        if resumed < 0 and paused < 0:
            return "waiting"
        return "active" if resumed > paused else "paused"

    def wait_for_peering_state(self, *states: str, timeout: float = 60.0) -> str:
        def reached() -> str | None:
            assert self.process.poll() is None, self._died()
            state = self.peering_state()
            return state if state in states else None

        result = wait_for(reached, timeout=timeout, what=f"{self.name} to be {' or '.join(states)}")
        assert result is not None  # wait_for returns only a truthy value
        return result

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send `sig` and wait for the exit; SIGKILL if it does not come within `timeout`."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
                raise AssertionError(f"{self.name} did not exit within {timeout}s of {sig.name}") from None
        self._log.close()
        return int(self.process.returncode)

    def _died(self) -> str:
        return f"{self.name} exited with {self.process.returncode}:\n{self.log()[-4000:]}"


def _kubeconfig(url: str, token: str) -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "fake", "cluster": {"server": url}}],
        "users": [{"name": token, "user": {"token": token}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": token, "namespace": NAMESPACE}}],
        "current-context": "fake",
    }
