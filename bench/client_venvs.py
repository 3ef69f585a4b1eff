"""The benchmark clients' own virtual environments, under build/bench-clients/ (never the project's venv).

guidellm and inference-perf are heavy (datasets, pandas, pyarrow, sanic, aiohttp ...) and bring packages
that change how the project's own servers run when they share an interpreter: uvloop and httptools are
picked up by uvicorn's "auto" settings. So each gets a venv of its own, made on first use:

- guidellm 0.8.1 needs torch: its venv uses this interpreter's Python (3.11), where the CPU build of torch
  2.13.0 is installed first and pinned by constraints-cpu.txt (anything else pulls a CUDA build);
- inference-perf 0.7.0 needs Python 3.12 or newer and no torch: its venv uses the first such interpreter
  found (newer_python), or --python312.

A venv is made once and reused while its stamp names the same packages; `make bench-clients-deps` makes
both.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONSTRAINTS = REPO / "constraints-cpu.txt"
DEFAULT_ROOT = REPO / "build" / "bench-clients"
GUIDELLM = "guidellm==0.8.1"
INFERENCE_PERF = "inference-perf==0.7.0"
TORCH = "torch==2.13.0"


class SetupFailed(RuntimeError):
    """A client's venv could not be made: the message says which step and what to do."""


@dataclass(frozen=True)
class ClientVenv:
    """One client's venv: the interpreter it is made with, what it installs (in order), its command."""

    name: str
    python: str
    installs: tuple[tuple[str, ...], ...]
    command: str

    def path(self, root: Path) -> Path:
        return root / self.name

    def executable(self, root: Path) -> Path:
        return self.path(root) / "bin" / self.command

    def ready(self, root: Path) -> bool:
        stamp = self.path(root) / ".installed"
        return self.executable(root).is_file() and stamp.is_file() and stamp.read_text() == self._stamp()

    def _stamp(self) -> str:
        return "\n".join([self.python, *(" ".join(step) for step in self.installs)]) + "\n"

    def ensure(self, root: Path, say: bool = True) -> Path:
        """The client's command, installing its venv first when it is missing or stale."""
        if self.ready(root):
            return self.executable(root)
        venv = self.path(root)
        if venv.exists():
            shutil.rmtree(venv)
        if say:
            print(
                f"bench clients: making {venv} with {self.python} (minutes, once)",
                file=sys.stderr,
                flush=True,
            )
        _run([self.python, "-m", "venv", str(venv)], f"making the {self.name} venv")
        pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "-q", "install"]
        for step in self.installs:
            _run([*pip, *step], f"installing {' '.join(step)} into {venv}")
        (venv / ".installed").write_text(self._stamp())
        return self.executable(root)


def _run(command: list[str], what: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        raise SetupFailed(f"{what} failed (exit {done.returncode}):\n{tail}")


def guidellm_venv() -> ClientVenv:
    # torch first and alone, exactly pinned, so guidellm's bare `torch` requirement finds it installed.
    constraints = ("-c", str(CONSTRAINTS))
    # The interpreter the project's venv was made from (CPython's sys._base_executable), so the CPU torch pin
    # resolves as it did for the project; sys.executable is the project's venv itself.
    python = str(getattr(sys, "_base_executable", sys.executable))
    return ClientVenv("guidellm", python, ((*constraints, TORCH), (*constraints, GUIDELLM)), "guidellm")


def inference_perf_venv(python312: str | None = None) -> ClientVenv:
    python = python312 or newer_python()
    return ClientVenv("inference-perf", python, ((INFERENCE_PERF,),), "inference-perf")


def newer_python() -> str:
    """A Python 3.12+ interpreter (inference-perf needs one): python3.12 or python3.13 on PATH, else the
    oldest such that pyenv holds, else python3; each asked for its version, since a pyenv shim of a version
    not selected exists but does not run. SetupFailed naming what to install."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates = [shutil.which(name) for name in ("python3.12", "python3.13")]
    candidates += [str(p) for p in sorted(pyenv.glob("3.*/bin/python3"))]
    candidates.append(shutil.which("python3"))
    for candidate in candidates:
        if candidate is not None and _is_312_or_newer(candidate):
            return candidate
    raise SetupFailed(
        "inference-perf 0.7.0 needs Python 3.12 or newer and none was found (python3.13, python3.12, "
        "pyenv's versions, python3): install one, or pass --python312 PATH"
    )


def _is_312_or_newer(python: str) -> bool:
    try:
        done = subprocess.run(
            [python, "-c", "import sys; print(sys.version_info >= (3, 12))"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and done.stdout.strip() == "True"
