"""The engine loop: one thread owns the LLMEngine; asyncio code talks to it by posting commands.

The engine is not thread-safe, so everything that touches it (adding, aborting, registering, stepping)
runs on the loop thread, in the order it was posted. While requests are unfinished the thread steps
the engine back to back; when idle it sleeps on an event that every post sets. Outputs go back to the
asyncio loop with `call_soon_threadsafe`, one hop per step for all requests touched, into per-request
queues that the HTTP handlers read.

Failure handling: the engine keeps an adapter's faults to that adapter's requests (see engine.py), so
a step that still raises is a failure no adapter explains: it fails the requests it was running (their
callers get a StepError, their pages are freed) and the loop carries on; several such failures in a
row make it not ready (until a step succeeds), and an error in the loop's own bookkeeping stops it for
good (`dead`), so /ready and /health tell the truth. Adapter faults never count against readiness.

This class keeps no copy of the engine's adapter state. A request's adapter lookup (`adapter`) reads the
engine's published view of the registrations (an immutable snapshot the engine swaps whole, safe to read
from this thread) so it never waits for a step; only the admin listing (`adapters`), which wants exact
residency, asks the engine through the command queue. The figures for metrics come from one
`engine.stats()` snapshot per publish.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from loraplex.adapters import AdapterError, AdapterManifest, fetch_local
from loraplex.wire import QUEUE_FULL, TenantRef
from loraplex.wire.errors import (
    AdapterUnavailable,
    EngineUnavailable,
    OverShare,
    QueueFull,
    RefusedAdapterError,
    StepError,
    UnknownAdapterError,
)
from loraplex.wire.shares import Holdings, Shares

from .metrics import ServerMetrics
from .settings import queue_shares_of

if TYPE_CHECKING:
    from loraplex.engine.engine import LLMEngine
    from loraplex.engine.request import RequestOutput
    from loraplex.engine.sampling_params import SamplingParams
    from loraplex.engine.stats import AdapterFacts, AdapterInfo

log = logging.getLogger(__name__)
T = TypeVar("T")

NO_TENANT = TenantRef()  # a request without the gateway's tenant header

# Steps failing one after another with nothing succeeding in between: the engine is broken, not a request.
UNHEALTHY_AFTER_FAILURES = 3


# OS errors that mean the store (a network filesystem, say) is not answering now, rather than that the
# URI names nothing usable: the request may succeed later, or on another replica.
_OUTAGE_ERRNOS = frozenset(
    {
        errno.EIO, errno.ETIMEDOUT, errno.ESTALE, errno.EAGAIN, errno.ENETDOWN, errno.ENETUNREACH,
        errno.EHOSTUNREACH, errno.ECONNREFUSED, errno.ECONNRESET,
    }
)  # fmt: skip


def is_store_outage(error: Exception) -> bool:
    """The adapter store did not answer (as opposed to answering that the adapter is missing or bad)."""
    if isinstance(error, ConnectionError | TimeoutError):
        return True
    if isinstance(error, OSError):
        return error.errno in _OUTAGE_ERRNOS
    return not isinstance(error, ValueError)  # AdapterError is a ValueError: a verdict on the adapter


def store_unreadable(error: Exception) -> AdapterUnavailable:
    return AdapterUnavailable(f"the adapter store could not be read: {type(error).__name__}: {error}")


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


class PoolFull(RuntimeError):
    """A pin that would not fit the engine's pool (AdapterRegistry.pin_budget): refused, nothing changed."""


class AdapterFetchFailed(AdapterError):
    """Nothing usable at the adapter's URI (as opposed to something there that fails validation)."""


