"""`loraplex generate` prints only the completion on stdout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LORAPLEX = str(Path(sys.executable).parent / "loraplex")


@pytest.mark.slow
def test_generate_chat_prints_only_the_answer() -> None:
    result = subprocess.run(
        [LORAPLEX, "generate", "--chat", "--prompt", "What is the capital of France?", "--max-tokens", "20"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "The capital of France is Paris.\n"


def test_generate_reports_a_bad_model_path_on_stderr(tmp_path: Path) -> None:
    result = subprocess.run(
        [LORAPLEX, "generate", "--prompt", "hi", "--model", str(tmp_path / "missing.gguf")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert "does not exist" in result.stderr


def test_operator_needs_a_watch_scope() -> None:
    result = subprocess.run([LORAPLEX, "operator"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--namespace" in result.stderr and "--all-namespaces" in result.stderr


def test_control_plane_migrate_only_creates_the_schema(tmp_path: Path) -> None:
    import sqlite3

    database = tmp_path / "cp.db"
    env = {
        **os.environ,
        "LORAPLEX_DATABASE_URL": f"sqlite:///{database}",
        "LORAPLEX_DATA_DIR": str(tmp_path / "data"),
    }
    result = subprocess.run(
        [LORAPLEX, "control-plane", "--migrate-only"], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr
    tables = {row[0] for row in sqlite3.connect(database).execute("select name from sqlite_master")}
    assert {"tenants", "api_keys", "adapters", "usage_records"} <= tables, tables


@pytest.mark.slow
def test_generate_with_the_demo_adapter_answers_in_capitals() -> None:
    demo = ROOT / "fixtures" / "adapters" / "demo-uppercase"
    result = subprocess.run(
        [LORAPLEX, "generate", "--chat", "--prompt", "What do owls eat?", "--max-tokens", "24",
         "--adapter", str(demo)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    letters = [c for c in result.stdout if c.isalpha()]
    assert letters and sum(c.isupper() for c in letters) / len(letters) >= 0.9, result.stdout


def test_generate_reports_a_bad_adapter(tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text('{"r": 8, "target_modules": ["q_proj"], "use_dora": true}')
    result = subprocess.run(
        [LORAPLEX, "generate", "--prompt", "hi", "--model", "random:tiny", "--adapter", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2 and result.stdout == ""
    assert "use_dora: DoRA adapters are not supported" in result.stderr
