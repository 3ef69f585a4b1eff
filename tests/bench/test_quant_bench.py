"""bench/quant.py's llama.cpp side without llama.cpp: the checks that guard its LoRA rows, and the message
instead of a failure when llama-cpp-python is not built."""

from __future__ import annotations

import argparse
import sys

import pytest

from loraplex.bench import quant


def test_uppercase_ratio_counts_cased_letters_only() -> None:
    assert quant.uppercase_ratio(["ABC def", "12 !?"]) == pytest.approx(0.5)
    assert quant.uppercase_ratio(["OWLS EAT MICE, 3 A DAY."]) == 1.0


def test_common_prefix_fraction_is_the_mean_agreeing_start() -> None:
    ours = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert quant.common_prefix_fraction(ours, ours) == 1.0
    # the first reply agrees on 2 of 4 then parts (later matches do not count), the second not at all
    assert quant.common_prefix_fraction(ours, [[1, 2, 9, 4], [0, 6, 7, 8]]) == pytest.approx(0.25)


def test_without_llama_cpp_the_rows_say_how_to_build_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    parser = argparse.ArgumentParser()
    quant.add_arguments(parser)
    result = quant.llama_cpp_figures("unused.gguf", parser.parse_args([]), [[1, 2]], None)
    assert isinstance(result, str) and "make bench-deps" in result