class RequestStream:
    """The asyncio side of one request: its outputs in order, the last one finished (or an error)."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.done = False
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    async def next(self) -> RequestOutput:
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.done = True
            raise item
        if item.finished:
            self.done = True
        return item


@dataclass
class _Tracked:
    stream: RequestStream
    tenant: str | None
    arrival: float
    tokens_seen: int = 0
    last_token_at: float | None = None


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        metrics: ServerMetrics | None = None,
        max_queue: int = 256,
        publish_interval_s: float = 0.05,
        queue_shares: Shares | None = None,
    ):
        self.engine = engine
        self.metrics = metrics or ServerMetrics()
        self.max_queue = max_queue
        # Each tenant's share of the waiting queue: a flood by one leaves room for the others.
        self.queue_shares = queue_shares or queue_shares_of(max_queue)
        if self.queue_shares.capacity != max_queue:
            raise ValueError(
                f"queue_shares are of {self.queue_shares.capacity} places, max_queue is {max_queue}"
            )
        self.publish_interval_s = publish_interval_s
        # What never changes after the engine is made (read here, before the loop thread starts).
        self.base_shape = engine.base_shape
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.loaded.config.vocab_size
        self.tokenizer = engine.tokenizer
        self.page_size = engine.config.page_size
        self.pool_tokens = (engine.stats().num_pages - 1) * self.page_size  # less the zero page
        self.metrics.observe_model(engine.weight_bytes, engine.loaded.quantization)
        self.metrics.observe_capacity(engine.config, engine.stats(), page_bytes=engine.cache.memory[0].nbytes)
        # Read by the event loop, written by the loop thread from engine.stats(): plain ints.
        self.waiting = 0
        self.running = 0
        self.dead: str | None = None
        # Each command with the future its poster awaits (settled with an error if it never runs).
        self._commands: queue.SimpleQueue[tuple[Callable[[], None], asyncio.Future[Any] | None]] = (
            queue.SimpleQueue()
        )
        self._closed = False  # the loop thread has exited: posts are refused at once
        self._post_lock = threading.Lock()
        self._wake = threading.Event()
        self._pending_adds = 0  # posted, not yet handed to the engine: waiting, too
        self._pending_lock = threading.Lock()
        # Under _pending_lock: requests posted, not yet handed over, by tenant; and waiting by tenant (the
        # engine's count at the last publish, plus those posts), which admission reads.
        self._pending_by_tenant: dict[str | None, int] = {}
        self._queued = Holdings()
        self._tracked: dict[str, _Tracked] = {}
        self._stopping = False
        self._consecutive_failures = 0
        self._last_publish = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the loop thread; call from the asyncio loop that will read the outputs."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def accepting(self) -> bool:
        """The loop runs and takes requests."""
        return (
            self._thread is not None and self._thread.is_alive() and not self._stopping and self.dead is None
        )

    @property
    def ready(self) -> bool:
        """Accepting, and the last steps did not all fail. Requests are still accepted while steps
        fail (one that succeeds clears the record); readiness only steers traffic elsewhere."""
        return self.accepting and self._consecutive_failures < UNHEALTHY_AFTER_FAILURES

    @property
    def not_ready_reason(self) -> str:
        if self._thread is None:
            return "the engine loop has not started"
        if self.dead is not None:
            return f"the engine loop stopped: {self.dead}"
        if self._stopping or not self._thread.is_alive():
            return "the engine loop is shutting down"
        return f"the last {self._consecutive_failures} engine steps failed"

    async def stop(self, timeout_s: float = 10.0) -> None:
        """End the loop: requests still in it are aborted and their callers told the server is going."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout_s)

    # -- what the HTTP side calls -----------------------------------------------------------------

    async def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        adapter: str | None = None,
        tenant: TenantRef = NO_TENANT,
        request_id: str | None = None,
        prompt_logprobs: int | None = None,
        shares_prompt_with: str | None = None,
        adapter_sha256: str | None = None,
    ) -> RequestStream:
        """Queue a request; returns once the engine accepted it (ValueError names what it refused).
        `request_id`: the id to give it (default: a fresh one); `prompt_logprobs`, `shares_prompt_with` and
        `adapter_sha256` (the digest it was routed with) as LLMEngine.add_request's. Adds posted one after
        another reach the engine in that order."""
        tenant_id = tenant.tenant_id
        if not self.accepting:
            raise EngineUnavailable(self.not_ready_reason)
        grammars = self.engine.grammars
        if params.structured is not None and grammars is not None:
            # A new schema compiles off the loop thread (milliseconds to seconds): the steps of every other
            # request go on meanwhile, and the engine then finds the grammar in its cache.
            await asyncio.to_thread(grammars.prepare, params.structured)
        with self._pending_lock:
            waiting = self.waiting + self._pending_adds
            refusal = self._queued.refusal(self.queue_shares, tenant_id)
            if waiting >= self.max_queue or (refusal is not None and refusal.code == QUEUE_FULL):
                self.metrics.requests_rejected.labels("queue_full").inc()
                raise QueueFull(waiting, self.max_queue)
            if refusal is not None:
                self.metrics.requests_rejected.labels("tenant_share").inc()
                raise OverShare(refusal.message)
            self._pending_adds += 1
            self._pending_by_tenant[tenant_id] = self._pending_by_tenant.get(tenant_id, 0) + 1
            self._queued.take(tenant_id)
        stream = RequestStream(request_id or new_request_id())
        accepted = self._future()
        ids, arrival = list(prompt_token_ids), time.monotonic()
        extras = {
            "prompt_logprobs": prompt_logprobs,
            "shares_prompt_with": shares_prompt_with,
            "adapter_sha256": adapter_sha256,
        }
        self._post(
            lambda: self._add(stream, ids, params, adapter, tenant, arrival, accepted, extras),
            accepted,
        )
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(stream.request_id)  # the add may already have happened: undo it
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """End a request whose caller went away (safe to call for finished or unknown ids)."""
        self._post(lambda: self._abort(request_id))

    async def _call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the loop thread, between steps, and return what it returns."""
        if self._thread is None or not self._thread.is_alive():
            raise EngineUnavailable(self.not_ready_reason)
        done = self._future()

        def run() -> None:
            outcome: Any
            try:
                outcome = fn(self.engine)
            except Exception as exc:
                outcome = exc
            self._resolve(done, outcome)

        self._post(run, done)
        result: T = await done
        return result

    async def register_adapter(self, name: str, uri: str, sha256: str | None = None) -> AdapterManifest:
        """Fetch, hash and validate off the loop (disk reads and hashing take a while), then register.
        AdapterFetchFailed: nothing usable at `uri`; AdapterError: what is there is refused;
        AdapterUnavailable: the store could not be read (not the adapter's fault)."""
        from loraplex.engine.lora.sources import DirectorySource

        try:
            directory = await asyncio.to_thread(fetch_local, uri)
        except Exception as exc:
            if is_store_outage(exc):
                raise store_unreadable(exc) from exc
            raise AdapterFetchFailed(f"nothing usable at {uri[:200]}: {exc}") from exc
        try:
            source = await asyncio.to_thread(DirectorySource.open, directory, self.base_shape, sha256)
        except Exception as exc:
            if is_store_outage(exc):
                raise store_unreadable(exc) from exc
            raise
        return await self._call(lambda engine: engine.register_adapter(name, source))

    async def pin_adapter(self, name: str) -> str:
        """Pin a registered adapter (LLMEngine.pin_adapter): its host copy read off the loop thread as for
        warm_adapter. "device" or "host"; PoolFull when the pins would not fit the pool; otherwise the
        errors of warm_adapter."""

        def prefetch(engine: LLMEngine) -> Future[Any] | None:
            if engine.adapter(name) is None:
                raise UnknownAdapterError(f"adapter {name!r} is not registered")
            engine.loader.prefetch([name])
            return engine.loader.host.pending(name)

        def pin(engine: LLMEngine) -> str:
            from loraplex.engine.lora.loader import LoadFailed
            from loraplex.engine.lora.registry import PinRefused

            try:
                return engine.pin_adapter(name)
            except PinRefused as exc:
                raise PoolFull(str(exc)) from exc
            except LoadFailed as exc:
                if exc.failure.at_fault:
                    raise RefusedAdapterError(f"adapter {name!r} could not be loaded: {exc}") from exc
                raise AdapterUnavailable(str(exc)) from exc
            except AdapterError as exc:
                raise RefusedAdapterError(str(exc)) from exc

        packing = await self._call(prefetch)
        if packing is not None:
            with contextlib.suppress(Exception):
                await asyncio.wrap_future(packing)
        return await self._call(pin)

    async def unpin_adapter(self, name: str) -> bool:
        """Let a pinned adapter be evicted again; whether it was pinned. UnknownAdapterError if it is not
        registered."""

        def unpin(engine: LLMEngine) -> bool:
            if engine.adapter(name) is None:
                raise UnknownAdapterError(f"adapter {name!r} is not registered")
            return engine.unpin_adapter(name)

        return await self._call(unpin)

    async def unregister_adapter(self, name: str) -> bool:
        """New requests can no longer name it; True if it is forgotten now, False if it drains (the
        requests using it finish, then its pages and host copy are freed). UnknownAdapterError if it is
        not registered."""

        def unregister(engine: LLMEngine) -> bool:
            if engine.adapter(name) is None:
                raise UnknownAdapterError(f"adapter {name!r} is not registered")
            return engine.unregister_adapter(name)

        return await self._call(unregister)

    async def warm_adapter(self, name: str) -> str:
        """Load a registered adapter ahead of its requests (LLMEngine.warm_adapter): its host copy is read
        and packed off the loop thread, so the steps wait only for the copy into the pool. "device" or
        "host"; UnknownAdapterError, RefusedAdapterError (at fault) or AdapterUnavailable (the store did not
        answer)."""

        def prefetch(engine: LLMEngine) -> Future[Any] | None:
            if engine.adapter(name) is None:
                raise UnknownAdapterError(f"adapter {name!r} is not registered")
            engine.loader.prefetch([name])
            return engine.loader.host.pending(name)

        def warm(engine: LLMEngine) -> str:
            from loraplex.engine.lora.loader import LoadFailed  # torch's side: imported on the loop thread

            try:
                return engine.warm_adapter(name)
            except LoadFailed as exc:
                if exc.failure.at_fault:
                    raise RefusedAdapterError(f"adapter {name!r} could not be loaded: {exc}") from exc
                raise AdapterUnavailable(str(exc)) from exc
            except AdapterError as exc:
                raise RefusedAdapterError(str(exc)) from exc

        packing = await self._call(prefetch)
        if packing is not None:  # its failure, if any, is the load's to report (the get after it)
            with contextlib.suppress(Exception):
                await asyncio.wrap_future(packing)
        return await self._call(warm)

    def adapter(self, name: str) -> AdapterFacts | None:
        """The registered adapter `name` (None: not registered, or unregistered and draining), from the
        engine's view: at once, even while a step runs, so a request naming an adapter waits for no extra
        step before it is queued. A registration or unregistration already awaited here is in it."""
        facts = self.engine.adapter_view.get(name)
        return None if facts is None or facts.draining else facts

    def adapter_names(self) -> list[str]:
        """The registered adapters (not those draining), sorted; from the view, like `adapter`."""
        return sorted(name for name, facts in self.engine.adapter_view.items() if not facts.draining)

    async def adapters(self) -> list[AdapterInfo]:
        """Every registered adapter, by name, with its residency: asked of the engine between steps, the
        only place residency is exact (it changes every step)."""
        return await self._call(lambda engine: engine.adapters())

    # -- plumbing between the threads -------------------------------------------------------------

    def _future(self) -> asyncio.Future[Any]:
        assert self._loop is not None, "start() the engine loop first"
        return self._loop.create_future()

    def _post(self, command: Callable[[], None], future: asyncio.Future[Any] | None = None) -> None:
        with self._post_lock:
            if self._closed:
                if future is not None and not future.done():
                    future.set_exception(EngineUnavailable(self.not_ready_reason))
                return
            self._commands.put((command, future))
        self._wake.set()

    def _resolve(self, future: asyncio.Future[Any], outcome: Any) -> None:
        """Settle an asyncio future from the loop thread (a BaseException outcome is raised there)."""

        def settle() -> None:
            if future.done():  # its awaiter was cancelled
                return
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)

        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the asyncio loop is closed: nobody is waiting any more
            self._loop.call_soon_threadsafe(settle)

    def _deliver(self, items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
        if not items:
            return

        def put_all() -> None:
            for stream, item in items:
                stream.put(item)

        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the asyncio loop is closed: nobody is listening any more
            self._loop.call_soon_threadsafe(put_all)

    # -- the loop thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                self._wake.clear()
                self._run_commands()
                if self._stopping:
                    self._end_all(EngineUnavailable("the server is shutting down"))
                    return
                if self.engine.has_unfinished():
                    self._step()
                    self._publish()
                else:
                    self._publish(force=True)
                    self._wake.wait()
        except BaseException as exc:  # a bug in the loop itself: say so, and fail everyone honestly
            log.exception("the engine loop stopped")
            self.dead = f"{type(exc).__name__}: {exc}"
            self._end_all(EngineUnavailable(f"the engine loop stopped: {self.dead}"))

    def _run_commands(self) -> None:
        while True:
            try:
                command, _ = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _add(
        self,
        stream: RequestStream,
        ids: list[int],
        params: SamplingParams,
        adapter: str | None,
        tenant: TenantRef,
        arrival: float,
        accepted: asyncio.Future[None],
        extras: dict[str, Any],
    ) -> None:
        with self._pending_lock:
            self._pending_adds -= 1
            left = self._pending_by_tenant.pop(tenant.tenant_id) - 1
            if left:
                self._pending_by_tenant[tenant.tenant_id] = left
        outcome: Exception | None = None
        try:
            self.engine.add_request(
                ids,
                params,
                request_id=stream.request_id,
                adapter=adapter,
                tenant=tenant.tenant_id,
                tenant_weight=tenant.weight,
                **extras,
            )
        except Exception as exc:  # the engine's refusal (wire/errors.py) goes to the caller as it is
            outcome = exc
        if outcome is not None:
            with self._pending_lock:  # taken at the post: it never reached the queue
                self._queued.give(tenant.tenant_id)
            self._resolve(accepted, outcome)
            return
        self._tracked[stream.request_id] = _Tracked(stream, tenant.tenant_id, arrival)
        self.metrics.count_prompt(tenant.tenant_id, len(ids))
        self.waiting += 1  # until the next publish counts the queue again
        self._resolve(accepted, None)

    def _abort(self, request_id: str) -> None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return
        self.engine.abort(request_id)
        self._ended(tracked, "abort")

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except StepError as exc:  # the outputs it made (an adapter's ended requests) still go out
            self._deliver_outputs(exc.outputs)
            self._step_failed(exc.cause or exc)
            return
        except Exception as exc:
            self._step_failed(exc)
            return
        self._consecutive_failures = 0
        self._deliver_outputs(outputs)

    def _deliver_outputs(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        deliveries: list[tuple[RequestStream, RequestOutput | BaseException]] = []
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:  # aborted in the meantime
                continue
            self._count_tokens(tracked, len(output.token_ids), now)
            deliveries.append((tracked.stream, output))
            if output.finished:
                del self._tracked[output.request_id]
                self._ended(tracked, output.finish_reason or "stop", now)
        self._deliver(deliveries)

    def _count_tokens(self, tracked: _Tracked, total: int, now: float) -> None:
        new = total - tracked.tokens_seen
        if new <= 0:
            return
        metrics = self.metrics
        if tracked.last_token_at is None:
            metrics.time_to_first_token.observe(now - tracked.arrival)
        else:
            gap = (now - tracked.last_token_at) / new
            for _ in range(new):
                metrics.inter_token_latency.observe(gap)
        tracked.tokens_seen, tracked.last_token_at = total, now
        metrics.count_generated(tracked.tenant, new)

    def _ended(self, tracked: _Tracked, reason: str, now: float | None = None) -> None:
        self.metrics.e2e_latency.observe((now or time.monotonic()) - tracked.arrival)
        self.metrics.requests_finished.labels(reason).inc()

    def _step_failed(self, exc: Exception) -> None:
        """Fail the requests the step was running (or, with none running, those it could not admit)."""
        # The cause goes to the log under a reference, never to the callers: its text may quote a request's
        # own values or other requests' ids, and the step held requests of several tenants.
        reference = uuid.uuid4().hex[:12]
        log.exception("an engine step failed (reference %s); failing the requests in it", reference)
        self.metrics.step_errors.inc()
        self._consecutive_failures += 1
        from loraplex.engine.request import RequestStatus

        engine = self.engine
        affected = engine.request_ids(RequestStatus.RUNNING) or engine.request_ids(RequestStatus.WAITING)
        error = StepError(
            f"the engine failed while running this request (step error {reference}, in the engine's log); "
            "retry it"
        )
        deliveries: list[tuple[RequestStream, RequestOutput | BaseException]] = []
        for request_id in affected:
            self.engine.abort(request_id)  # if this raises too, the loop is beyond repair (see _run)
            tracked = self._tracked.pop(request_id, None)
            if tracked is not None:
                deliveries.append((tracked.stream, error))
                self._ended(tracked, "error")
        self._deliver(deliveries)

    def _end_all(self, error: BaseException) -> None:
        deliveries: list[tuple[RequestStream, RequestOutput | BaseException]] = []
        for request_id, tracked in list(self._tracked.items()):
            try:
                self.engine.abort(request_id)
            except Exception:
                log.exception("could not abort %s", request_id)
            deliveries.append((tracked.stream, error))
            self._ended(tracked, "abort")
        self._tracked.clear()
        self._deliver(deliveries)
        # Whatever is still posted will never run: settle the futures waiting on it.
        with self._post_lock:
            self._closed = True
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                break
            if future is not None:
                self._resolve(future, EngineUnavailable("the engine loop stopped before running this"))

    def _publish(self, force: bool = False) -> None:
        stats = self.engine.stats()
        self.waiting, self.running = stats.waiting, stats.running
        waiting_by_tenant = self.engine.waiting_by_tenant()
        with self._pending_lock:
            self._queued = Holdings.of(waiting_by_tenant, self._pending_by_tenant)
        metrics = self.metrics
        metrics.observe_queue(self.waiting + self._pending_adds, self.running)
        now = time.monotonic()
        if not force and now - self._last_publish < self.publish_interval_s:
            return
        self._last_publish = now
        metrics.observe_engine(stats)
        metrics.observe_adapters(self.engine.adapter_report(), stats)  # per publish, not per step
        # What this thread adds that the engine cannot know: requests posted but not handed over yet.
        metrics.observe_queue(self.waiting + self._pending_adds, self.running)
