"""LLMEngine: the offline API. `step()` is schedule → load adapters → run → sample → postprocess;
`generate()` loops it.

One tenant's adapter must not fail another tenant's request. An adapter that cannot be loaded ends only
its own requests (adapter_failed, or adapter_unavailable when its store did not answer). A step that
raises (or yields logits that are not finite) is run again once; if it fails again, the batch is
bisected by adapter to find the adapters whose requests fail on their own. Only their requests end,
with `adapter_failed`, the adapters are refused from then on, and the rest of the batch runs. A failure
no adapter explains is raised (as `StepError`, after the one retry) for the server to fail the step's
requests. Sampling is part of each request's fault domain too: a row that cannot be sampled (parameters
that got past every check) ends that request alone with `engine_error`, on the plain and pipelined paths
and after the retry, and the rest of the step is sampled without it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from loraplex.adapters import AdapterManifest, BaseShape

# Why a request ended with an error (finish_reason "error"): the wire contract's codes. ADAPTER_FAILED: the
# adapter is at fault, refused until registered with other weights; ADAPTER_UNAVAILABLE: its store could not
# be read, retry later; ENGINE_ERROR: the engine's own failure.
from loraplex.wire import ADAPTER_FAILED, ADAPTER_UNAVAILABLE, ENGINE_ERROR
from loraplex.wire.errors import RefusedAdapterError, StepError, UnknownAdapterError
from loraplex.wire.limits import LimitExceeded

from .batch import DecodeBuckets
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .fairness import VirtualTokenCounter
from .graphs import CudaGraphBackend, DecodeGraphs
from .kv_cache import KVCache, page_bytes
from .lora.loader import AdapterLoader, LoadFailed, LoadFailure
from .lora.registry import AdapterRegistry
from .lora.report import adapter_report
from .lora.sources import AdapterSource, DirectorySource
from .lora.step import KernelLoraStacker, LoraStacker
from .model.cpu_features import cpu_auto_dtype
from .model.loader import LoadedModel, load_model
from .model.quantize_weights import weight_bytes
from .pool import PageKind, PagePool
from .prefix_cache import PrefixCache
from .request import OutputState, Request, RequestOutput, RequestStatus, SamplingState
from .runner import ModelRunner
from .sampler import StepSample, sample_step
from .sampling_params import SamplingParams
from .scheduler import ScheduledChunk, Scheduler, StepPlan
from .stats import AdapterFacts, AdapterInfo, AdapterReport, EngineStats
from .stopping import StopChecker, next_delta
from .warmup import warm_up

log = logging.getLogger(__name__)

Prompt = str | Sequence[int]


@dataclass
class _InFlight:
    """A launched step whose tokens are not read yet (async scheduling): its plan, its sampled tokens on
    the device, and each sampling request's row among them."""

    plan: StepPlan
    sampled: StepSample
    rows: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        self.rows = {request.request_id: i for i, request in enumerate(self.plan.sampling)}


@dataclass
class FailedOutput(RequestOutput):
    """The last output of a request the engine ended with an error, and whose fault that was."""

    error_code: str = ENGINE_ERROR


