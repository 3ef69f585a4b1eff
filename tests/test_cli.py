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
    config = '{"r": 8, "target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}'
    (tmp_path / "adapter_config.json").write_text(config)
    result = subprocess.run(
        [LORAPLEX, "generate", "--prompt", "hi", "--model", "random:tiny", "--adapter", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2 and result.stdout == ""
    assert "modules_to_save: fully trained extra modules are not supported" in result.stderr


# --- engine options: one refusal at every door (tests/engine/test_config.py covers every option) ---------


def run_loraplex(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    variables = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    return subprocess.run(
        [LORAPLEX, *argv], capture_output=True, text=True, timeout=120, env={**variables, **env}
    )


REFUSAL = "max_num_seqs must be an integer of 1 or more, got 0"


def test_serve_refuses_a_bad_flag_or_variable_in_one_line() -> None:
    for result, line in (
        (run_loraplex("serve", "--max-num-seqs", "0"), f"loraplex serve: {REFUSAL}"),
        (
            run_loraplex("serve", LORAPLEX_MAX_NUM_SEQS="0"),
            f"loraplex serve: LORAPLEX_MAX_NUM_SEQS=0: {REFUSAL}",
        ),
        (run_loraplex("serve", "--num-pagse", "8"), "loraplex serve: unrecognized arguments: --num-pagse 8"),
    ):
        assert (result.returncode, result.stdout, result.stderr) == (2, "", line + "\n")


def test_generate_and_up_refuse_a_bad_engine_flag() -> None:
    for argv in (("generate", "--prompt", "hi", "--max-num-seqs", "0"), ("up", "--max-num-seqs", "0")):
        result = run_loraplex(*argv)
        assert result.returncode == 2 and result.stdout == ""
        assert f"argument --max-num-seqs: {REFUSAL}" in result.stderr, result.stderr


@pytest.mark.slow
def test_generate_passes_engine_flags_to_the_engine() -> None:
    # One request, prefilled 4 tokens per step on a 16-page pool of 4-token pages: the same answer as
    # with the defaults; a pool too small for the prompt is refused by the engine, so the flags arrived.
    chat = ("generate", "--chat", "--prompt", "What is the capital of France?", "--max-tokens", "20")
    small = ("--max-num-seqs", "1", "--max-batch-tokens", "4", "--page-size", "4", "--kernels", "torch")
    result = run_loraplex(*chat, *small, "--num-pages", "16", "--device", "cpu", "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "The capital of France is Paris.\n"
    tiny = run_loraplex(*chat, *small, "--num-pages", "3", "--device", "cpu")
    assert tiny.returncode == 2 and "pool has 2" in tiny.stderr, tiny.stderr
