"""LLMEngine: the offline API. `step()` is plan → load → launch → land; `generate()` loops it.

The parts: the scheduler plans (engine/scheduler.py, no torch), the loader copies the plan's adapters
into their pages (engine/lora/loader.py), the runner does every device operation and hands back a step
handle (engine/runner.py), and the fault guard retries and bisects a failed step (engine/fault_guard.py).
The engine owns the requests: it checks them in, and makes their outputs.

One tenant's adapter must not fail another tenant's request. An adapter that cannot be loaded ends only
its own requests (adapter_failed, or adapter_unavailable when its store did not answer); a step that
fails is the guard's (retry once, then bisect by adapter; a failure nothing explains is raised as
`StepError`). Sampling is part of each request's fault domain too, on the plain and pipelined paths and
after the retry.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from loraplex.adapters import AdapterManifest, BaseShape

# Why a request ended with an error (finish_reason "error"): the wire contract's codes. ADAPTER_FAILED: the
# adapter is at fault, refused until registered with other weights; ADAPTER_UNAVAILABLE: its store could not
# be read, retry later; ENGINE_ERROR: the engine's own failure.
from loraplex.wire import ADAPTER_FAILED, ADAPTER_UNAVAILABLE, ENGINE_ERROR
from loraplex.wire.errors import AdapterChanged, RefusedAdapterError, UnknownAdapterError
from loraplex.wire.errors import StepError as StepError  # what step() raises (from the fault guard)
from loraplex.wire.limits import LOGPROBS, LimitExceeded, check_number

from .batch import DecodeBuckets
from .compiled_decode import CompiledDecode
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .fairness import FairQueue, FirstComeQueue, VirtualTokenCounter
from .fault_guard import FaultGuard
from .grammar import Grammar, GrammarCache
from .graphs import CudaGraphBackend, DecodeGraphs
from .kv_cache import KVCache, page_bytes
from .lora.dora import served_base_weights
from .lora.loader import AdapterLoader, LoadFailed, LoadFailure
from .lora.registry import AdapterRegistry
from .lora.report import adapter_report
from .lora.sources import AdapterSource, DirectorySource
from .lora.step import KernelLoraStacker, LoraStacker
from .model.cpu_features import cpu_auto_dtype
from .model.loader import LoadedModel, load_model
from .model.quantize_weights import weight_bytes
from .pool import PageKind, PagePool
from .prefix_cache import NoPrefixCache, PrefixCache
from .request import OutputState, Request, RequestOutput, RequestStatus, SamplingState
from .runner import ModelRunner, StepHandle, free_device_bytes
from .sampling_params import SamplingParams
from .scheduler import ScheduledChunk, Scheduler, StepPlan
from .speculative import NgramProposer
from .stats import AdapterFacts, AdapterInfo, AdapterReport, EngineStats
from .stopping import StopChecker, next_delta
from .warmup import warm_up

log = logging.getLogger(__name__)

Prompt = str | Sequence[int]


@dataclass
class FailedOutput(RequestOutput):
    """The last output of a request the engine ended with an error, and whose fault that was."""

    error_code: str = ENGINE_ERROR


class RequestTooLarge(ValueError):
    """A request that can never fit this engine; `param` names the field to change."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _running(chunk: ScheduledChunk) -> bool:
    return chunk.request.status is RequestStatus.RUNNING


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
            or config.quantization not in (loaded.quantization, "auto")
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
        # Pins may take the usable pool less one request at the full context, or less half the pool when
        # that is smaller (AdapterRegistry.pin).
        usable = num_pages - self.pool.pages_by_kind()[PageKind.RESERVED.value]
        kept = min(-(-self.max_model_len // config.page_size), usable // 2)
        self.registry = AdapterRegistry(
            self.pool, config.max_resident_adapters, pin_budget=max(0, usable - kept)
        )
        self.loader = AdapterLoader(
            self.registry,
            self.cache.memory.view(-1, head_dim),
            model_config.lora_shape(),
            rows_per_page=self.cache.pages().shape[1] // head_dim,
            host_cache_bytes=config.adapter_host_cache_bytes,
            base_weights=served_base_weights(loaded.model),
        )
        eos = self.tokenizer.eos_token_ids if self.tokenizer else model_config.eos_token_ids
        self.prefix_cache = (
            PrefixCache(self.pool, config.page_size, self._adapter_digest)
            if config.prefix_caching
            else NoPrefixCache(self.pool)
        )
        self.registry.listeners.append(self.prefix_cache)  # a forgotten adapter's pages go with it
        queue = (
            FairQueue(VirtualTokenCounter(config.fair_prompt_weight, config.fair_output_weight))
            if config.scheduling == "fair"
            else FirstComeQueue()
        )
        self.scheduler = Scheduler(
            self.pool,
            config.page_size,
            config.max_num_seqs,
            config.max_batch_tokens,
            self.registry,
            stop=StopChecker(eos, self.max_model_len),
            queue=queue,
            prefix_cache=self.prefix_cache,
            proposer=(
                NgramProposer(
                    config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
                )
                if config.speculative == "ngram"
                else None
            ),
        )
        use_kernels = config.use_kernels(device)
        stacker = KernelLoraStacker(self.loader) if use_kernels else LoraStacker(self.loader)
        graphs = None
        if buckets is not None and use_kernels and device.type == "cuda":
            # Graph-ready decode steps on CUDA replay captured graphs, one per bucket and adapter set.
            graphs = DecodeGraphs(CudaGraphBackend(device))
        compiled = None
        if buckets is not None and config.compiles_decode(device) and not use_kernels:
            compiled = CompiledDecode(loaded.model, self.cache.memory, config.page_size)
        self.runner = ModelRunner(loaded.model, self.cache, stacker, use_kernels, buckets, graphs, compiled)
        self.guard = FaultGuard(self.runner, self.scheduler, self.registry, self._end_with_error)
        self._overlap = config.overlaps(device)
        self._in_flight: StepHandle | None = None  # async scheduling: the step launched, not yet read
        if use_kernels:  # compiles every kernel variant now, so no request waits on one; nothing off CUDA
            warm_up(model_config, dtype, config.page_size, config.max_num_seqs, device)
        if compiled is not None and buckets is not None and isinstance(stacker, LoraStacker):
            # Every graph the decode steps can need, now: no request waits on a compile.
            compiled.warm_up(buckets.sizes, buckets.padding_page, stacker.widths(), stacker.dtype)
        self._requests: dict[str, Request] = {}
        # Requests waiting for another's prompt to be computed (add_request's shares_prompt_with), by the
        # id of the one they wait for: queued once it has an output.
        self._deferred: dict[str, list[Request]] = {}
        self._arrivals = itertools.count()
        self._seeds = torch.Generator().manual_seed(config.seed)
        # Structured outputs' compiled grammars, by schema digest (built on the first such request).
        self.grammars = (
            GrammarCache(self.tokenizer, model_config.vocab_size, eos) if self.tokenizer is not None else None
        )
        log.info(
            "engine ready: %s, %s, quantization %s, decode %s, weights %.1f MiB, %d pages of %d tokens "
            "(%.1f MiB), max_model_len %d",
            loaded.source,
            dtype,
            loaded.quantization,
            "compiled" if compiled is not None else "CUDA graphs" if graphs is not None else "eager",
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
            budget = int(free_device_bytes(device) * self.config.gpu_memory_fraction)
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

    def pin_adapter(self, name: str) -> str:
        """Keep a registered adapter resident until `unpin_adapter` (never evicted): loaded now as
        `warm_adapter` does. "device" or "host" (no pages free without taking a request's: it becomes
        resident at its next admission and stays). PinRefused (an AdapterError) when the pins would not
        fit the pool; AdapterError if it is not registered or is refused; LoadFailed as warm_adapter."""
        load = self.registry.pin(name)
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

    def unpin_adapter(self, name: str) -> bool:
        """Let a pinned adapter be evicted again (least recently used first); whether it was pinned."""
        return self.registry.unpin(name)

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
            facts.pinned,
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
        prompt_logprobs: int | None = None,
        shares_prompt_with: str | None = None,
        adapter_sha256: str | None = None,
    ) -> str:
        """Queue a prompt (text, or token ids) and return its request id; `adapter` names a registered
        adapter (None: the base model). Its adapter starts loading into host memory now. `tenant` is
        who asked (None: the anonymous tenant) and `tenant_weight` that tenant's share of a busy engine.

        `prompt_logprobs`: score the prompt's tokens too (echo), with this many alternatives each
        (RequestOutput.prompt_logprobs). `shares_prompt_with`: the id of a queued request with the same
        prompt, adapter and tenant (another choice of the same API request): this one waits until that
        one's prompt is computed, then starts past its cached pages instead of computing them again.

        `adapter_sha256`: the digest the request was routed with (the gateway's adapter header). When the
        engine's `adapter` now has other weights (the name was registered again meanwhile) the request is
        refused (AdapterChanged) rather than served by another version. Once added it is the adapter's
        user, and the registry refuses to replace a name its users hold, so every row keeps that digest
        to its end."""
        if not tenant_weight > 0:
            raise ValueError(f"tenant_weight must be positive, got {tenant_weight}")
        params = params or SamplingParams()
        check_number("logprobs", prompt_logprobs, LOGPROBS)
        if adapter is not None:
            self._check_adapter(adapter, adapter_sha256)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompt token ids instead of text")
            text: str | None = prompt
            ids = self.tokenizer.encode(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
        self._check_sampling(params)
        if prompt_logprobs is not None and prompt_logprobs > self.loaded.config.vocab_size:
            raise LimitExceeded("logprobs", f"logprobs must be at most {self.loaded.config.vocab_size}")
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
        grammar = self._grammar(params)
        detokenizer = IncrementalDetokenizer(self.tokenizer.decode, ids) if self.tokenizer else None
        output = OutputState(prompt=text, detokenizer=detokenizer)
        if prompt_logprobs is not None:
            output.prompt_logprobs = [None] * len(ids)
        request = Request(
            request_id,
            ids,
            params,
            arrival,
            adapter=adapter,
            tenant=tenant,
            tenant_weight=tenant_weight,
            prompt_logprobs=prompt_logprobs,
            output=output,
            sampling=SamplingState(generator=generator, grammar=grammar),
        )
        self._requests[request_id] = request
        leader = self._prompt_leader(request, shares_prompt_with)
        if leader is not None:
            self._deferred.setdefault(leader, []).append(request)
            return request_id
        self.scheduler.add(request)
        # Read ahead now, not when a step first wants it: the read overlaps the steps before it joins.
        if adapter is not None and len(self.scheduler.waiting) <= self.config.adapter_prefetch_depth:
            self.loader.prefetch([adapter])
        return request_id

    def _grammar(self, params: SamplingParams) -> Grammar | None:
        """The request's grammar (None: free text); LimitExceeded naming the field if it cannot compile."""
        if params.structured is None:
            return None
        if self.grammars is None:
            raise LimitExceeded(
                params.structured.param, "this model has no tokenizer to build a grammar over"
            )
        return self.grammars.grammar(params.structured)

    def _prompt_leader(self, request: Request, leader_id: str | None) -> str | None:
        """The request whose prompt `request` should wait for (None: start now). Waiting pays off only
        where the prefix cache would then hold a page of the prompt for it; the leader must have the
        same prompt, adapter and tenant (the cache's key) and not have computed its prompt yet."""
        leader = self._requests.get(leader_id) if leader_id is not None else None
        if (
            leader is None
            or leader.finished
            or not self.config.prefix_caching
            or request.prompt_logprobs is not None  # it reads nothing from the cache: no reason to wait
            or leader.num_generated > 0
            or (leader.adapter, leader.tenant) != (request.adapter, request.tenant)
            or leader.prompt_token_ids != request.prompt_token_ids
            or (len(request.prompt_token_ids) - 1) // self.config.page_size < 1
        ):
            return None
        return leader.request_id

    def _release_deferred(self, outputs: list[RequestOutput]) -> None:
        """Queue the requests waiting for a prompt now computed: their leader has an output (its first
        token, so its prompt's pages are in the prefix cache) or ended."""
        for output in outputs:
            for request in self._deferred.pop(output.request_id, ()):
                if not request.finished:
                    self.scheduler.add(request)

    def _check_adapter(self, name: str, sha256: str | None = None) -> None:
        """Raise unless new requests may name adapter `name` (with weights `sha256`, when given): the one
        check of it."""
        if name not in self.registry:
            raise UnknownAdapterError(f"adapter {name!r} is not registered")
        if name in self.registry.failed:
            raise RefusedAdapterError(f"adapter {name!r} cannot be served: {self.registry.failed[name]}")
        if sha256 is not None:
            entry = self.registry.entry(name)
            held = entry.manifest.sha256 if entry is not None else ""
            if held != sha256.lower():
                raise AdapterChanged(
                    f"adapter {name!r} was routed with weights {sha256.lower()[:16]}... but this engine "
                    f"now serves {held[:16]}... under that name (registered again meanwhile); the request "
                    "was not run: retry it"
                )

    def _check_sampling(self, params: SamplingParams) -> None:
        """What only this model bounds (SamplingParams checked the rest against the shared limits):
        top_k and the logprob alternatives are counts of tokens, at most the vocabulary, and logit_bias
        names token ids in it."""
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
        outside = max(params.logit_bias or (), default=-1)
        if outside >= vocab:
            raise LimitExceeded(
                "logit_bias",
                f"logit_bias names token id {outside}; this model's token ids are 0 to {vocab - 1}",
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
        pinned = self.registry.pinned_pages(excluding=adapter)  # held by pins whatever else runs
        if kv_pages + adapter_pages + pinned > usable:
            with_adapter = f" and its adapter {adapter_pages} more" if adapter_pages else ""
            if pinned:
                usable -= pinned
                with_adapter += f"; pinned adapters hold {pinned} of the pool's pages"
            raise RequestTooLarge(
                f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) needs {kv_pages} pages"
                f"{with_adapter}; the pool has {usable}: lower max_tokens or shorten the prompt",
                "max_tokens",
            )

    def abort(self, request_id: str) -> None:
        """End a request (safe for finished or unknown ids); its pages go back at once. Requests waiting
        for its prompt start now, without it."""
        request = self._requests.pop(request_id, None)
        if request is None or request.finished:
            return
        waiting_for = next((k for k, v in self._deferred.items() if request in v), None)
        if waiting_for is not None:  # never queued: nothing of it is in the scheduler
            self._deferred[waiting_for].remove(request)
            request.status, request.finish_reason = RequestStatus.FINISHED, "abort"
            return
        self.scheduler.finish(request, "abort")
        for follower in self._deferred.pop(request_id, ()):
            self.scheduler.add(follower)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or any(self._deferred.values())

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
        for request in itertools.chain(self.scheduler.waiting, *self._deferred.values()):
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
            waiting=len(self.scheduler.waiting) + sum(map(len, self._deferred.values())),
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
            prefix=self.prefix_cache.stats(),
            spec=replace(self.scheduler.spec) if self.scheduler.proposer is not None else None,
        )

    def adapter_report(self) -> AdapterReport:
        """Which adapters the engine holds and serves (a pass over its queues and caches: the metrics
        take one per publish, not per step). Takes the loads' times: each is reported once."""
        return adapter_report(self.scheduler, self.registry, self.loader.host, self.loader)

    # -- the loop ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step: plan → load its adapters → launch it → land its tokens. Returns the outputs of
        the requests it touched.

        With async scheduling the step is pipelined: this call plans and launches step n+1 (its decodes
        read step n's sampled ids on the device), runs the host work that needs no token (adapter
        prefetch), and only then lands step n; step n+1 stays in flight until the next call. Outputs
        are those of the plain loop, one call later."""
        if self._overlap and not self._constrained():
            outputs = self._step_pipelined()
        else:
            outputs = self._settle() + self._step_plain()
        if self._deferred:
            self._release_deferred(outputs)
        return outputs

    def _constrained(self) -> bool:
        """Whether a queued request has a grammar, or may draft (speculative decoding). A grammar's next
        mask, like a draft, needs the request's last token on the host, which a pipelined step is planned
        without: such steps run the plain way (the simplest correct rule)."""
        queued = itertools.chain(self.scheduler.running, self.scheduler.waiting)
        drafts = self.scheduler.proposer is not None
        return any(r.sampling.grammar is not None or (drafts and r.may_draft) for r in queued)

    def _settle(self) -> list[RequestOutput]:
        """Land the step in flight, if any (pipelining stops): no token is pending after this."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return []
        return self._land(flight, successor=None)[0]

    def _step_plain(self) -> list[RequestOutput]:
        plan, outputs = self._load(self.scheduler.schedule())
        self._read_ahead()
        if not plan.chunks:
            self._check_progress(outputs)
            return outputs
        return outputs + self._run(plan)

    def _step_pipelined(self) -> list[RequestOutput]:
        """One pipelined step: plan and launch step n+1 on top of step n, then land step n."""
        previous, self._in_flight = self._in_flight, None
        plan, outputs = self._load(self.scheduler.schedule())
        launched, failed = self._launch(plan, previous, outputs)
        # Step n+1 is queued on the device and nothing of it is read: host work that needs none of its
        # tokens runs meanwhile.
        self._read_ahead()
        if previous is not None:
            landed, ok = self._land(previous, successor=launched)
            outputs += landed
            if not ok:  # rolled back, or (n+1 failed) that step ran again on its own: plan afresh
                return outputs
        if failed is not None:  # step n+1's launch raised: run it now, with fault isolation
            return outputs + self._run(plan.keeping(_running), failed)
        self._in_flight = launched
        if launched is None and previous is None:
            self._check_progress(outputs)
        return outputs

    def _load(self, plan: StepPlan) -> tuple[StepPlan, list[RequestOutput]]:
        """Copy the plan's adapters into their pages. The requests the plan refused end, and an adapter
        that cannot be loaded ends its own requests (adapter_failed, or adapter_unavailable: whoever asks
        for it next tries again); the plan that is left, ordered as the runner lays it out."""
        outputs = self._refused(plan)
        failures = self.loader.load(plan.adapter_loads)
        for failure in failures:
            outputs.extend(self._end_requests_of(failure))
        if failures:
            plan = plan.keeping(lambda chunk: not chunk.request.finished)
        return plan.with_chunks(self.runner.order(plan.chunks)), outputs

    def _launch(
        self, plan: StepPlan, feed: StepHandle | None, outputs: list[RequestOutput]
    ) -> tuple[StepHandle | None, Exception | None]:
        """Queue the plan on the device (its pending decodes fed from `feed`, the step in flight) and
        count it as computed: the launched step (None: nothing to run), or the error its launch raised."""
        if not plan.chunks:
            return None, None
        try:
            launched = self.guard.launch(plan, outputs, feed)
        except Exception as error:  # not queued: the step in flight lands first, then the fault is isolated
            return None, error
        self.scheduler.advance(launched.plan)
        return launched, None

    def _run(self, plan: StepPlan, failed: Exception | None = None) -> list[RequestOutput]:
        """Launch the plan and land its tokens now, the guard isolating a fault to the requests or
        adapters that caused it (`failed`: the error its launch already raised)."""
        handle, outputs = self.guard.run(plan, failed)
        if handle is None:
            return outputs
        tokens = handle.tokens()  # logprobs and kept logits land on the requests
        landed = self.scheduler.postprocess(handle.plan, tokens, handle.accepted())
        return outputs + self._outputs_of(landed)

    def _land(self, flight: StepHandle, successor: StepHandle | None) -> tuple[list[RequestOutput], bool]:
        """Read the step in flight's tokens (its one copy) and postprocess it. If it failed (a row not
        finite, or the device reports an error), its successor, planned as if it had not, is rolled back
        (its device work is wasted) and the step runs again the plain way, with fault isolation.
        Returns the outputs and whether it landed as launched."""
        try:
            flight.check()
            tokens = flight.tokens()
        except Exception:
            if successor is not None:
                self.scheduler.rollback(successor.plan)
            self.scheduler.rollback(flight.plan)
            return self._run(flight.plan.keeping(_running)), False
        return self._outputs_of(self.scheduler.land(flight.plan, tokens, flight.accepted())), True

    def _check_progress(self, outputs: list[RequestOutput]) -> None:
        if self.scheduler.waiting and not self.scheduler.running and not outputs:
            raise RuntimeError("the scheduler could not admit any request into an empty pool")

    def _read_ahead(self) -> None:
        """Start reading the host copies of the adapters next in the queue."""
        self.loader.prefetch(self._next_adapters())

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

    def _end_requests_of(self, failure: LoadFailure) -> list[RequestOutput]:
        code = ADAPTER_FAILED if failure.at_fault else ADAPTER_UNAVAILABLE
        queued = (*self.scheduler.running, *self.scheduler.waiting)
        victims = [r for r in queued if r.adapter == failure.name]
        for request in victims:
            request.output.error = f"adapter {failure.name!r} could not be loaded: {failure.reason}"
            self.scheduler.finish(request, "error")
            self._requests.pop(request.request_id, None)
        return [self._output(r, code=code) for r in victims]

    def _end_with_error(self, requests: list[Request], message: str, code: str) -> list[RequestOutput]:
        """End requests the fault guard found at fault (or hit by another's fault) with an error."""
        for request in requests:
            self.runner.zero_pages(request.pages)  # they may hold NaN now
            request.output.error = message
            self.scheduler.finish(request, "error")
            self._requests.pop(request.request_id, None)
        return [self._output(r, code=code) for r in requests]

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
            # Complete, it is never written again (a scored prompt is not scored twice): shared, not copied.
            prompt_logprobs=(
                state.prompt_logprobs
                if request.prompt_logprobs is not None and state.prompt_logprobs_done()
                else None
            ),
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
