"""The ahead-of-time gate (engine/aot.py): every kernel variant the engine launches compiles for
sm_80 and sm_90, with no register spill in 16-bit dtypes; and what recording and warm-up rely on.

The test suite runs the kernels under TRITON_INTERPRET=1 (tests/conftest.py), where `triton.jit` makes
interpreter functions that cannot be compiled for a GPU; so recording and compiling run in subprocesses
with TRITON_INTERPRET removed from their environment. Compiled reports are cached in
~/.cache/loraplex/aot (LORAPLEX_AOT_CACHE), which keeps the gate quick after its first run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from loraplex.engine.aot import Report, _usage, failures

KERNELS = {  # attention and LoRA: launched by every engine on the kernel path
    "_decode_kernel",
    "_merge_partitions_kernel",
    "_prefill_kernel",
    "_shrink_tokens_kernel",
    "_shrink_segments_kernel",
    "_expand_tokens_kernel",
    "_expand_segments_kernel",
}


def compiler_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # what triton 3.6 on the GPU machines does; no warning
    return env


def run_python(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], env=compiler_env(), capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
def test_every_variant_compiles_for_sm80_and_sm90_without_16_bit_spills(tmp_path: Path) -> None:
    out = tmp_path / "reports.json"
    done = run_python(["-m", "loraplex.engine.aot", "--json", str(out)], timeout=840)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-4000:]
    reports = [Report(**r) for r in json.loads(out.read_text())]
    assert {r.arch for r in reports} == {80, 90}
    assert {r.kernel.rsplit(":", 1)[1] for r in reports} >= KERNELS
    assert not failures(reports)
    assert all(r.registers > 0 for r in reports)  # every report holds ptxas' figures


RECORD = textwrap.dedent(
    """
    import json, sys, torch
    from loraplex.engine import aot, warmup
    from loraplex.engine.kernels.gpu import H100, A100

    import importlib, pkgutil
    from triton.runtime.jit import JITFunction
    import loraplex.engine.kernels as package
    kernel_modules = [f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__)]

    config = aot.MODELS["smollm2-135m"]
    gate = aot.record_variants(aot.gate_shapes(config, torch.bfloat16), H100)
    warm = warmup.variants(config, torch.bfloat16, 16, 256, H100)
    warm_48 = warmup.variants(config, torch.bfloat16, 16, 48, H100)  # a batch limit the gate never uses

    def shape(batch):
        return aot.StepShape(config, torch.bfloat16, decodes=batch, context=4000, rank=16)

    # Batches 5-7 launch with other split-K factors, partition counts and grids: no other variant.
    bucket = [aot.record_variants([shape(b)], A100) for b in (5, 6, 7)]
    print(json.dumps({
        "gate": [v.describe() for v in gate],
        "gate_keys": [repr(v) for v in gate],
        "warm_keys": [repr(v) for v in warm],
        "warm_48_keys": [repr(v) for v in warm_48],
        "bucket": [sorted(repr(v) for v in b) for b in bucket],
        "defined": sorted({
            f"{m.__name__}:{name}"
            for m in map(importlib.import_module, kernel_modules)
            for name, fn in vars(m).items()
            if isinstance(fn, JITFunction) and fn.fn.__module__ == m.__name__ and name.endswith("_kernel")
        }),
        "by_value": sorted({
            [n for n, _ in v.signature][path[0]]
            for v in gate
            for path, _ in v.constexprs
            if not aot._function(v.kernel).params[path[0]].is_constexpr
        }),
    }))
    """
)


@pytest.fixture(scope="module")
def recorded() -> dict[str, list]:
    done = run_python(["-c", RECORD], timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.slow
def test_warm_up_compiles_what_the_gate_compiles(recorded: dict[str, list]) -> None:
    assert recorded["warm_keys"] == recorded["gate_keys"]
    # Another max_num_seqs: fewer batch sizes, and nothing the gate did not compile.
    assert set(recorded["warm_48_keys"]) <= set(recorded["gate_keys"])
    assert {d.split("[")[0] for d in recorded["gate"]} >= KERNELS


# Kernels the engine's serving path does not launch (kept as standalone ops and tested as such).
NOT_LAUNCHED = {"loraplex.engine.kernels.write_kv:_write_kv_kernel"}


@pytest.mark.slow
def test_every_kernel_is_driven_by_the_gate(recorded: dict[str, list]) -> None:
    """A new @triton.jit kernel in engine/kernels that the gate never launches was left out of it: launch
    it from the code the drivers run, or add a driver (engine/aot.py, "Adding a kernel")."""
    launched = {key.split("kernel='")[1].split("'")[0] for key in recorded["gate_keys"]}
    missing = set(recorded["defined"]) - launched - NOT_LAUNCHED
    assert not missing, missing


@pytest.mark.slow
def test_no_variant_per_batch_size_layer_or_metadata_offset(recorded: dict[str, list]) -> None:
    """What changes from step to step (batch size, split-K, layer, where the step's metadata sit in
    its upload) is a runtime argument: it must not make triton compile another variant."""
    first, *others = recorded["bucket"]
    assert all(other == first for other in others)
    # Two variants alike in everything but argument attributes would be a runtime value specialized.
    assert len(set(recorded["gate"])) == len(recorded["gate"])
    # No runtime argument became a constexpr by value (== 1) but the unit strides of contiguous rows.
    assert set(recorded["by_value"]) <= {"stride_xk", "stride_yn", "stride_pp"}, recorded["by_value"]


def test_spills_fail_only_in_16_bit_variants_and_errors_always() -> None:
    ok = Report("m:k", "k[bf16]", 90, sixteen_bit=True, registers=64)
    spill16 = Report("m:k", "k[bf16]", 80, sixteen_bit=True, registers=255, spill_stores=8)
    spill32 = Report("m:k", "k[fp32]", 80, sixteen_bit=False, registers=255, spill_loads=4)
    broken = Report("m:k", "k[fp32]", 90, sixteen_bit=False, error="CompilationError: ...")
    assert failures([ok, spill32]) == []
    assert len(failures([ok, spill16, spill32, broken])) == 2


def test_ptxas_log_parsing() -> None:
    log = (
        "ptxas info    : Compiling entry function 'k' for 'sm_80'\n"
        "    16 bytes stack frame, 12 bytes spill stores, 8 bytes spill loads\n"
        "ptxas info    : Used 255 registers, used 0 barriers, 440 bytes cmem[0]\n"
    )
    assert _usage(log) == (255, 12, 8)
    with pytest.raises(RuntimeError, match="no register usage"):
        _usage("ptxas fatal   : Unresolved extern function")


def test_warm_up_does_nothing_off_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU (interpreter) engine starts without recording or compiling anything."""
    import torch

    from loraplex.engine import aot
    from loraplex.engine.warmup import warm_up

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("warm-up drove the kernels off CUDA")

    monkeypatch.setattr(aot, "capture", refuse)
    monkeypatch.setattr(aot, "record_variants", refuse)
    config = aot.MODELS["smollm2-135m"]
    assert warm_up(config, torch.float32, 16, 64, torch.device("cpu")) == 0
    assert warm_up(config, torch.float32, 16, 64, torch.device("meta")) == 0
