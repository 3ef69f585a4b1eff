"""Adapters packed and ready in host memory: an LRU cache with a byte budget, filled in the background.

Reading an adapter from storage and packing it for the pool takes milliseconds to seconds; copying a
packed adapter into the pool takes microseconds. So the engine asks the cache to prefetch the adapter
of a request as soon as it is queued (and those next in the queue every step), a worker thread loads
them while the model runs, and by the time a request is admitted its adapter is usually one copy away.
The least recently used packed adapters are dropped when the budget is exceeded (a dropped adapter is
simply read again when next wanted); the one being handed out is never dropped under the caller's feet.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from .layout import PackedAdapter

log = logging.getLogger(__name__)

Packer = Callable[[], PackedAdapter]


def packed_bytes(packed: PackedAdapter) -> int:
    indices = (*packed.a_rows.values(), *packed.b_rows.values(), *packed.d_rows.values())
    index = sum(t.numel() * t.element_size() for t in indices)
    data = packed.data.numel() * packed.data.element_size()
    return data + index + packed.data_rows.numel() * packed.data_rows.element_size()


@dataclass
class HostCacheStats:
    hits: int = 0  # asked for and already packed
    waits: int = 0  # asked for while its prefetch was still running: waited for the rest
    misses: int = 0  # asked for and read on the spot (never prefetched)
    loads: int = 0  # packs made, in the background or on the spot
    load_seconds: float = 0.0
    evictions: int = 0
    failures: int = 0


class HostCache:
    def __init__(self, budget_bytes: int, workers: int = 1):
        if budget_bytes <= 0:
            raise ValueError(f"the adapter host cache needs a positive byte budget, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.stats = HostCacheStats()
        self._packed: OrderedDict[str, tuple[PackedAdapter, int]] = OrderedDict()  # oldest first
        self._bytes = 0  # the sizes in _packed, summed
        self._pending: dict[str, Future[PackedAdapter]] = {}
        self._lock = threading.Lock()
        self._workers = ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="adapter-prefetch", initializer=_one_intra_op_thread
        )

    @property
    def bytes_used(self) -> int:
        with self._lock:
            return self._bytes

    def __contains__(self, name: str) -> bool:
        with self._lock:
            return name in self._packed

    def packed_names(self) -> list[str]:
        """The adapters packed and waiting here now, least recently used first."""
        with self._lock:
            return list(self._packed)

    def ready(self, name: str) -> bool:
        """Packed and waiting: handing it out will not block."""
        return name in self

    def prefetch(self, name: str, packer: Packer) -> None:
        """Start packing `name` in the background unless it is packed or on its way."""
        with self._lock:
            if name in self._packed or name in self._pending:
                return
            # Its own future, filled by the worker: a pack that finishes after `discard` sees it is no
            # longer the pending one and keeps nothing.
            future: Future[PackedAdapter] = Future()
            self._pending[name] = future
            self._workers.submit(self._fill, name, packer, future)

    def pending(self, name: str) -> Future[PackedAdapter] | None:
        """The prefetch of `name` in flight (or finished but not yet handed out), to wait on elsewhere."""
        with self._lock:
            return self._pending.get(name)

    def get(self, name: str, packer: Packer) -> PackedAdapter:
        """The packed adapter, waiting for a prefetch in flight or packing it now; raises what packing
        raised (an AdapterError when the weights cannot be read). A prefetch that failed is reported
        here, once: the get after it reads again."""
        with self._lock:
            hit = self._packed.get(name)
            if hit is not None:
                self._packed.move_to_end(name)
                self.stats.hits += 1
                return hit[0]
            pending = self._pending.get(name)
            if pending is not None:
                self.stats.waits += 1
            else:
                self.stats.misses += 1
        if pending is None:
            return self._pack(name, packer)
        try:
            return pending.result()
        except BaseException:
            with self._lock:
                if self._pending.get(name) is pending:
                    del self._pending[name]
            raise

    def discard(self, name: str) -> None:
        """Forget `name`: its packed copy, and whatever a prefetch in flight would have kept."""
        with self._lock:
            dropped = self._packed.pop(name, None)
            self._bytes -= dropped[1] if dropped else 0
            self._pending.pop(name, None)

    def close(self) -> None:
        self._workers.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            never_run = [f for f in self._pending.values() if not f.done()]
            self._pending.clear()
        for future in never_run:  # cancelled before their turn: whoever waits on them must not hang
            future.set_exception(RuntimeError("the adapter host cache was closed"))

    def _fill(self, name: str, packer: Packer, future: Future[PackedAdapter]) -> None:
        """Pack in the worker. A failure stays pending for the next get to report."""
        began = time.perf_counter()
        try:
            packed = packer()
        except BaseException as error:
            with self._lock:
                self.stats.failures += 1
            log.warning("could not prefetch adapter %s", name, exc_info=True)
            future.set_exception(error)
            return
        with self._lock:
            self.stats.loads += 1
            self.stats.load_seconds += time.perf_counter() - began
            if self._pending.get(name) is future:
                del self._pending[name]
                self._keep(name, packed)
        future.set_result(packed)

    def _pack(self, name: str, packer: Packer) -> PackedAdapter:
        """Pack on the spot (the caller's thread)."""
        began = time.perf_counter()
        try:
            packed = packer()
        except BaseException:
            with self._lock:
                self.stats.failures += 1
            log.warning("could not load adapter %s", name, exc_info=True)
            raise
        with self._lock:
            self.stats.loads += 1
            self.stats.load_seconds += time.perf_counter() - began
            self._keep(name, packed)
        return packed

    def _keep(self, name: str, packed: PackedAdapter) -> None:
        replaced = self._packed.pop(name, None)
        size = packed_bytes(packed)
        self._bytes += size - (replaced[1] if replaced else 0)
        self._packed[name] = (packed, size)
        self._shrink(keep=name)

    def _shrink(self, keep: str) -> None:
        """Drop least recently used packs until within budget; `keep` (just packed) always stays."""
        for name in list(self._packed):
            if self._bytes <= self.budget_bytes:
                break
            if name == keep:
                continue
            self._bytes -= self._packed.pop(name)[1]
            self.stats.evictions += 1


def _one_intra_op_thread() -> None:
    """Packing runs beside the model's steps. Torch ops on a second thread start a second OpenMP team
    as wide as the first, and on a small CPU the two teams then slow every later step of the main
    thread (base-model steps measured 30% slower after one background pack; docs/benchmarks.md). One
    intra-op thread here (a per-thread setting) leaves the cores to the model."""
    import torch  # here: the host cache itself is plain bookkeeping

    torch.set_num_threads(1)
