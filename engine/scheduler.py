"""Continuous batching: which tokens of which requests run in the next step, and what the step changed.

Every step, requests join and leave the running batch. A request is a list of tokens of which the first
`num_computed_tokens` have keys and values in the cache; a step computes the next chunk of each
scheduled request, so a prefill and a decode are the same thing with different chunk lengths. Chunks
fit a per-step token budget, which is how long prompts are prefilled in pieces beside running decodes.
When the pool has no page for a running request, the most recently admitted request is preempted: its
pages are freed and it goes back to the front of the queue, to be recomputed from its tokens later.
A request with an adapter joins only when the pool can hold both: its adapter's pages (unless resident)
and the pages of its first chunk; otherwise it waits, and no adapter is loaded for it in vain.

A step is a plan (`schedule` → StepPlan: the chunks to run, who was preempted, the adapters the loader
must copy into pages already handed out, the requests refused), then `postprocess(plan, sampled)`:
advance, append, finish. Pipelined (async scheduling), the two halves are apart: `advance(plan)` at
launch (its sampled tokens are pending: counted, ids unknown), the next plan, then `land(plan,
sampled)`. Plain bookkeeping: no torch and no file access (tests/engine/test_torch_free.py proves
both), tested on the CPU in milliseconds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from .fairness import Tenant, VirtualTokenCounter
from .lora.registry import AdapterLoad, AdapterRegistry
from .pool import PageKind, PagePool
from .prefix_cache import PrefixCache
from .request import Request, RequestStatus
from .stopping import StopChecker


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int  # index of the chunk's first token in the request's token list
    num_tokens: int
    # The chunk reaches the end of the request's tokens, so the step samples its next token. Fixed when
    # scheduled: postprocess appends that token, after which the end is no longer the end.
    samples: bool

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class StepPlan:
    """One step, decided: run `chunks` (in this order once the runner ordered them), after copying
    `adapter_loads` into their pages. `preempted` went back to the queue; `refused` were ended because
    their adapter is refused (their finish_reason is "error")."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    adapter_loads: list[AdapterLoad] = field(default_factory=list)
    refused: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def sampling(self) -> list[Request]:
        """The requests whose next token this step samples, in chunk order (one logits row each)."""
        return [chunk.request for chunk in self.chunks if chunk.samples]


