"""Count what a piece of engine code asks of the device: aten ops, Triton launches, host reads.

What a CUDA graph relies on can be checked on a CPU: a captured step replays a fixed list of kernels,
so a decode step must issue the same kernels with the same shapes whatever its requests are, and must
never read a device value on the host in the middle (a graph cannot pause for the host). This counter
records, while it is entered:

- every aten op (a TorchDispatchMode), with its argument shapes: the "kernels" of the torch path;
- every Triton launch (the JIT or interpreter `run` of each kernel), with its grid and argument shapes;
  torch ops the interpreter itself runs inside a launch are not counted;
- every read of a tensor's value on the host: `.item()`, `.tolist()`, `bool()`/`int()`/`float()` of a
  tensor, `.numpy()`, `nonzero` (its output size depends on values), and aten's `_local_scalar_dense`
  and `is_nonzero`, which the C++ side reaches for the same reasons. On a GPU each is a sync.

Used by tests/engine/test_dispatch.py and `python -m loraplex.bench step`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# Tensor methods that hand a value to Python: on a device, each waits for the device to get there.
_HOST_READ_METHODS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.numpy,
    torch.Tensor.nonzero,
    torch.nonzero,
}
_HOST_READ_ATEN = {"_local_scalar_dense", "is_nonzero", "nonzero", "equal", "unique", "masked_select"}


def _shapes(args: Any, kwargs: Any) -> tuple:
    flat, _ = tree_flatten((args, kwargs))
    return tuple(
        (tuple(a.shape), str(a.dtype)) if isinstance(a, torch.Tensor) else a
        for a in flat
        if isinstance(a, torch.Tensor | int | float | bool) or a is None
    )


@dataclass
class Trace:
    """What ran while a DispatchCounter was entered."""

    ops: list[tuple[str, tuple]] = field(default_factory=list)  # (aten op or "triton:<kernel>", shapes)
    host_reads: list[str] = field(default_factory=list)  # what read a value, in order

    @property
    def launches(self) -> int:
        return len(self.ops)

    def by_name(self) -> Counter[str]:
        return Counter(name for name, _ in self.ops)

    def kernels(self) -> list[tuple[str, tuple]]:
        """The sequence that would be captured: op names with their shapes."""
        return list(self.ops)


class _OpCounter(TorchDispatchMode):
    def __init__(self, trace: Trace, paused: list[int], reading: list[int]):
        super().__init__()
        self.trace = trace
        self.paused = paused
        self.reading = reading

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused[0]:
            name = func.overloadpacket.__name__
            # Views and metadata-only ops launch nothing on a device.
            if not _is_view(func):
                self.trace.ops.append((name, _shapes(args, kwargs)))
            if name in _HOST_READ_ATEN and not self.reading[0]:
                self.trace.host_reads.append(f"aten.{name}")
        return func(*args, **kwargs)


def _is_view(func: Any) -> bool:
    schema = func._schema
    return bool(schema.returns) and all(
        r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
    )


class _ReadCounter(TorchFunctionMode):
    def __init__(self, trace: Trace, paused: list[int], reading: list[int]):
        super().__init__()
        self.trace = trace
        self.paused = paused
        self.reading = reading

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.paused[0] or func not in _HOST_READ_METHODS:
            return func(*args, **(kwargs or {}))
        self.trace.host_reads.append(getattr(func, "__name__", str(func)))
        self.reading[0] += 1  # one read: not counted again when aten reaches _local_scalar_dense for it
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.reading[0] -= 1


def _triton_run_classes() -> list[type]:
    """The classes whose `run` launches a Triton kernel (compiled and interpreted)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:  # no Triton: the torch path only
        return []
    return [JITFunction, InterpretedFunction]


@contextmanager
def _count_launches(trace: Trace, paused: list[int]) -> Iterator[None]:
    originals: dict[type, Callable[..., Any]] = {}
    for cls in _triton_run_classes():
        original = cls.__dict__.get("run")
        if original is None:
            continue
        originals[cls] = original

        def run(self: Any, *args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            if paused[0]:
                return _original(self, *args, **kwargs)
            name = getattr(self, "__name__", None) or getattr(getattr(self, "fn", None), "__name__", "?")
            grid = kwargs.get("grid")
            trace.ops.append((f"triton:{name}", (repr(grid), *_shapes(args, {}))))
            paused[0] += 1  # the interpreter runs torch ops of its own: not the step's
            try:
                return _original(self, *args, **kwargs)
            finally:
                paused[0] -= 1

        cls.run = run  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for cls, original in originals.items():
            cls.run = original  # type: ignore[attr-defined]


class DispatchCounter:
    """`with DispatchCounter() as trace:` records the ops, launches and host reads of the block.
    `counter.pause()` leaves a part out (e.g. the host-side sampling a step ends with)."""

    def __init__(self) -> None:
        self.trace = Trace()
        self._paused = [0]
        self._stack: list[Any] = []

    def __enter__(self) -> Trace:
        launches = _count_launches(self.trace, self._paused)
        launches.__enter__()
        reading = [0]
        reads = _ReadCounter(self.trace, self._paused, reading)
        ops = _OpCounter(self.trace, self._paused, reading)
        reads.__enter__()
        ops.__enter__()
        self._stack = [launches, reads, ops]
        return self.trace

    def __exit__(self, *exc: object) -> None:
        for context in reversed(self._stack):
            context.__exit__(*exc)
        self._stack = []

    @contextmanager
    def pause(self) -> Iterator[None]:
        self._paused[0] += 1
        try:
            yield
        finally:
            self._paused[0] -= 1
