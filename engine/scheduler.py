"""Continuous batching: which tokens of which requests run in the next step, and what the step changed.

Every step, requests join and leave the running batch. A request is a list of tokens of which the first
`num_computed_tokens` have keys and values in the cache; a step computes the next chunk of each
scheduled request, so a prefill and a decode are the same thing with different chunk lengths. Chunks
fit a per-step token budget, which is how long prompts are prefilled in pieces beside running decodes.
When the pool has no page for a running request, the most recently admitted request is preempted: its
pages are freed and it goes back to the front of the queue, to be recomputed from its tokens later.
What varies is chosen once, as policy objects (vLLM V1's request queues), so this file is one algorithm:
which waiting request goes next (`queue`: engine/fairness.py's FirstComeQueue or FairQueue), whether a
request may join as far as its adapter goes (`admission`: engine/admission.py; a request with an adapter
joins only when the pool can hold both its adapter's pages and its first chunk's), and where a request's
pages start and go (`prefix_cache`: engine/prefix_cache.py's PrefixCache, or NoPrefixCache).

A step is a plan (`schedule` → StepPlan: the chunks to run, who was preempted, the adapters the loader
must copy into pages already handed out, the requests refused), then `postprocess(plan, sampled)`:
advance, append, finish. Pipelined (async scheduling), the two halves are apart: `advance(plan)` at
launch (its sampled tokens are pending: counted, ids unknown), the next plan, then `land(plan,
sampled)`. Plain bookkeeping: no torch and no file access (tests/engine/test_torch_free.py proves
both), tested on the CPU in milliseconds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from .admission import AdapterAdmission, Admission, BaseModelAdmission, Verdict
from .fairness import FirstComeQueue, RequestQueue, Tenant
from .lora.registry import AdapterLoad, AdapterRegistry
from .pool import PageKind, PagePool
from .prefix_cache import NoPrefixCache, PrefixCache
from .request import Request, RequestStatus
from .speculative import NgramProposer, SpecStats
from .stopping import StopChecker


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int  # index of the chunk's first token in the request's token list
    num_tokens: int
    # The chunk reaches the end of the request's tokens, so the step samples its next token. Fixed when
    # scheduled: postprocess appends that token, after which the end is no longer the end.
    samples: bool
    # Speculative decoding: the draft tokens after the request's last known token, computed in this chunk
    # (its last len(draft) tokens) and verified when the step lands (engine/speculative.py).
    draft: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass(frozen=True)
class StepPlan:
    """One step, decided: run `chunks` (in this order once the runner ordered them), after copying
    `adapter_loads` into their pages. `preempted` went back to the queue; `refused` were ended because
    their adapter is refused (their finish_reason is "error"). A value: the scheduler fills its lists
    while it plans, and whoever changes a plan afterwards (orders its chunks, drops ended requests) makes
    a new one (`with_chunks`, `keeping`)."""

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

    def with_chunks(self, chunks: Iterable[ScheduledChunk]) -> StepPlan:
        """This plan running `chunks` instead."""
        return replace(self, chunks=list(chunks))

    def keeping(self, keep: Callable[[ScheduledChunk], bool]) -> StepPlan:
        """This plan without the chunks `keep` rejects."""
        return self.with_chunks(chunk for chunk in self.chunks if keep(chunk))


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
        queue: RequestQueue | None = None,
        prefix_cache: PrefixCache | NoPrefixCache | None = None,
        proposer: NgramProposer | None = None,
    ):
        """The policies are chosen here, once: `adapters` (a registry: adapter-aware admission; None: every
        request is the base model's), `queue` (which waiting request goes next: first come first served
        unless a FairQueue is given), `prefix_cache` (admission starts a request past its longest
        cached prefix; None: no caching) and `proposer` (speculative decoding: decodes that may carry a
        draft get one from it; None: no drafts)."""
        if page_size <= 0 or max_num_seqs <= 0 or max_batch_tokens <= 0:
            raise ValueError("page_size, max_num_seqs and max_batch_tokens must be positive")
        self.pool = pool
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.adapters = adapters  # the registry the admission policy consults, for the loader and tests
        self.admission: Admission = (
            BaseModelAdmission()
            if adapters is None
            else AdapterAdmission(adapters, pool, max_adapter_loads_per_step)
        )
        self.queue: RequestQueue = queue or FirstComeQueue()
        self.prefix_cache: PrefixCache | NoPrefixCache = prefix_cache or NoPrefixCache(pool)
        # No end-of-sequence token and no context limit unless the engine says so: max_tokens ends it.
        self.stop = stop or StopChecker(eos_token_ids=(), max_model_len=2**62)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the front has priority
        self.proposer = proposer
        self.spec = SpecStats()

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def add(self, request: Request) -> None:
        """Queue a request; one naming an adapter counts as its user until it ends."""
        self.admission.add(request)
        request.status = RequestStatus.WAITING
        self.queue.queued(request)
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _chunk(self, request: Request, count: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        return ScheduledChunk(request, start, count, samples=start + count == request.num_tokens)

    def schedule(self) -> StepPlan:
        """The running requests' next chunks (preempting when the pool runs out), then, unless that
        preempted, waiting requests join: an under-served tenant's newcomers first and alone."""
        out = StepPlan()
        self.admission.begin_step()
        newcomers = self._newcomers(out)
        made_room = len(out.preempted)
        budget, prefills = self._schedule_running(out, self.max_batch_tokens, hold_back=bool(newcomers))
        pressed = len(out.preempted) > made_room  # preempted for lack of pages: nobody joins this step
        passed: set[Tenant] = set()  # tenants whose next request cannot join this step
        if newcomers and not pressed:  # the newcomers join first, alone
            others = {request.tenant for request in self.waiting if request.tenant not in newcomers}
            before = len(self.running)
            budget, blocked = self._admit(out, budget, passed | others)
            if len(self.running) > before:  # a newcomer's step: the held-back prefills wait for the next
                self.queue.held_back(prefills)
                return self._finish_plan(out)
            for request in prefills:  # no newcomer could join: the step is an ordinary one after all
                if budget > 0 and self._add_chunk(out, request, budget):
                    budget -= out.chunks[-1].num_tokens
            if blocked:  # a newcomer that may not be passed over again: nobody joins behind it
                return self._finish_plan(out)
            passed.update(newcomers)  # they were tried
        if not pressed:
            self._admit(out, budget, passed)
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
            if request.draft_in_flight:
                index += 1  # how many of its draft tokens hold is known when its step lands
                continue
            if hold_back and remaining > 1 and self.queue.may_hold_back(request):
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
        """Plan the running request's next chunk within `budget`, if the pool has its pages. A decode
        that may draft carries its draft when the budget and free pages allow (a draft never preempts)."""
        count = min(request.num_tokens - request.num_computed_tokens, budget)
        if count == 1 and budget > 1:
            draft = self._draft(request, budget - 1)
            if draft and self._reserve_draft(request, request.num_computed_tokens + 1 + len(draft)):
                start = request.num_computed_tokens
                out.chunks.append(ScheduledChunk(request, start, 1 + len(draft), True, tuple(draft)))
                return True
        if not self._reserve(request, request.num_computed_tokens + count):
            return False
        out.chunks.append(self._chunk(request, count))
        return True

    def _draft(self, request: Request, budget: int) -> list[int]:
        """The request's draft for this step (empty: it decodes one token). Only a request whose last
        token is known (none pending), that asks for no logprobs, penalties, bias or grammar, and has room
        for more than one token before max_tokens and the context end drafts."""
        if self.proposer is None or request.num_pending_tokens or request.num_computed_tokens == 0:
            return []
        params = request.params
        if not request.may_draft:
            return []
        limit = min(
            budget,
            params.max_tokens - request.num_generated - 1,
            self.stop.max_model_len - request.num_tokens,
        )
        if params.num_speculative_tokens is not None:
            limit = min(limit, params.num_speculative_tokens)
        if limit <= 0:
            return []
        if request.ngrams is None:
            request.ngrams = self.proposer.index()
        return self.proposer.propose(request.ngrams, request, limit)

    def _admit(self, out: StepPlan, budget: int, passed: set[Tenant]) -> tuple[int, bool]:
        """Waiting requests join while the budget, the batch and the pool allow, in the queue's order,
        skipping the tenants in `passed` (which grows by those that cannot join now). Returns the budget
        left and whether admission stopped behind a request that cannot join and may not be passed
        over."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.queue.pick(self.waiting, passed)
            if request is None:
                break
            # Its cached prefix is taken only once it joins; until then, size it as if it had.
            start = max(request.num_computed_tokens, self._cached_tokens(request))
            count = min(request.num_tokens - start, budget)
            kv_pages = self.pages_for(start + count) - max(len(request.pages), start // self.page_size)
            verdict = self.admission.admit(request, kv_pages)
            if verdict is Verdict.REFUSED:
                self.finish(request, "error")  # refused while it waited: it will never run
                out.refused.append(request)
                continue
            if verdict is not Verdict.JOIN:
                # Not with its adapter, not now: it waits for a load slot or for pages to be freed, while
                # other tenants go ahead of it for a while (fairness) or nobody does (FCFS).
                if self.queue.pass_over(request, passed, starving=verdict is Verdict.STARVED):
                    continue
                return budget, True
            if not request.pages:
                self.prefix_cache.take(request)  # after the adapter's pages: they may evict cached ones
                count = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._reserve(request, request.num_computed_tokens + count):
                self._release(request)
                request.num_computed_tokens = 0
                return budget, True
            self.waiting.remove(request)
            self.queue.admitted(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(self._chunk(request, count))
            budget -= count
        return budget, False

    def _finish_plan(self, out: StepPlan) -> StepPlan:
        return replace(out, adapter_loads=self.admission.pending_loads())

    def _newcomers(self, out: StepPlan) -> set[Tenant]:
        """The tenants whose request joins first and alone this step (the queue's rule: none under FCFS);
        the running request that gives its slot up for them is preempted here."""
        full = len(self.running) >= self.max_num_seqs
        newcomers, yielding = self.queue.newcomers(self.running, self.waiting, full, self.admission.ready)
        if yielding is not None:
            self.preempt(yielding)
            out.preempted.append(yielding)
        return newcomers

    def postprocess(
        self, plan: StepPlan, sampled: Sequence[int], accepted: Sequence[int] | None = None
    ) -> list[Request]:
        """After the step ran `plan.chunks`: their tokens are in the cache; `sampled` holds the next
        token of each of `plan.sampling`, in order (`accepted`: how many draft tokens of each held, see
        `land`). Appends them and finishes the requests that stop. Returns the requests that sampled
        (finished ones included)."""
        self.advance(plan)
        return self.land(plan, sampled, accepted)

    def advance(self, plan: StepPlan) -> None:
        """The step is launched: its chunks count as computed and each sampling request has one pending
        token, so the next step can be planned before this one's tokens are read (async scheduling)."""
        for chunk in plan.chunks:
            # A draft's tokens count once verified (land): until then the request is one token further.
            chunk.request.num_computed_tokens = chunk.end - len(chunk.draft)
            chunk.request.draft_in_flight = len(chunk.draft)
        for request in plan.sampling:
            request.num_pending_tokens += 1

    def land(
        self, plan: StepPlan, sampled: Sequence[int], accepted: Sequence[int] | None = None
    ) -> list[Request]:
        """The advanced step's tokens are read: `sampled` holds the next token of each of
        `plan.sampling`, in order, and `accepted` (speculative decoding; None: no drafts) how many of each
        one's draft tokens held, the sampled token following them. Its pages join the prefix cache (a
        draft's only as far as it held), the tokens replace the pending ones, and the requests that stop
        finish. A request that ended while the step was in flight (aborted, or stopped by the step
        before) takes nothing. Returns the requests that took a token."""
        requests = plan.sampling
        if len(requests) != len(sampled) or (accepted is not None and len(accepted) != len(sampled)):
            raise ValueError(f"the step sampled {len(sampled)} tokens for {len(requests)} requests")
        drafts = {c.request.request_id: c for c in plan.chunks if c.draft}
        held: dict[str, int] = {}
        for i, request in enumerate(requests):
            chunk = drafts.get(request.request_id)
            if chunk is not None:
                held[request.request_id] = self._verified(chunk, accepted[i] if accepted is not None else 0)
        for chunk in plan.chunks:
            # Its pages filled by the step are shared (a draft's once its tokens are appended, below).
            if chunk.request.status is RequestStatus.RUNNING and not chunk.draft:
                self.prefix_cache.commit(chunk.request, upto=chunk.end)
        took = []
        for request, token in zip(requests, sampled, strict=True):
            if request.finished:
                continue
            took.append(request)
            request.num_pending_tokens -= 1
            chunk = drafts.get(request.request_id)
            landed = [*chunk.draft[: held[request.request_id]], token] if chunk is not None else [token]
            reason = None
            for each in landed:
                self.queue.generated(request)
                reason = self.stop.append(request, each)
                if reason is not None:
                    break
            if chunk is not None and request.status is RequestStatus.RUNNING:
                # Through the accepted tokens, whose ids the page keys are made of: appended now.
                upto = min(chunk.end - len(chunk.draft) + held[request.request_id], request.num_known_tokens)
                self.prefix_cache.commit(request, upto=upto)
            if reason is not None:
                self.finish(request, reason)
        return took

    def _verified(self, chunk: ScheduledChunk, accepted: int) -> int:
        """A landed draft chunk: `accepted` of its draft tokens held. The request is computed through them
        (the rest of the draft's keys and values are overwritten when those positions are computed
        again) and gives back the pages it no longer needs. Returns the accepted count, bounded."""
        request = chunk.request
        request.draft_in_flight = 0
        if request.finished:
            return 0
        accepted = max(0, min(int(accepted), len(chunk.draft)))
        if self.proposer is not None and request.ngrams is not None:
            self.proposer.verified(request.ngrams, len(chunk.draft), accepted)
        self.spec.drafts += 1
        self.spec.draft_tokens += len(chunk.draft)
        self.spec.accepted_tokens += accepted
        base = chunk.end - len(chunk.draft)
        if request.status is RequestStatus.RUNNING and request.num_computed_tokens == base:
            request.num_computed_tokens = base + accepted
            keep = self.pages_for(base + accepted + 1)  # the token sampled after them is computed next
            if len(request.pages) > keep:
                tail = request.pages[keep:]
                del request.pages[keep:]
                self.pool.free(tail, request.request_id)
        return accepted

    def rollback(self, plan: StepPlan) -> None:
        """Undo `advance` for a step whose results are dropped (its successor's fault path): its chunks
        are to be computed again and its pending tokens sampled again (seeded draws repeat)."""
        for chunk in plan.chunks:
            request = chunk.request
            if request.finished:
                continue
            if chunk.samples and request.num_pending_tokens:
                request.num_pending_tokens -= 1
            if chunk.draft:
                request.draft_in_flight = 0
            if request.status is RequestStatus.RUNNING:
                request.num_computed_tokens = min(request.num_computed_tokens, chunk.start)

    def _reserve_draft(self, request: Request, num_tokens: int) -> bool:
        """Pages for a decode with its draft, only from free pages and only while a page per running
        request is left beside them: a draft never evicts, nor takes the page another decode needs."""
        needed = self.pages_for(num_tokens) - len(request.pages)
        if needed <= 0:
            return True
        if not self.pool.can_allocate(needed + len(self.running)):
            return False
        request.pages.extend(self.pool.allocate(needed, request.request_id, PageKind.KV))
        return True

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
        request.draft_in_flight = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.queue.preempted(request)
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
        self.queue.finished(request, was_running, was_waiting)
        self._release(request)
        self.prefix_cache.forget_request(request)
        self.admission.finished(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def _cached_tokens(self, request: Request) -> int:
        """Tokens the prefix cache would give a waiting request that holds no pages."""
        return 0 if request.pages else self.prefix_cache.peek(request)

    def _release(self, request: Request) -> None:
        self.prefix_cache.release(request)  # cached pages stay, for the next request (or its retry)
        self.admission.release(request)
