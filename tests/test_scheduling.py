"""tests/scheduling.py: how `make test`'s workers share the suite."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import pytest

from tests.scheduling import heavy_first, scope_of


@dataclass
class Item:
    nodeid: str
    slow: bool = False

    def get_closest_marker(self, name: str) -> object | None:
        return object() if name == "slow" and self.slow else None


def test_a_cluster_module_shares_one_scope_and_others_are_their_module_or_class() -> None:
    assert scope_of("tests/cluster/test_walkthrough.py::test_a") == "tests/cluster/"
    assert scope_of("tests/cluster/test_harness.py::test_b") == "tests/cluster/"
    assert scope_of("tests/web/test_keys.py::test_c[sqlite]") == "tests/web/test_keys.py"
    assert (
        scope_of("tests/engine/test_pool.py::TestPoolMachine::runTest")
        == "tests/engine/test_pool.py::TestPoolMachine"
    )


def test_heavy_scopes_go_first_whole_and_in_their_own_order() -> None:
    items = [
        Item("tests/a.py::one"),
        Item("tests/b.py::two"),
        Item("tests/b.py::three", slow=True),
        Item("tests/a.py::four"),
        Item("tests/cluster/test_harness.py::five"),
        Item("tests/c.py::six"),
        Item("tests/cluster/test_walkthrough.py::seven"),
        Item("tests/engine/kernels/test_aot.py::eight"),
    ]
    ordered = cast(list[Any], list(items))
    heavy_first(cast(list[pytest.Item], ordered))
    assert [i.nodeid.rsplit("::", 1)[1] for i in ordered] == [
        "five",
        "seven",
        "eight",
        "two",
        "three",
        "one",
        "four",
        "six",
    ]
