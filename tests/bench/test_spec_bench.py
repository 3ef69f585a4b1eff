"""bench spec's workload and flags (the timed run itself is the bench's, not the suite's)."""

from __future__ import annotations

import argparse

from loraplex.bench.spec import DEFAULT_KINDS, KINDS, add_arguments, workload


def test_the_workload_is_seeded_and_cycles_through_its_kinds() -> None:
    chats = workload(8, seed=3, kinds=KINDS)
    assert chats == workload(8, seed=3, kinds=KINDS) and chats != workload(8, seed=4, kinds=KINDS)
    asks = [chat[-1]["content"].split(":")[0] for chat in chats]
    assert asks[:4] == ["Correct the mistakes", "Replace every '" + asks[1].split("'")[1] + "' with '"
                        + asks[1].split("'")[3] + "' in", "Correct the spelling in this list",
                        "Fix the typo in this code"]  # fmt: skip
    assert all(chat[0]["role"] == "system" for chat in chats)
    assert len(workload(5, seed=0)) == 5 and DEFAULT_KINDS == ("spelling", "replace", "list")


def test_flags() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["-k", "4", "--ngram-min", "2", "--json"])
    assert (args.k, args.ngram_min, args.ngram_max, args.json, args.kinds) == (
        4,
        2,
        3,
        True,
        "spelling,replace,list",
    )
