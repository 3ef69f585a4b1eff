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
    check = quant.ReplyCheck([[1]], [[2]], str)
    result = quant.llama_cpp_figures("unused.gguf", parser.parse_args([]), [[1, 2]], check, None)
    assert isinstance(result, str) and "make bench-deps" in result


class ScriptedRun:
    """A llama.cpp run that answers every prompt with the replies it was given."""

    def __init__(self, replies: list[list[int]]):
        self.replies = replies

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        assert len(prompts) == len(self.replies)
        return self.replies


LETTERS = {1: "OWLS ", 2: "EAT ", 3: "mice ", 4: "garbage "}


def decode(tokens: list[int]) -> str:
    return "".join(LETTERS[t] for t in tokens)


def test_replies_that_agree_with_loraplex_pass_and_say_so() -> None:
    check = quant.ReplyCheck([[9], [9]], [[1, 2, 1, 2], [2, 2, 1, 1]], decode)
    notes: list[str] = []
    assert quant.checked_replies(ScriptedRun([[1, 2, 1, 2], [2, 2, 4, 4]]), check, "base", notes)
    assert "mean common prefix 75%, 1 of 2 replies identical" in notes[0] and "FAILED" not in notes[0]


def test_garbage_replies_fail_the_check_and_are_printed() -> None:
    # What a miscompiled build gives: fast, fluent-looking tokens that part from loraplex's at once.
    check = quant.ReplyCheck([[9], [9]], [[1, 2, 1, 2], [2, 2, 1, 1]], decode)
    notes: list[str] = []
    assert not quant.checked_replies(ScriptedRun([[4, 4, 4, 4], [1, 2, 2, 2]]), check, "base", notes)
    assert "FAILED" in notes[0] and "garbage" in notes[0]


def test_the_adapter_check_also_wants_capitals() -> None:
    check = quant.ReplyCheck([[9]], [[3, 3, 3, 3]], decode)  # agreement alone is not enough
    notes: list[str] = []
    assert not quant.checked_replies(ScriptedRun([[3, 3, 3, 3]]), check, "demo", notes, capitals=0.9)
    assert "0.0% of reply letters capitals" in notes[0]
    assert quant.checked_replies(ScriptedRun([[3, 3, 3, 3]]), check, "base", [])
