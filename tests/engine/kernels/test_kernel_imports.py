"""What the kernels and the batch layout depend on: engine/kernels/ on torch, triton and the standard
library only (so a kernel can be read, tested and reused alone); engine/batch.py on nothing of the
engine; attention.py and lora/step.py on the batch, never on the runner (no cycle held apart by
TYPE_CHECKING)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[3] / "engine"


def imports_of(path: Path) -> list[tuple[int, str, int]]:
    """(line, module, relative level) of every import in a file, nested and TYPE_CHECKING ones included."""
    found: list[tuple[int, str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name, 0) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, node.module or "", node.level))
    return found


def test_kernels_import_only_torch_triton_and_the_standard_library() -> None:
    allowed = {"torch", "triton", *sys.stdlib_module_names}
    kernels = sorted((ENGINE / "kernels").glob("*.py"))
    assert len(kernels) >= 8
    offenders = []
    for path in kernels:
        for line, module, level in imports_of(path):
            top = module.split(".")[0]
            inside = level == 1 and (not module or (ENGINE / "kernels" / f"{top}.py").exists())
            if not (inside or (level == 0 and top in allowed)):
                offenders.append(f"{path.name}:{line} imports {'.' * level}{module}")
    assert offenders == []


def test_the_checker_sees_an_engine_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import typing\nif typing.TYPE_CHECKING:\n    from ..lora.layout import GROUPS\n")
    assert (3, "lora.layout", 2) in imports_of(bad)


def test_attention_and_lora_step_read_only_the_batch_of_the_runner_side() -> None:
    for path in (ENGINE / "attention.py", ENGINE / "lora" / "step.py", ENGINE / "batch.py"):
        modules = {module.split(".")[-1] for _, module, level in imports_of(path) if level}
        assert not modules & {"runner", "scheduler", "engine", "residency", "registry", "loader"}, path


def test_importing_the_batch_imports_nothing_else_of_the_engine() -> None:
    script = (
        "import sys\n"
        "import loraplex.engine.batch\n"
        "ours = sorted(m for m in sys.modules if m.startswith('loraplex.'))\n"
        "assert ours == ['loraplex.engine', 'loraplex.engine.batch'], ours\n"
        "import loraplex.engine.attention, loraplex.engine.lora.step\n"
        "for name in ('runner', 'scheduler', 'engine', 'lora.residency'):\n"
        "    assert 'loraplex.engine.' + name not in sys.modules, name\n"
        "assert 'triton' not in sys.modules  # the CPU path never pays for importing Triton\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