class RequestTooLarge(ValueError):
    """A request that can never fit this engine; `param` names the field to change."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class NonFiniteLogits(RuntimeError):
    """A step produced NaN or infinite logits for some of its requests (`request_ids`)."""

    def __init__(self, request_ids: list[str]):
        super().__init__(f"the logits of {', '.join(request_ids[:8])} are not finite")
        self.request_ids = frozenset(request_ids)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None):
        """Load the model named by `config` (or reuse `loaded`) and size the pool."""
        self.config = config = config or EngineConfig()
        device = config.torch_device()
        dtype = config.torch_dtype(device)
        if config.dtype == "auto" and device.type == "cpu":
            log.info("dtype auto on the CPU: %s, as %s", dtype, cpu_auto_dtype()[1])
        if loaded is None:
            loaded = load_model(
                config.model,
                dtype,
                device,
                config.seed,
                config.max_model_len,
                config.model_cache,
                config.quantization,
            )
        elif (
            loaded.model.dtype != dtype
            or loaded.model.device.type != device.type
            or loaded.quantization != config.quantization
        ):
            raise ValueError(
                f"the loaded model is {loaded.model.dtype} on {loaded.model.device} with quantization "
                f"{loaded.quantization}, the engine config asks for {dtype} on {device} with quantization "
                f"{config.quantization}"
            )
        # Weights first, then the pool: on CUDA the pool takes a share of what the weights leave free,
        # so the bytes quantization saves become KV and adapter pages.
        self.weight_bytes = weight_bytes(loaded.model)
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        model_config = loaded.config
        self.max_model_len: int = min(
            config.max_model_len or model_config.max_position_embeddings,
            loaded.model.rope_cos.shape[0],
        )
        num_pages = config.num_pages or self._pages_that_fit(device, dtype)
        if num_pages < 2:
            raise ValueError("the pool needs at least 2 pages (page 0 is reserved as the zero page)")
        self.pool = PagePool(num_pages)
        # Page 0 stays zero forever: padded block tables and LoRA stacks point at it.
        if self.pool.allocate(1, "zero-page", PageKind.RESERVED) != [0]:
            raise RuntimeError("a fresh pool must hand out page 0 first")
        buckets = None
        if config.graph_ready(device):
            # Padding rows of a graph-ready decode step write their keys and values here, never to a
            # request's page or the zero page (engine/batch.py).
            (padding_page,) = self.pool.allocate(1, "padding-page", PageKind.RESERVED)
            max_blocks = -(-self.max_model_len // config.page_size)
            buckets = DecodeBuckets.up_to(config.max_num_seqs, max_blocks, padding_page)
        self.cache = KVCache(model_config, num_pages, config.page_size, dtype, device)
        head_dim = model_config.head_dim
        self.registry = AdapterRegistry(self.pool, config.max_resident_adapters)
        self.loader = AdapterLoader(
            self.registry,
            self.cache.memory.view(-1, head_dim),
            model_config.lora_shape(),
            rows_per_page=self.cache.pages().shape[1] // head_dim,
            host_cache_bytes=config.adapter_host_cache_bytes,
        )
        eos = self.tokenizer.eos_token_ids if self.tokenizer else model_config.eos_token_ids
        self.prefix_cache: PrefixCache | None = None
        if config.prefix_caching:
            self.prefix_cache = PrefixCache(self.pool, config.page_size, self._adapter_digest)
            self.registry.listeners.append(self.prefix_cache)  # a forgotten adapter's pages go with it
        self.scheduler = Scheduler(
            self.pool,
            config.page_size,
            config.max_num_seqs,
            config.max_batch_tokens,
            self.registry,
            stop=StopChecker(eos, self.max_model_len),
            fairness=VirtualTokenCounter(config.fair_prompt_weight, config.fair_output_weight)
            if config.scheduling == "fair"
            else None,
            prefix_cache=self.prefix_cache,
        )
        use_kernels = config.use_kernels(device)
        stacker = KernelLoraStacker(self.loader) if use_kernels else LoraStacker(self.loader)
        graphs = None
        if buckets is not None and use_kernels and device.type == "cuda":
            # Graph-ready decode steps on CUDA replay captured graphs, one per bucket and adapter set.
            graphs = DecodeGraphs(CudaGraphBackend(device))
        self.runner = ModelRunner(loaded.model, self.cache, stacker, use_kernels, buckets, graphs)
        self._overlap = config.overlaps(device)
        self._in_flight: _InFlight | None = None  # async scheduling: the step launched, not yet read
        if use_kernels:  # compiles every kernel variant now, so no request waits on one; nothing off CUDA
            warm_up(model_config, dtype, config.page_size, config.max_num_seqs, device)
        self._requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._seeds = torch.Generator().manual_seed(config.seed)
        log.info(
            "engine ready: %s, %s, quantization %s, weights %.1f MiB, %d pages of %d tokens (%.1f MiB), "
            "max_model_len %d",
            loaded.source,
            dtype,
            loaded.quantization,
            self.weight_bytes / 2**20,
            num_pages,
            config.page_size,
            num_pages * page_bytes(model_config, config.page_size, dtype) / 2**20,
            self.max_model_len,
        )

    def _adapter_digest(self, name: str) -> str:
        """What the prefix cache keys an adapter's pages by: its weights, never its name."""
        entry = self.registry.entry(name)
        assert entry is not None, f"adapter {name} is not registered"
        return entry.manifest.sha256

    def _pages_that_fit(self, device: torch.device, dtype: torch.dtype) -> int:
        per_page = page_bytes(self.loaded.config, self.config.page_size, dtype)
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * self.config.gpu_memory_fraction)
        else:
            budget = self.config.kv_cache_bytes
        return max(1, budget // per_page)

    # -- adapters -----------------------------------------------------------------------------------

    def register_adapter(
        self, name: str, source: str | Path | AdapterSource, sha256: str | None = None
    ) -> AdapterManifest:
        """Make an adapter servable as `name`: a PEFT directory (a path or file:// URI; with `sha256`,
        only if its weights have that hash) or any AdapterSource. Validated against this model now,
        read and loaded into the pool when a request needs it. Raises AdapterError naming the problem."""
        if isinstance(source, str | Path):
            source = DirectorySource.open(source, self.loader.base, sha256)
        return self.registry.register(name, source, self.loader.pages_for(source.manifest))

    def unregister_adapter(self, name: str) -> bool:
        """Stop serving `name`: new requests naming it are refused at once (it is unknown from now on);
        those already here finish. True if it is forgotten now, False if it drains: its pages and host
        copy are freed when its last request ends. AdapterError if it is not registered."""
        return self.registry.unregister(name)

    def warm_adapter(self, name: str) -> str:
        """Load a registered adapter before any request asks for it: "device" when it is in the pool now,
        "host" when no pages could be had without taking them from a request (its host copy is being
        packed: a request pays the copy into the pool, not the read). AdapterError if it is not registered
        or is refused; LoadFailed when its weights could not be read (at fault, or the store did not
        answer)."""
        load = self.registry.warm(name)
        if load is not None:
            failures = self.loader.load([load])
            if failures:
                self.registry.unwarm(name)
                raise LoadFailed(failures[0])
        entry = self.registry.entry(name)
        if entry is not None and entry.resident and entry.loaded:
            return "device"
        self.loader.prefetch([name])
        return "host"

    def adapter(self, name: str) -> AdapterInfo | None:
        """The registered adapter `name` (None if unknown, or unregistered and draining), residency
        included: call it where the engine runs (another thread reads `adapter_view`)."""
        facts = self.registry.view.get(name)
        entry = self.registry.entry(name)
        if facts is None or facts.draining or entry is None:
            return None
        return AdapterInfo(
            name,
            facts.sha256,
            facts.pages,
            entry.resident,
            facts.failed,
            entry.admissions,
            entry.cold_admissions,
            entry.loads,
        )

    def adapters(self) -> list[AdapterInfo]:
        """Every registered adapter, by name."""
        infos = (self.adapter(name) for name in self.registry.names())
        return [info for info in infos if info is not None]

    @property
    def adapter_view(self) -> Mapping[str, AdapterFacts]:
        """The registration facts of every adapter registered or draining, safe to read from any thread
        without a lock: an immutable snapshot, replaced whole when a registration changes."""
        return self.registry.view

    # -- requests ---------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        adapter: str | None = None,
        tenant: str | None = None,
        tenant_weight: float = 1.0,
    ) -> str:
        """Queue a prompt (text, or token ids) and return its request id; `adapter` names a registered
        adapter (None: the base model). Its adapter starts loading into host memory now. `tenant` is
        who asked (None: the anonymous tenant) and `tenant_weight` that tenant's share of a busy engine."""
        if not tenant_weight > 0:
            raise ValueError(f"tenant_weight must be positive, got {tenant_weight}")
        params = params or SamplingParams()
        if adapter is not None:
            self._check_adapter(adapter)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompt token ids instead of text")
            text: str | None = prompt
            ids = self.tokenizer.encode(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
        self._check_sampling(params)
        self._check_prompt(ids, params, adapter)
        arrival = next(self._arrivals)
        request_id = request_id or f"req-{arrival}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        generator = None
        if not params.greedy:
            seed = (
                params.seed
                if params.seed is not None
                else int(torch.randint(2**62, (1,), generator=self._seeds))
            )
            generator = torch.Generator().manual_seed(seed)
        detokenizer = IncrementalDetokenizer(self.tokenizer.decode, ids) if self.tokenizer else None
        request = Request(
            request_id,
            ids,
            params,
            arrival,
            adapter=adapter,
            tenant=tenant,
            tenant_weight=tenant_weight,
            output=OutputState(prompt=text, detokenizer=detokenizer),
            sampling=SamplingState(generator=generator),
        )
        self._requests[request_id] = request
        self.scheduler.add(request)
        # Read ahead now, not when a step first wants it: the read overlaps the steps before it joins.
        if adapter is not None and len(self.scheduler.waiting) <= self.config.adapter_prefetch_depth:
            self.loader.prefetch([adapter])
        return request_id

    def _check_adapter(self, name: str) -> None:
        """Raise unless new requests may name adapter `name`: the one check of it."""
        if name not in self.registry:
            raise UnknownAdapterError(f"adapter {name!r} is not registered")
        if name in self.registry.failed:
            raise RefusedAdapterError(f"adapter {name!r} cannot be served: {self.registry.failed[name]}")

    def _check_sampling(self, params: SamplingParams) -> None:
        """What only this model bounds (SamplingParams checked the rest against the shared limits):
        top_k and the logprob alternatives are counts of tokens, at most the vocabulary."""
        vocab = self.loaded.config.vocab_size
        if params.top_k > vocab:
            raise LimitExceeded(
                "top_k",
                f"top_k must be at most {vocab}, this model's vocabulary (0: no limit), got {params.top_k}",
            )
        if params.logprobs is not None and params.logprobs > vocab:
            raise LimitExceeded(
                "logprobs",
                f"logprobs must be at most {vocab}, this model's vocabulary, got {params.logprobs}",
            )

    def _check_prompt(self, ids: list[int], params: SamplingParams, adapter: str | None = None) -> None:
        if not ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        vocab = self.loaded.config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; the context holds {self.max_model_len}, "
                "so the prompt must be shorter to leave room for output"
            )
        longest = min(len(ids) + params.max_tokens, self.max_model_len)
        usable = self.pool.num_pages - self.pool.pages_by_kind()[PageKind.RESERVED.value]  # zero, padding
        # Alone in the pool, the request must fit with its adapter, or it could never finish.
        adapter_pages = self.registry.pages_of(adapter) if adapter is not None else 0
        kv_pages = self.scheduler.pages_for(longest)
        if kv_pages + adapter_pages > usable:
            with_adapter = f" and its adapter {adapter_pages} more" if adapter_pages else ""
            raise RequestTooLarge(
                f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) needs {kv_pages} pages"
                f"{with_adapter}; the pool has {usable}: lower max_tokens or shorten the prompt",
                "max_tokens",
            )

    def abort(self, request_id: str) -> None:
        """End a request (safe for finished or unknown ids); its pages go back at once."""
        request = self._requests.pop(request_id, None)
        if request is not None and not request.finished:
            self.scheduler.finish(request, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def request_ids(self, status: RequestStatus) -> list[str]:
        """The requests with this status: running ones in admission order, waiting ones in queue
        order (finished ones are not kept)."""
        if status is RequestStatus.FINISHED:
            return []
        queue = self.scheduler.running if status is RequestStatus.RUNNING else self.scheduler.waiting
        return [r.request_id for r in queue]

    def waiting_by_tenant(self) -> dict[str | None, int]:
        """How many requests each tenant has waiting (the server's queue shares read it after a step)."""
        counts: dict[str | None, int] = {}
        for request in self.scheduler.waiting:
            counts[request.tenant] = counts.get(request.tenant, 0) + 1
        return counts

    @property
    def base_shape(self) -> BaseShape:
        """The base model's shapes, which an adapter must fit."""
        return self.loader.base

    def stats(self) -> EngineStats:
        registry, host = self.registry, self.loader.host
        return EngineStats(
            num_pages=self.pool.num_pages,
            pages=self.pool.pages_by_kind(),
            waiting=len(self.scheduler.waiting),
            running=len(self.scheduler.running),
            adapters_registered=registry.num_registered(),
            adapters_resident=registry.num_resident(),
            adapters_failed=len(registry.failed),
            adapters_draining=registry.num_draining(),
            adapter_loads=self.loader.loads,
            adapter_evictions=registry.evictions,
            adapter_load_seconds=self.loader.load_seconds,
            host_cache_bytes=host.bytes_used,
            host_cache_hits=host.stats.hits,
            host_cache_waits=host.stats.waits,
            host_cache_misses=host.stats.misses,
            prefix=self.prefix_cache.stats() if self.prefix_cache is not None else None,
        )

    def adapter_report(self) -> AdapterReport:
        """Which adapters the engine holds and serves (a pass over its queues and caches: the metrics
        take one per publish, not per step). Takes the loads' times: each is reported once."""
        return adapter_report(self.scheduler, self.registry, self.loader.host, self.loader)

    # -- the loop ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step: schedule → load adapters → build the batch and run it → sample → postprocess.
        Returns the outputs of the requests it touched.

        With async scheduling the step is pipelined: this call plans and launches step n+1 (its decodes
        read step n's sampled ids on the device), runs the host work that needs no token (adapter
        prefetch), and only then reads step n's tokens and returns step n's outputs; step n+1 stays in
        flight until the next call. Outputs are those of the plain loop, one call later."""
        if not self._overlap:
            return self._step_now()
        in_flight, self._in_flight = self._in_flight, None
        plan = self.scheduler.schedule()
        outputs = self._refused(plan)
        outputs += self._load_adapters(plan)
        launched: _InFlight | None = None
        if plan.chunks:
            plan.chunks = self.runner.order(plan.chunks)
            try:
                logits, finite = self._launch(plan.chunks, feed=in_flight)
                launched = _InFlight(plan, self._sample(plan, logits, finite, outputs))
                self.scheduler.advance(plan)
            except Exception as error:  # not queued: land the step in flight, then isolate the fault
                self.loader.prefetch(self._next_adapters())
                if in_flight is not None:
                    landed, ok = self._land(in_flight, successor=None)
                    outputs += landed
                    if not ok:  # that step ran again on its own: plan afresh next call
                        return outputs
                plan.chunks = [c for c in plan.chunks if c.request.status is RequestStatus.RUNNING]
                return outputs + self._run_now(plan, failed=error)
        # Step n+1 is queued on the device and nothing of it is read: host work that needs none of its
        # tokens runs meanwhile.
        self.loader.prefetch(self._next_adapters())
        if in_flight is not None:
            landed, ok = self._land(in_flight, successor=launched)
            outputs += landed
            if not ok:
                launched = None  # rolled back: its chunks are planned again
        self._in_flight = launched
        if launched is None and in_flight is None:
            self._check_progress(outputs)
        return outputs

    def _step_now(self) -> list[RequestOutput]:
        """One step, not pipelined: plan, launch, read its tokens, postprocess."""
        plan = self.scheduler.schedule()
        outputs = self._refused(plan)
        outputs += self._load_adapters(plan)
        self.loader.prefetch(self._next_adapters())
        if not plan.chunks:
            self._check_progress(outputs)
            return outputs
        plan.chunks = self.runner.order(plan.chunks)
        return outputs + self._run_now(plan)

    def _check_progress(self, outputs: list[RequestOutput]) -> None:
        if self.scheduler.waiting and not self.scheduler.running and not outputs:
            raise RuntimeError("the scheduler could not admit any request into an empty pool")

    def _run_now(self, plan: StepPlan, failed: Exception | None = None) -> list[RequestOutput]:
        """Run the plan's (ordered) chunks, read their tokens and postprocess, isolating a fault to the
        requests or adapters that caused it. `failed`: the error its launch already raised (the
        isolation's retry is the next run)."""
        outputs: list[RequestOutput] = []
        if not plan.chunks:
            return outputs
        try:
            if failed is not None:
                raise failed
            logits, finite = self._launch(plan.chunks)
            sampled = self._sample(plan, logits, finite, outputs)
            # The step's one device-to-host copy: tokens, finite flags, logprobs. Rows that are not
            # finite fail the step before any token or logprob lands on a request.
            self._check_finite(plan.chunks, sampled.finite())
        except Exception as error:
            plan.chunks, survived = self._isolate_fault(plan.chunks, error, outputs)
            if survived is None:
                return outputs
            try:
                sampled = self._sample(plan, survived, None, outputs)
            except Exception as still:  # no row explains it: the step's failure, after what it ended
                raise StepError(still, outputs) from still
        tokens = sampled.resolve()  # logprobs and kept logits land on the requests
        return outputs + self._outputs_of(self.scheduler.postprocess(plan, tokens))

    def _land(self, flight: _InFlight, successor: _InFlight | None) -> tuple[list[RequestOutput], bool]:
        """Read the step in flight's tokens (its one copy) and postprocess it. If it failed (a row not
        finite, or the device reports an error), its successor, planned as if it had not, is rolled back
        (its device work is wasted) and the step runs again the plain way, with fault isolation.
        Returns the outputs and whether it landed as launched."""
        plan = flight.plan
        try:
            self._check_finite(plan.chunks, flight.sampled.finite())
            tokens = flight.sampled.resolve()
        except Exception:
            if successor is not None:
                self.scheduler.rollback(successor.plan)
            self.scheduler.rollback(plan)
            plan.chunks = [c for c in plan.chunks if c.request.status is RequestStatus.RUNNING]
            return self._run_now(plan), False
        return self._outputs_of(self.scheduler.land(plan, tokens)), True

    def _outputs_of(self, requests: list[Request]) -> list[RequestOutput]:
        outputs = []
        for request in requests:
            if request.finished:
                self._requests.pop(request.request_id, None)
            outputs.append(self._output(request, new_text=next_delta(request)))
        return outputs

    def _refused(self, plan: StepPlan) -> list[RequestOutput]:
        """Outputs of the requests the scheduler refused because their adapter is."""
        for request in plan.refused:
            assert request.adapter is not None
            why = self.registry.failed.get(request.adapter, "it is refused")
            request.output.error = f"adapter {request.adapter!r} could not be loaded: {why}"
            self._requests.pop(request.request_id, None)
        return [self._output(r, code=ADAPTER_FAILED) for r in plan.refused]

    def _load_adapters(self, plan: StepPlan) -> list[RequestOutput]:
        """Copy the plan's adapters into their pages. An adapter that cannot be loaded ends its own
        requests (adapter_failed, or adapter_unavailable: whoever asks for it next tries again) and
        leaves the plan; nothing else changes."""
        failures = self.loader.load(plan.adapter_loads)
        outputs = []
        for failure in failures:
            outputs.extend(self._end_requests_of(failure))
        if failures:
            plan.chunks = [c for c in plan.chunks if not c.request.finished]
        return outputs

    def _end_requests_of(self, failure: LoadFailure) -> list[RequestOutput]:
        code = ADAPTER_FAILED if failure.at_fault else ADAPTER_UNAVAILABLE
        queued = (*self.scheduler.running, *self.scheduler.waiting)
        victims = [r for r in queued if r.adapter == failure.name]
        for request in victims:
            request.output.error = f"adapter {failure.name!r} could not be loaded: {failure.reason}"
            self.scheduler.finish(request, "error")
            self._requests.pop(request.request_id, None)
        return [self._output(r, code=code) for r in victims]

    def _forward(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Logits [S, vocab] of the chunks' sampled rows; NonFiniteLogits if any row is not finite."""
        logits, finite = self._launch(chunks)
        self._check_finite(chunks, finite.tolist())  # the fault path: a copy of its own
        return logits

    def _check_finite(self, chunks: list[ScheduledChunk], flags: list[bool]) -> None:
        if not all(flags):
            sampled = [c.request.request_id for c in chunks if c.samples]
            raise NonFiniteLogits([sampled[i] for i, ok in enumerate(flags) if not ok])

    def _launch(
        self, chunks: list[ScheduledChunk], feed: _InFlight | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunks' sampled rows' logits [S, vocab] and whether each row is finite [S], both still
        on the device: from the metadata copy to here nothing reads a device value, so nothing waits
        for the device (what a captured CUDA graph of the decode step needs; tests/engine/test_dispatch.py).
        The padding rows of a graph-ready step are computed with the rest and dropped here (views)."""
        batch = self.runner.build(chunks)
        if feed is not None:
            self._feed(batch.input_ids, chunks, feed)
        logits = self.runner.execute(batch)  # [S + padding, vocab]
        finite = torch.isfinite(logits).all(dim=-1)  # over every row: one shape per bucket
        real = logits.shape[0] - batch.num_padding
        return logits[:real], finite[:real]

    def _feed(self, input_ids: torch.Tensor, chunks: list[ScheduledChunk], feed: _InFlight) -> None:
        """Copy the pending tokens' ids from the step in flight's sampled tokens into this step's input
        rows, on the device: each is a decode (one-token chunk, laid out first) of a pending position."""
        rows = feed.rows
        pairs = [
            (row, rows[chunk.request.request_id])
            for row, chunk in enumerate(chunks)
            if chunk.num_tokens == 1 and chunk.start >= chunk.request.num_known_tokens
        ]
        if not pairs:
            return
        index = torch.tensor(pairs, dtype=torch.int64).T  # [2, k]: this step's rows, the flight's rows
        if input_ids.device.type == "cuda":
            index = index.pin_memory().to(input_ids.device, non_blocking=True)
        tokens = feed.sampled.tokens.index_select(0, index[1]).to(input_ids.dtype)
        input_ids.index_copy_(0, index[0], tokens)

    def _isolate_fault(
        self, chunks: list[ScheduledChunk], error: Exception, outputs: list[RequestOutput]
    ) -> tuple[list[ScheduledChunk], torch.Tensor | None]:
        """After a failed forward: retry once; then end the requests of the adapters that fail on their
        own (appending their outputs) and run the rest. Non-finite logits no adapter explains end only
        the requests they belong to (rows do not mix). Returns the chunks that ran and their logits."""
        log.warning("a step failed (%s: %s); running it again", type(error).__name__, error)
        try:
            return chunks, self._forward(chunks)
        except Exception as again:
            error = again
        guilty = self._guilty_adapters(chunks)
        if not guilty and not isinstance(error, NonFiniteLogits):
            raise StepError(error, outputs) from error
        for name, reason in guilty.items():
            outputs.extend(self._fail_adapter(name, reason))
        rest = [c for c in chunks if c.request.adapter not in guilty]
        if not guilty:
            assert isinstance(error, NonFiniteLogits)
            rest = self._fail_rows(rest, error, outputs)
        try:
            return rest, self._forward(rest) if rest else None
        except NonFiniteLogits as bad:
            rest = self._fail_rows(rest, bad, outputs)
        except Exception as still:
            raise StepError(still, outputs) from still
        try:
            return rest, self._forward(rest) if rest else None
        except Exception as still:
            raise StepError(still, outputs) from still

    def _sample(
        self, plan: StepPlan, logits: torch.Tensor, finite: torch.Tensor | None, outputs: list[RequestOutput]
    ) -> StepSample:
        """sample_step over the plan's sampling rows of logits [S, V] (`finite` [S]: the step's unread
        finite flags, if any), inside each request's fault domain: sampling is per request, so if it
        raises, each row is sampled alone; the requests whose rows fail end (engine_error, with the
        reason, appended to `outputs`) and leave the plan, and the others are sampled without them,
        drawing what they would have drawn. A failure no row explains alone is raised."""
        requests = plan.sampling
        try:
            return sample_step(logits, requests, finite)
        except Exception as error:
            reasons = {i: self._sampling_failure(logits[i : i + 1], r) for i, r in enumerate(requests)}
            failing = {i: why for i, why in reasons.items() if why is not None}
            if not failing:
                raise
            log.warning("sampling a step failed (%s: %s)", type(error).__name__, error)
        for i, why in failing.items():
            message = f"sampling failed for this request ({why}); check its sampling parameters"
            outputs.extend(self._end_with_error([requests[i]], message, ENGINE_ERROR))
            log.warning("sampling failed for %s: %s", requests[i].request_id, why)
        ended = {requests[i].request_id for i in failing}
        plan.chunks = [c for c in plan.chunks if c.request.request_id not in ended]
        kept = [i for i in range(len(requests)) if i not in failing]
        rows = torch.tensor(kept, dtype=torch.int64, device=logits.device)
        rest = None if finite is None else finite.index_select(0, rows)
        return sample_step(logits.index_select(0, rows), plan.sampling, rest)

    @staticmethod
    def _sampling_failure(row: torch.Tensor, request: Request) -> str | None:
        """Why sampling logits row [1, V] for `request` alone raises (None: it does not), up to the copy
        to the host, where a device reports its errors."""
        try:
            sample_step(row, [request]).wait()
        except Exception as error:
            return f"{type(error).__name__}: {error}"
        return None

    def _fail_rows(
        self, chunks: list[ScheduledChunk], bad: NonFiniteLogits, outputs: list[RequestOutput]
    ) -> list[ScheduledChunk]:
        """End the requests whose logits were not finite (engine_error); the chunks of the others."""
        message = "the model produced non-finite logits for this request"
        ended = [c.request for c in chunks if c.request.request_id in bad.request_ids]
        outputs.extend(self._end_with_error(ended, message, ENGINE_ERROR))
        log.warning("%s: ended %s", message, ", ".join(r.request_id for r in ended))
        return [c for c in chunks if c.request.request_id not in bad.request_ids]

    def _end_with_error(self, requests: list[Request], message: str, code: str) -> list[RequestOutput]:
        for request in requests:
            # Its cache pages may hold NaN now; a page reused by another request is read beyond that
            # request's own tokens too (masked, but NaN times zero is NaN), so they go back zeroed.
            self.cache.memory[request.pages] = 0  # page-major
            request.output.error = message
            self.scheduler.finish(request, "error")
            self._requests.pop(request.request_id, None)
        return [self._output(r, code=code) for r in requests]

    def _guilty_adapters(self, chunks: list[ScheduledChunk]) -> dict[str, str]:
        """The adapters whose chunks fail when run without the others, found by bisecting the step's
        adapters (a few forwards for one bad adapter among many), each with the error it raised."""
        by_adapter: dict[str, list[ScheduledChunk]] = {}
        for chunk in chunks:
            if chunk.request.adapter is not None:
                by_adapter.setdefault(chunk.request.adapter, []).append(chunk)

        def failure(names: list[str]) -> str | None:
            try:
                self._forward([c for n in names for c in by_adapter[n]])
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

    def _fail_adapter(self, name: str, reason: str) -> list[RequestOutput]:
        """Refuse adapter `name` from now on and end every request that uses it; the others go on."""
        message = f"adapter {name!r} failed while running: {reason}"
        queued = (*self.scheduler.running, *self.scheduler.waiting)
        victims = [r for r in queued if r.adapter == name and not r.finished]
        outputs = self._end_with_error(victims, message, ADAPTER_FAILED)
        self.registry.mark_failed(name, message)
        log.warning("%s; ended %d request(s) that used it", message, len(victims))
        return outputs

    def _next_adapters(self) -> list[str]:
        """Adapters of the requests next in the queue, in order: what to have in host memory soon."""
        wanted: dict[str, None] = {}
        for request in itertools.islice(self.scheduler.waiting, self.config.adapter_prefetch_depth):
            if request.adapter is not None:
                wanted[request.adapter] = None
        return list(wanted)

    def _output(self, request: Request, new_text: str = "", code: str | None = None) -> RequestOutput:
        output_type = RequestOutput if code is None else FailedOutput
        state = request.output
        output = output_type(
            request_id=request.request_id,
            prompt=state.prompt,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids),
            text=state.text,
            finished=request.finished,
            finish_reason=request.finish_reason,
            new_text=new_text,
            stop_reason=state.stop_reason,
            logprobs=list(state.logprobs) if request.params.logprobs is not None else None,
            error=state.error,
            num_cached_tokens=request.num_cached_tokens,
        )
        if isinstance(output, FailedOutput) and code is not None:
            output.error_code = code
        return output

    # -- offline API --------------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        adapters: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion, all in one continuously batched run; outputs in prompt order.
        `adapters` is one adapter name for all prompts, or one per prompt (None: the base model)."""
        prompt_list: list[Prompt] = (
            [prompts]  # type: ignore[list-item]
            if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
            else list(prompts)  # type: ignore[arg-type]
        )
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or SamplingParams()] * len(prompt_list)
        else:
            param_list = list(params)
            if len(param_list) != len(prompt_list):
                raise ValueError(f"{len(prompt_list)} prompts but {len(param_list)} sampling params")
        adapter_list = (
            [adapters] * len(prompt_list) if adapters is None or isinstance(adapters, str) else list(adapters)
        )
        if len(adapter_list) != len(prompt_list):
            raise ValueError(f"{len(prompt_list)} prompts but {len(adapter_list)} adapters")
        ids = [
            self.add_request(p, sp, adapter=a)
            for p, sp, a in zip(prompt_list, param_list, adapter_list, strict=True)
        ]
        results: dict[str, RequestOutput] = {}
        while len(results) < len(ids):
            for output in self.step():
                if output.finished:
                    results[output.request_id] = output
        return [results[i] for i in ids]

    def chat(self, messages: Sequence[dict[str, Any]], params: SamplingParams | None = None) -> RequestOutput:
        """One conversation through the model's chat template."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it cannot apply a chat template")
        return self.generate([self.tokenizer.encode_chat(messages)], params)[0]

    def next_token_logits(self, prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Float32 next-token logits [vocab] after each prompt, computed through the paged cache."""
        ids = [self.add_request(p, SamplingParams(max_tokens=1, temperature=0.0)) for p in prompts]
        requests = [self._requests[i] for i in ids]
        for request in requests:
            request.sampling.keep_logits = True
        while any(not r.finished for r in requests):
            self.step()
        logits = [r.sampling.last_logits for r in requests]
        assert all(x is not None for x in logits)
        return logits  # type: ignore[return-value]
