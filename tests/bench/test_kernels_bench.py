"""The kernel benchmark's --small mode (on the CPU, in Triton's interpreter, where there is no GPU): every
case is timed, its floors are positive, its kernel was checked against the torch reference, the baseline
ran; and a kernel that computes a wrong result stops the benchmark instead of being timed."""

from __future__ import annotations

import argparse
import importlib
import json
from collections.abc import Callable
from typing import Any

import pytest

from loraplex.bench import kernels


def small_args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    kernels.add_arguments(parser)
    # One timed call and no warm-up: interpreted timings are not figures, and each call costs seconds.
    return parser.parse_args(["--small", "--device", "auto", "--repeats", "1", "--warmup", "0", *extra])


def test_small_mode_times_every_case_checked_with_floors_and_baseline(
    capsys: pytest.CaptureFixture[str],
) -> None:
    report = kernels.run_benchmarks(small_args())
    out = capsys.readouterr().out
    batches = [int(b) for b in kernels.SMALL_BATCHES.split(",")]
    kv_heads: tuple[int, ...] = kernels.SMALL["kv_heads"]
    expected = {
        (f"lora-{mode}", p, b)
        for mode in ("decode", "prefill")
        for p in kernels.POPULARITIES
        for b in batches
    }
    expected |= {("attention-decode", f"kv_heads={h}", b) for h in kv_heads for b in batches}
    assert {(r.case, r.variant, r.batch) for r in report.results} == expected
    assert len(report.results) == len(expected)
    assert report.copy_bandwidth > 0
    for r in report.results:
        assert r.flops > 0 and r.bytes_moved > 0, r
        assert r.checked, r
        assert r.baseline_checked and r.baseline_seconds is not None and r.baseline_seconds > 0, r
        assert r.kernel_seconds > 0 and r.speedup is not None and r.speedup > 0, r
        assert r.bandwidth_fraction > 0
        # Every case is a row of the markdown table, with its check and its baseline.
        row = f"| {r.case} | {r.variant} | {r.batch} | {r.tokens} | {r.flops:.3g} | {r.bytes_moved:.3g} |"
        line = next(line for line in out.splitlines() if line.startswith(row))
        assert line.endswith("| yes |") and r.baseline in line and "—" not in line, line
    if report.interpreted:
        assert out.count(kernels.INTERPRETER_NOTE) == 2  # before and after the figures


def test_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    kernels.run_benchmarks(small_args("--json", "--cases", "lora-decode", "--batch-sizes", "2"))
    document = json.loads(capsys.readouterr().out)  # progress and notes go to stderr
    assert [(r["case"], r["variant"]) for r in document["results"]] == [
        ("lora-decode", "distinct"),
        ("lora-decode", "zipf"),
    ]
    assert all(r["checked"] and r["speedup"] > 0 and r["bytes_per_second"] > 0 for r in document["results"])
    assert document["note"] == (kernels.INTERPRETER_NOTE if document["interpreted"] else "")


def _off_by_a_bit(real: Callable[..., Any], output_index: int | None) -> Callable[..., Any]:
    """`real`, but its result (returned, or argument `output_index` written in place) is nudged."""

    def wrong(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        target = result if output_index is None else args[output_index]
        target.view(-1)[0] += 1.0
        return result

    return wrong


@pytest.mark.parametrize(
    ("case", "module", "function", "output_index"),
    [
        ("lora-decode", "lora_expand", "lora_expand_tokens", 0),
        ("lora-prefill", "lora_shrink", "lora_shrink_segments", None),
        ("attention-decode", "paged_decode_attention", "paged_decode_attention", None),
    ],
)
def test_a_wrong_kernel_is_never_timed(
    case: str, module: str, function: str, output_index: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernels.prepare_triton(kernels.resolve_device("auto"))
    kernel_module = importlib.import_module(f"loraplex.engine.kernels.{module}")
    monkeypatch.setattr(
        kernel_module, function, _off_by_a_bit(getattr(kernel_module, function), output_index)
    )
    timed: list[object] = []
    real_median = kernels.median_seconds

    def counted(*args: Any, **kwargs: Any) -> float:
        timed.append(args)
        return real_median(*args, **kwargs)

    monkeypatch.setattr(kernels, "median_seconds", counted)
    with pytest.raises(AssertionError):
        kernels.run_benchmarks(small_args("--cases", case, "--batch-sizes", "2"))
    assert len(timed) == 1  # only the bandwidth copy
