"""What a harness run must undo, written down as it is made, so that a run killed outright (SIGKILL, a CI
timeout) is cleaned up by the next one: `sweep()` removes the records of runs whose process is gone.

One JSON-lines file per run under /run/lpx-cluster/<pid>.jsonl: paths (temp dirs, mount points created on
the host) and daemons (Postgres, which pg_ctl detaches from us). Network namespaces and links carry the
pid in their names instead (network.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
from pathlib import Path

STATE_DIR = Path("/run/lpx-cluster")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Leftovers:
    def __init__(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        self.path = STATE_DIR / f"{os.getpid()}.jsonl"

    def path_made(self, path: Path) -> None:
        self._write({"path": str(path)})

    def daemon_started(self, pid: int, marker: str) -> None:
        """A detached process; `marker` must be in its command line for a sweep to kill it (pids recycle)."""
        self._write({"pid": pid, "marker": marker})

    def _write(self, record: dict[str, object]) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")

    def done(self) -> None:
        """The run cleaned up after itself."""
        self.path.unlink(missing_ok=True)


def sweep() -> list[str]:
    """Undo the records of every run whose process is gone; returns what was removed."""
    removed: list[str] = []
    if not STATE_DIR.is_dir():
        return removed
    for state in STATE_DIR.glob("*.jsonl"):
        if not state.stem.isdigit() or pid_alive(int(state.stem)):
            continue
        records = [json.loads(line) for line in state.read_text().splitlines() if line.strip()]
        for record in records:
            if "pid" in record and pid_alive(record["pid"]):
                with contextlib.suppress(OSError):
                    cmdline = (
                        Path(f"/proc/{record['pid']}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                    )
                    if record["marker"] in cmdline:
                        os.kill(record["pid"], signal.SIGKILL)
                        removed.append(f"pid {record['pid']}")
        # Deepest first: a mount point's parents were recorded after it.
        for record in sorted((r for r in records if "path" in r), key=lambda r: -len(Path(r["path"]).parts)):
            path = Path(record["path"])
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(str(path))
        state.unlink(missing_ok=True)
    return removed
