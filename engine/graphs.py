"""CUDA-graph capture and replay of graph-ready decode steps, one graph per bucket and adapter set.

A graph-ready decode step (engine/batch.py's DecodeBuckets) reads its metadata from its bucket's one
device buffer and nothing from the host, so its forward can be captured once and replayed: each step
copies its metadata into that buffer (BatchBuilder does) and replays; the logits are read from the
graph's static output. What a replay reuses from its capture is keyed here:
- the batch's views of the bucket buffer (address and shape of each), so a layout that moved re-captures;
- the LoRA work: the adapter set in slot order and the residency's version (which changes with every
  adapter load or eviction, when the persistent tables are rewritten or reallocated), plus the
  persistent tables' addresses as a second check. The slot tables of a set are per-set tensors
  (lora/tables.py step_tables), so each set of adapters has its own graph; the graph keeps the tensors
  it captured alive, so their addresses are never reused while it may replay.
Graphs are kept least recently used, at most `max_graphs`. Steps that are not decode-only and
bucketed run eagerly (the runner decides).

The capture itself is injected (`GraphBackend`): CudaGraphBackend is torch.cuda.CUDAGraph with a
shared memory pool and warm-up runs on a side stream, as torch's docs ask; CpuGraphBackend, for the
tests, "captures" by keeping the callable and "replays" by running it again on the same static
buffers into the same output tensor, which proves a replay needs nothing but those buffers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class CapturedStep(Protocol):
    output: torch.Tensor  # the static output, rewritten by every replay

    def replay(self) -> None: ...


class GraphBackend(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> CapturedStep:
        """Capture `fn` (which computes the current step, whose metadata is already in place) and
        leave its output for this step in the returned step's `output`."""
        ...


@dataclass
class _CpuStep:
    fn: Callable[[], torch.Tensor]
    output: torch.Tensor

    def replay(self) -> None:
        self.output.copy_(self.fn())


class CpuGraphBackend:
    """A stand-in for the tests: replay runs the captured callable again, on the captured objects."""

    def __init__(self) -> None:
        self.captures = 0

    def capture(self, fn: Callable[[], torch.Tensor]) -> CapturedStep:
        self.captures += 1
        return _CpuStep(fn, fn())


@dataclass
class _CudaStep:
    graph: Any  # torch.cuda.CUDAGraph
    output: torch.Tensor

    def replay(self) -> None:
        self.graph.replay()


class CudaGraphBackend:
    """torch.cuda.CUDAGraph, all graphs in one memory pool (they never run at the same time)."""

    def __init__(self, device: torch.device, warmup_runs: int = 2):
        self.device = device
        self.warmup_runs = warmup_runs
        self.pool = torch.cuda.graph_pool_handle()
        self.captures = 0

    def capture(self, fn: Callable[[], torch.Tensor]) -> CapturedStep:
        # Warm-up on a side stream first (lazy initialisations, allocator state), as torch requires.
        # Each run computes this same step again: its KV writes are the same values at the same slots.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup_runs):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = fn()
        graph.replay()  # capturing runs nothing: this step's logits come from a first replay
        self.captures += 1
        return _CudaStep(graph, output)


@dataclass
class GraphStats:
    captures: int = 0
    replays: int = 0
    evictions: int = 0


@dataclass
class _Entry:
    step: CapturedStep
    keep: tuple[Any, ...]  # what the graph read at capture (LoRA tables): alive while it may replay


@dataclass
class DecodeGraphs:
    """The captured decode steps, keyed by what they read (see the module doc)."""

    backend: GraphBackend
    max_graphs: int = 32
    stats: GraphStats = field(default_factory=GraphStats)
    _graphs: OrderedDict[Hashable, _Entry] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if self.max_graphs < 1:
            raise ValueError(f"max_graphs must be at least 1, got {self.max_graphs}")

    def run(self, key: Hashable, fn: Callable[[], torch.Tensor], keep: tuple[Any, ...] = ()) -> torch.Tensor:
        """The step's output: a replay of the graph captured under `key`, or a new capture of `fn`.
        The tensor returned is the graph's static output, valid until the graph replays again."""
        entry = self._graphs.get(key)
        if entry is not None:
            self._graphs.move_to_end(key)
            entry.step.replay()
            self.stats.replays += 1
            return entry.step.output
        if len(self._graphs) >= self.max_graphs:
            self._graphs.popitem(last=False)
            self.stats.evictions += 1
        entry = _Entry(self.backend.capture(fn), keep)
        self._graphs[key] = entry
        self.stats.captures += 1
        return entry.step.output

    def clear(self) -> None:
        self._graphs.clear()

    def __len__(self) -> int:
        return len(self._graphs)


def tensor_key(*tensors: torch.Tensor | None) -> tuple[tuple[int, tuple[int, ...]] | None, ...]:
    """Address and shape of each tensor: where a captured graph reads it."""
    return tuple(None if t is None else (t.data_ptr(), tuple(t.shape)) for t in tensors)
