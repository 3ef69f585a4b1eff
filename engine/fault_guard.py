"""The step's fault guard: one tenant's adapter or request must not fail another tenant's request.

A step that raises (or yields logits that are not finite) is run again once; if it fails again, the batch
is bisected by adapter to find the adapters whose requests fail on their own. Only their requests end,
with `adapter_failed`, the adapters are refused from then on, and the rest of the batch runs. Non-finite
logits no adapter explains end only the requests they belong to (rows do not mix), with `engine_error`.
A failure nothing explains is raised (as `StepError`, after the one retry) for the server to fail the
step's requests. Sampling is part of each request's fault domain too: a row that cannot be sampled
(parameters that got past every check) ends that request alone with `engine_error`, and the rest of the
step is sampled without it.

The guard decides; the runner does the device work (every forward of a retry or a bisection is the
runner's), and the engine ends the requests (`EndRequests`: their pages zeroed, the outputs made).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from loraplex.wire import ADAPTER_FAILED, ENGINE_ERROR
from loraplex.wire.errors import StepError

from .lora.registry import AdapterRegistry
from .prompt_logprobs import PromptScores
from .request import Request, RequestOutput
from .runner import ModelRunner, NonFiniteLogits, StepHandle
from .sampler import DraftLogits
from .scheduler import ScheduledChunk, Scheduler, StepPlan

log = logging.getLogger(__name__)

# Ends requests with an error: (the requests, the message they carry, the wire error code) -> outputs.
EndRequests = Callable[[list[Request], str, str], list[RequestOutput]]


class FaultGuard:
    def __init__(
        self, runner: ModelRunner, scheduler: Scheduler, registry: AdapterRegistry, end: EndRequests
    ):
        self.runner = runner
        self.scheduler = scheduler
        self.registry = registry
        self.end = end

    def launch(
        self, plan: StepPlan, outputs: list[RequestOutput], feed: StepHandle | None = None
    ) -> StepHandle:
        """Queue the plan's (ordered) forward and sampling; nothing is read. The requests whose rows
        cannot be sampled end (their outputs appended to `outputs`) and leave the handle's plan."""
        logits, finite, scores, drafts = self.runner.forward(plan.chunks, feed)
        return self.sample(plan, logits, finite, outputs, scores, drafts)

    def run(
        self, plan: StepPlan, failed: Exception | None = None
    ) -> tuple[StepHandle | None, list[RequestOutput]]:
        """Launch the plan's (ordered) chunks and read their finite flags, isolating a fault to the
        requests or adapters that caused it. `failed`: the error its launch already raised (the
        isolation's retry is the next run). Returns the handle whose tokens are ready to read (None: no
        chunk survived) and the outputs of the requests the guard ended."""
        outputs: list[RequestOutput] = []
        if not plan.chunks:
            return None, outputs
        try:
            if failed is not None:
                raise failed
            handle = self.launch(plan, outputs)
            plan = handle.plan
            # The step's one device-to-host copy: tokens, finite flags, logprobs. Rows that are not
            # finite fail the step before any token or logprob lands on a request.
            handle.check()
        except Exception as error:
            chunks, survived = self.isolate(plan.chunks, error, outputs)
            if survived is None:
                return None, outputs
            logits, scores, drafts = survived
            try:
                handle = self.sample(plan.with_chunks(chunks), logits, None, outputs, scores, drafts)
            except Exception as still:  # no row explains it: the step's failure, after what it ended
                raise StepError(still, outputs) from still
        return handle, outputs

    def sample(
        self,
        plan: StepPlan,
        logits: torch.Tensor,
        finite: torch.Tensor | None,
        outputs: list[RequestOutput],
        scores: PromptScores | None = None,
        drafts: DraftLogits | None = None,
    ) -> StepHandle:
        """Sample the plan's sampling rows of logits [S, V] (`finite` [S]: the step's unread finite flags,
        if any; `scores`: the forward's prompt scores, landing with the tokens), inside each request's
        fault domain: sampling is per request, so if it raises, each row is sampled alone; the requests
        whose rows fail end (engine_error, with the reason, appended to `outputs`) and leave the plan, and
        the others are sampled without them, drawing what they would have drawn. A failure no row explains
        alone is raised."""
        requests = plan.sampling
        try:
            return self.runner.sample(plan, logits, finite, scores=scores, drafts=drafts)
        except Exception as error:
            reasons = {i: self.runner.sampling_failure(logits, i, r) for i, r in enumerate(requests)}
            failing = {i: why for i, why in reasons.items() if why is not None}
            if not failing:
                raise
            log.warning("sampling a step failed (%s: %s)", type(error).__name__, error)
        for i, why in failing.items():
            message = f"sampling failed for this request ({why}); check its sampling parameters"
            outputs.extend(self.end([requests[i]], message, ENGINE_ERROR))
            log.warning("sampling failed for %s: %s", requests[i].request_id, why)
        ended = {requests[i].request_id for i in failing}
        kept = [i for i in range(len(requests)) if i not in failing]
        rest = plan.keeping(lambda chunk: chunk.request.request_id not in ended)
        return self.runner.sample(rest, logits, finite, rows=kept, scores=scores, drafts=drafts)

    def isolate(
        self, chunks: list[ScheduledChunk], error: Exception, outputs: list[RequestOutput]
    ) -> tuple[list[ScheduledChunk], tuple[torch.Tensor, PromptScores, DraftLogits | None] | None]:
        """After a failed forward: retry once; then end the requests of the adapters that fail on their
        own (appending their outputs) and run the rest. Non-finite logits no adapter explains end only
        the requests they belong to (rows do not mix). Returns the chunks that ran and their logits and
        prompt scores (None: no chunk is left)."""
        log.warning("a step failed (%s: %s); running it again", type(error).__name__, error)
        try:
            return chunks, self.runner.checked_logits(chunks)
        except Exception as again:
            error = again
        guilty = self.guilty_adapters(chunks)
        if not guilty and not isinstance(error, NonFiniteLogits):
            raise StepError(error, outputs) from error
        for name, reason in guilty.items():
            outputs.extend(self.fail_adapter(name, reason))
        rest = [c for c in chunks if c.request.adapter not in guilty]
        if not guilty:
            assert isinstance(error, NonFiniteLogits)
            rest = self.fail_rows(rest, error, outputs)
        try:
            return rest, self.runner.checked_logits(rest) if rest else None
        except NonFiniteLogits as bad:
            rest = self.fail_rows(rest, bad, outputs)
        except Exception as still:
            raise StepError(still, outputs) from still
        try:
            return rest, self.runner.checked_logits(rest) if rest else None
        except Exception as still:
            raise StepError(still, outputs) from still

    def guilty_adapters(self, chunks: list[ScheduledChunk]) -> dict[str, str]:
        """The adapters whose chunks fail when run without the others, found by bisecting the step's
        adapters (a few forwards for one bad adapter among many), each with the error it raised."""
        by_adapter: dict[str, list[ScheduledChunk]] = {}
        for chunk in chunks:
            if chunk.request.adapter is not None:
                by_adapter.setdefault(chunk.request.adapter, []).append(chunk)

        def failure(names: list[str]) -> str | None:
            try:
                self.runner.checked_logits([c for n in names for c in by_adapter[n]])
            except Exception as error:
                return f"{type(error).__name__}: {error}"
            return None

        guilty: dict[str, str] = {}

        def search(names: list[str]) -> None:
            if not names:  # a step of the base model alone: no adapter to blame
                return
            reason = failure(names)
            if reason is None:
                return
            if len(names) == 1:
                guilty[names[0]] = reason
                return
            half = len(names) // 2
            search(names[:half])
            search(names[half:])

        search(list(by_adapter))
        return guilty

    def fail_rows(
        self, chunks: list[ScheduledChunk], bad: NonFiniteLogits, outputs: list[RequestOutput]
    ) -> list[ScheduledChunk]:
        """End the requests whose logits were not finite (engine_error); the chunks of the others."""
        message = "the model produced non-finite logits for this request"
        ended = [c.request for c in chunks if c.request.request_id in bad.request_ids]
        outputs.extend(self.end(ended, message, ENGINE_ERROR))
        log.warning("%s: ended %s", message, ", ".join(r.request_id for r in ended))
        return [c for c in chunks if c.request.request_id not in bad.request_ids]

    def fail_adapter(self, name: str, reason: str) -> list[RequestOutput]:
        """Refuse adapter `name` from now on and end every request that uses it; the others go on."""
        message = f"adapter {name!r} failed while running: {reason}"
        queued = (*self.scheduler.running, *self.scheduler.waiting)
        victims = [r for r in queued if r.adapter == name and not r.finished]
        outputs = self.end(victims, message, ADAPTER_FAILED)
        self.registry.mark_failed(name, message)
        log.warning("%s; ended %d request(s) that used it", message, len(victims))
        return outputs