class Scheduler:
    def __init__(
        self,
        pool: PagePool,
        page_size: int,
        max_num_seqs: int,
        max_batch_tokens: int,
        adapters: AdapterRegistry | None = None,
        max_adapter_loads_per_step: int = 4,
        stop: StopChecker | None = None,
        fairness: VirtualTokenCounter | None = None,
        max_bypass_steps: int = 32,
        prefix_cache: PrefixCache | None = None,
        light_newcomer_steps: bool = True,
    ):
        if page_size <= 0 or max_num_seqs <= 0 or max_batch_tokens <= 0:
            raise ValueError("page_size, max_num_seqs and max_batch_tokens must be positive")
        self.pool = pool
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.adapters = adapters
        # Admission starts a request past its longest cached prefix (engine/prefix_cache.py); None: off.
        self.prefix_cache = prefix_cache
        # Loading an adapter costs pages and a copy: when many new adapters wait, only a few join per
        # step, so one step's loads cannot crowd out the KV cache of the running batch.
        self.max_adapter_loads_per_step = max_adapter_loads_per_step
        # No end-of-sequence token and no context limit unless the engine says so: max_tokens ends it.
        self.stop = stop or StopChecker(eos_token_ids=(), max_model_len=2**62)
        self.waiting: deque[Request] = deque()
        # Which waiting request goes next: None is first come first served; a VirtualTokenCounter picks
        # the tenant with the least service (engine/fairness.py).
        self.fairness = fairness
        # With fairness, a request whose adapter cannot get pages now is passed over so other tenants
        # run; after this many steps of that, nothing joins behind it until the running batch drains
        # enough pages for it, so it cannot starve.
        self.max_bypass_steps = max_bypass_steps
        self._bypassed: dict[str, int] = {}  # request id -> steps it was passed over
        # With fairness, the step that admits an under-served tenant's first request carries no other
        # prefill (running chunks wait a step, other tenants do not join): its first token then costs
        # about what it costs on an idle engine. Each request is held back like that at most once, so
        # a stream of newcomers cannot starve a prefill.
        self.light_newcomer_steps = light_newcomer_steps
        self._held_back: set[str] = set()  # request ids whose prefill waited out a newcomer's step
        self._yielded: set[str] = set()  # request ids preempted once to give a newcomer their slot
        self.running: list[Request] = []  # in admission order: the front has priority

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def add(self, request: Request) -> None:
        """Queue a request; one naming an adapter counts as its user until it ends."""
        if request.adapter is not None:
            assert self.adapters is not None, "a request names an adapter but the engine serves none"
            self.adapters.add_user(request.adapter)
        request.status = RequestStatus.WAITING
        if self.fairness is not None:
            self.fairness.queued(request)
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _chunk(self, request: Request, count: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        return ScheduledChunk(request, start, count, samples=start + count == request.num_tokens)

    def schedule(self) -> StepPlan:
        out = StepPlan()
        newcomers = self._newcomers(out)
        made_room = len(out.preempted)
        budget, prefills = self._schedule_running(out, self.max_batch_tokens, hold_back=bool(newcomers))
        pressed = len(out.preempted) > made_room  # preempted for lack of pages: nobody joins this step
        passed: set[Tenant] = set()  # tenants whose next request cannot join this step
        loads = 0
        if newcomers and not pressed:  # the newcomers join first, alone
            others = {request.tenant for request in self.waiting if request.tenant not in newcomers}
            before = len(self.running)
            budget, loads, blocked = self._admit(out, budget, passed | others, loads)
            if len(self.running) > before:  # a newcomer's step: the held-back prefills wait for the next
                self._held_back.update(request.request_id for request in prefills)
                return self._finish_plan(out)
            for request in prefills:  # no newcomer could join: the step is an ordinary one after all
                if budget > 0 and self._add_chunk(out, request, budget):
                    budget -= out.chunks[-1].num_tokens
            if blocked:  # a newcomer that may not be passed over again: nobody joins behind it
                return self._finish_plan(out)
            passed.update(newcomers)  # they were tried
        if not pressed:
            self._admit(out, budget, passed, loads)
        return self._finish_plan(out)

    def _schedule_running(self, out: StepPlan, budget: int, hold_back: bool) -> tuple[int, list[Request]]:
        """The running requests' next chunks, in admission order, preempting the latest admitted when the
        pool runs out. With `hold_back`, prefill chunks of requests not held back before are left out
        and returned: they run only if no newcomer joins."""
        held: list[Request] = []
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            remaining = request.num_tokens - request.num_computed_tokens
            if request.num_pending_tokens and self.stop.stops_by_length(request):
                index += 1  # ends when its pending token lands: nothing left to compute
                continue
            if hold_back and remaining > 1 and request.request_id not in self._held_back:
                held.append(request)
                index += 1
                continue
            if self._add_chunk(out, request, budget):
                budget -= out.chunks[-1].num_tokens
                index += 1
                continue
            victim = self.running[-1]  # latest admitted, never one already scheduled this step
            self.preempt(victim)
            out.preempted.append(victim)
            if victim in held:
                held.remove(victim)
        return budget, held

    def _add_chunk(self, out: StepPlan, request: Request, budget: int) -> bool:
        """Plan the running request's next chunk within `budget`, if the pool has its pages."""
        count = min(request.num_tokens - request.num_computed_tokens, budget)
        if not self._reserve(request, request.num_computed_tokens + count):
            return False
        out.chunks.append(self._chunk(request, count))
        return True

    def _admit(self, out: StepPlan, budget: int, passed: set[Tenant], loads: int) -> tuple[int, int, bool]:
        """Waiting requests join while the budget, the batch and the pool allow, in fairness (or
        arrival) order, skipping the tenants in `passed` (which grows by those that cannot join now).
        Returns the budget left, the adapter loads begun this step, and whether admission stopped
        behind a request that cannot join and may not be passed over."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            picked = self._next_waiting(passed)
            if picked is None:
                break
            request = picked
            # Its cached prefix is taken only once it joins; until then, size it as if it had.
            start = max(request.num_computed_tokens, self._cached_tokens(request))
            count = min(request.num_tokens - start, budget)
            if request.adapter is not None and not request.holds_adapter:
                assert self.adapters is not None, "a request names an adapter but the engine serves none"
                if request.adapter in self.adapters.failed:
                    self.finish(request, "error")  # refused while it waited: it will never run
                    out.refused.append(request)
                    continue
                adapter_pages = self.adapters.pages_needed(request.adapter)
                loading = adapter_pages > 0
                if loading and loads >= self.max_adapter_loads_per_step:
                    if self._pass_over(request, passed, starving=False):
                        continue
                    return budget, loads, True
                kv_pages = self.pages_for(start + count) - max(len(request.pages), start // self.page_size)
                can_free = self.pool.num_free + self.pool.reclaimable_pages()
                if (loading and can_free < adapter_pages + kv_pages) or not self.adapters.acquire(
                    request.adapter
                ):
                    # Not with its adapter, not now: it waits for pages to be freed, while other
                    # tenants go ahead of it for a while (fairness) or nobody does (FCFS).
                    if self._pass_over(request, passed, starving=True):
                        continue
                    return budget, loads, True
                loads += loading
                request.holds_adapter = True
            if self.prefix_cache is not None and not request.pages:
                self.prefix_cache.take(request)  # after the adapter's pages: they may evict cached ones
                count = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._reserve(request, request.num_computed_tokens + count):
                self._release(request)
                request.num_computed_tokens = 0
                return budget, loads, True
            self.waiting.remove(request)
            self._bypassed.pop(request.request_id, None)
            if self.fairness is not None:
                self.fairness.admitted(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(self._chunk(request, count))
            budget -= count
        return budget, loads, False

    def _finish_plan(self, out: StepPlan) -> StepPlan:
        if self.adapters is not None:
            out.adapter_loads = self.adapters.pending_loads()
        return out

    def _newcomers(self, out: StepPlan) -> set[Tenant]:
        """With fairness: the under-served tenants (nothing running, least counter) whose request joins
        first and alone this step. When the running batch has no free slot, one running request of the
        tenant running the most (two or more) gives its slot up, preempted (its full pages stay in the
        prefix cache), so the newcomer does not wait for another tenant's long request to end; each
        request yields like that at most once, and only to a newcomer whose adapter, if any, is resident
        (one that would wait for pages anyway takes nobody's slot)."""
        if self.fairness is None or not self.light_newcomer_steps:
            return set()
        newcomers = self.fairness.newcomers()
        if not newcomers or len(self.running) < self.max_num_seqs:
            return newcomers
        ready = any(r.tenant in newcomers and self._adapter_ready(r) for r in self.waiting)
        victim = self._yielding_request() if ready else None
        if victim is None:
            return set()
        self._yielded.add(victim.request_id)
        self.preempt(victim)
        out.preempted.append(victim)
        return newcomers

    def _adapter_ready(self, request: Request) -> bool:
        if request.adapter is None or request.holds_adapter:
            return True
        assert self.adapters is not None
        return (
            request.adapter not in self.adapters.failed and self.adapters.pages_needed(request.adapter) == 0
        )

    def _yielding_request(self) -> Request | None:
        """The running request that gives its slot to a newcomer: of the tenant with the most running
        (at least two: a tenant never loses its last), the one with the least computed (the least to
        recompute; the latest admitted of equals) that has not yielded before."""
        by_tenant: dict[Tenant, list[Request]] = {}
        for request in self.running:
            by_tenant.setdefault(request.tenant, []).append(request)
        fairness = self.fairness
        assert fairness is not None
        tenants = sorted(
            (t for t, rs in by_tenant.items() if len(rs) >= 2),
            key=lambda t: (len(by_tenant[t]), fairness.counter(t)),
            reverse=True,
        )
        for tenant in tenants:
            candidates = [r for r in by_tenant[tenant] if r.request_id not in self._yielded]
            if candidates:
                return min(reversed(candidates), key=lambda r: r.num_computed_tokens)
        return None

    def _next_waiting(self, passed: set[Tenant]) -> Request | None:
        """The waiting request to try next: the queue's front (FCFS), or the fairness pick."""
        if self.fairness is None:
            return self.waiting[0]
        return self.fairness.pick(self.waiting, passed)

    def _pass_over(self, request: Request, passed: set[Tenant], starving: bool) -> bool:
        """Whether admission may go on past `request`, which cannot join now. FCFS never passes; with
        fairness its tenant waits out this step, unless it was passed over for lack of pages on
        `max_bypass_steps` steps already: then admission stops behind it until it fits."""
        if self.fairness is None:
            return False
        if starving:
            steps = self._bypassed.get(request.request_id, 0)
            if steps >= self.max_bypass_steps:
                return False
            if request.tenant not in passed:  # once per step
                self._bypassed[request.request_id] = steps + 1
        passed.add(request.tenant)
        return True

    def postprocess(self, plan: StepPlan, sampled: Sequence[int]) -> list[Request]:
        """After the step ran `plan.chunks`: their tokens are in the cache; `sampled` holds the next
        token of each of `plan.sampling`, in order. Appends them and finishes the requests that stop.
        Returns the requests that sampled (finished ones included)."""
        self.advance(plan)
        return self.land(plan, sampled)

    def advance(self, plan: StepPlan) -> None:
        """The step is launched: its chunks count as computed and each sampling request has one pending
        token, so the next step can be planned before this one's tokens are read (async scheduling)."""
        for chunk in plan.chunks:
            chunk.request.num_computed_tokens = chunk.end
        for request in plan.sampling:
            request.num_pending_tokens += 1

    def land(self, plan: StepPlan, sampled: Sequence[int]) -> list[Request]:
        """The advanced step's tokens are read: `sampled` holds the next token of each of
        `plan.sampling`, in order. Its pages join the prefix cache, the tokens replace the pending ones,
        and the requests that stop finish. A request that ended while the step was in flight (aborted,
        or stopped by the step before) takes nothing. Returns the requests that took a token."""
        requests = plan.sampling
        if len(requests) != len(sampled):
            raise ValueError(f"the step sampled {len(sampled)} tokens for {len(requests)} requests")
        if self.prefix_cache is not None:
            for chunk in plan.chunks:
                if chunk.request.status is RequestStatus.RUNNING:  # its pages filled by the step are shared
                    self.prefix_cache.commit(chunk.request, upto=chunk.end)
        took = []
        for request, token in zip(requests, sampled, strict=True):
            if request.finished:
                continue
            took.append(request)
            request.num_pending_tokens -= 1
            if self.fairness is not None:
                self.fairness.generated(request)
            reason = self.stop.append(request, token)
            if reason is not None:
                self.finish(request, reason)
        return took

    def rollback(self, plan: StepPlan) -> None:
        """Undo `advance` for a step whose results are dropped (its successor's fault path): its chunks
        are to be computed again and its pending tokens sampled again (seeded draws repeat)."""
        for chunk in plan.chunks:
            request = chunk.request
            if request.finished:
                continue
            if chunk.samples and request.num_pending_tokens:
                request.num_pending_tokens -= 1
            if request.status is RequestStatus.RUNNING:
                request.num_computed_tokens = min(request.num_computed_tokens, chunk.start)

    def _reserve(self, request: Request, num_tokens: int) -> bool:
        """Make sure the request owns pages for `num_tokens` tokens; False if the pool cannot."""
        needed = self.pages_for(num_tokens) - len(request.pages)
        if needed <= 0:
            return True
        if not self.pool.can_allocate(needed):
            # Unused adapters and unread cached prefixes give way to the KV cache, LRU first.
            self.pool.reclaim(needed)
        if not self.pool.can_allocate(needed):
            return False
        request.pages.extend(self.pool.allocate(needed, request.request_id, PageKind.KV))
        return True

    def preempt(self, request: Request) -> None:
        """Free the request's pages and put it first in the queue; its tokens are recomputed later."""
        self.running.remove(request)
        self._release(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        if self.fairness is not None:
            self.fairness.preempted(request)
        self.waiting.appendleft(request)

    def finish(self, request: Request, reason: str) -> None:
        if request.finished:
            return
        was_running = request in self.running
        was_waiting = not was_running and request in self.waiting
        if was_running:
            self.running.remove(request)
        elif was_waiting:
            self.waiting.remove(request)
        if self.fairness is not None and (was_running or was_waiting):  # never queued: nothing counted
            self.fairness.finished(request, was_running)
        self._bypassed.pop(request.request_id, None)
        self._held_back.discard(request.request_id)
        self._yielded.discard(request.request_id)
        self._release(request)
        if self.prefix_cache is not None:
            self.prefix_cache.forget_request(request)
        if request.adapter is not None and self.adapters is not None:
            self.adapters.remove_user(request.adapter)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def _cached_tokens(self, request: Request) -> int:
        """Tokens the prefix cache would give a waiting request that holds no pages."""
        if self.prefix_cache is None or request.pages:
            return 0
        return self.prefix_cache.peek(request)

    def _release(self, request: Request) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.release(request)  # cached pages stay, for the next request (or its retry)
        else:
            self.pool.free(request.pages, request.request_id)
        request.pages = []
        self._release_adapter(request)

    def _release_adapter(self, request: Request) -> None:
        if request.holds_adapter:
            assert self.adapters is not None and request.adapter is not None
            self.adapters.release(request.adapter)
            request.holds_adapter = False
