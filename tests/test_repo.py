"""The layout promises of ARCHITECTURE.md: one namespace, and `operator/` never hides the stdlib."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_in_root(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_json_tool_works_from_the_repo_root() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "json.tool"], cwd=ROOT, input='{"a": [1, 2]}', capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert '"a"' in result.stdout


def test_import_operator_is_the_standard_library() -> None:
    result = run_in_root("-c", "import operator; print(operator.__file__); print(operator.add(2, 3))")
    assert result.returncode == 0, result.stderr
    location, total = result.stdout.split()
    assert Path(location).parent == Path(sysconfig.get_paths()["stdlib"])
    assert total == "5"


def test_operator_folder_has_no_top_level_init() -> None:
    assert (ROOT / "operator").is_dir()
    assert not (ROOT / "operator" / "__init__.py").exists()


def test_folders_map_into_one_namespace() -> None:
    code = (
        "import loraplex.engine, loraplex.adapters, loraplex.web, loraplex.operator\n"
        "import loraplex.cli, loraplex.bench\n"
        "import pathlib\n"
        "print(pathlib.Path(loraplex.engine.__file__).parent.name)\n"
        "print(list(loraplex.operator.__path__)[0])"
    )
    result = run_in_root("-c", code)
    assert result.returncode == 0, result.stderr
    engine_dir, operator_dir = result.stdout.split()
    assert engine_dir == "engine"
    assert Path(operator_dir).resolve() == (ROOT / "operator").resolve()


def test_bookkeeping_imports_without_torch() -> None:
    code = "import sys, loraplex.engine.scheduler, loraplex.engine.pool; print('torch' in sys.modules)"
    result = run_in_root("-c", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_every_package_is_listed_for_wheels() -> None:
    """An editable install finds every folder; a wheel only has what pyproject's `packages` lists."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = {folder: name for name, folder in config["package-dir"].items()}
    listed = set(config["packages"])
    for init in ROOT.glob("*/**/__init__.py"):
        folder = init.parent.relative_to(ROOT)
        top = folder.parts[0]
        if top not in mapped:
            continue
        name = ".".join([mapped[top], *folder.parts[1:]])
        assert name in listed, f"{folder} is a package missing from pyproject's packages ({name})"


def test_docs_point_only_inside_the_repository() -> None:
    """Every relative link or path the docs name stays in the repository: a reader of a clone (or of the
    wheel's sdist) has nothing else."""
    import re

    root = Path(__file__).resolve().parents[1]
    outside = []
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        text = doc.read_text()
        targets = re.findall(r"\]\(([^)\s#]+)", text) + re.findall(r"`(\.\./[^`\s]+)`", text)
        for target in targets:
            if re.match(r"[a-z]+:", target):
                continue  # a URL
            resolved = (doc.parent / target).resolve()
            if root not in resolved.parents and resolved != root:
                outside.append(f"{doc.relative_to(root)}: {target}")
    assert not outside, outside
