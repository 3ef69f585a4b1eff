"""How `pytest -n N` (what `make test` runs) shares the suite between workers: by scope, as --dist=loadscope
does, with two changes.

- Whole folders that must not run beside themselves are one scope. tests/cluster's modules each start a
  cluster in a box (a bridge, pods in network namespaces, engines holding gigabytes): two at once on a
  2-core machine would starve each other, so they run one after the other on one worker.
- The longest scopes go first (tests/cluster, then the AOT gate, then modules with a test marked slow), so
  that the suite does not end on one worker still running a walkthrough while the other sits idle. The AOT
  gate compiles in a pool of its own processes for minutes on a fresh machine: started beside the cluster
  modules, it never becomes the suite's tail. xdist's own reordering
  counts tests, which says little about time: the walkthrough has seven tests and takes longest.

Without -n none of this is used and tests run in collection order.
"""

from __future__ import annotations

from typing import Any

import pytest

# Folders whose modules share one worker, one module after the other.
ONE_WORKER = ("tests/cluster/",)
# Modules that start right after the one-worker folders, on the other worker.
EARLY = ("tests/engine/kernels/test_aot.py",)


def scope_of(nodeid: str) -> str:
    """The work unit a test belongs to: its folder in ONE_WORKER, else its module (or class)."""
    for folder in ONE_WORKER:
        if nodeid.startswith(folder):
            return folder
    return nodeid.rsplit("::", 1)[0]


def weight(items: list[pytest.Item]) -> int:
    """Lower runs earlier: the one-worker folders, the EARLY modules, scopes holding a slow test, the rest."""
    if any(item.nodeid.startswith(ONE_WORKER) for item in items):
        return 0
    if any(item.nodeid.startswith(EARLY) for item in items):
        return 1
    return 2 if any(item.get_closest_marker("slow") for item in items) else 3


def heavy_first(items: list[pytest.Item]) -> None:
    """Reorders `items` in place, whole scopes at a time, keeping the order inside each scope (some
    modules' tests build on the previous one) and among scopes of equal weight."""
    scopes: dict[str, list[pytest.Item]] = {}
    for item in items:
        scopes.setdefault(scope_of(item.nodeid), []).append(item)
    ordered = sorted(scopes.values(), key=weight)  # sorted() is stable
    items[:] = [item for scope in ordered for item in scope]


def make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's loadscope scheduler on `scope_of`, taking scopes in the (reordered) collection order."""
    from xdist.scheduler import LoadScopeScheduling

    class Scheduler(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    config.option.loadscopereorder = False  # the workers' collection is already heaviest first
    return Scheduler(config, log)
