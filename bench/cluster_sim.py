"""A discrete-event model of a pool of engine pods, for `bench cluster`: the workload (Zipf adapter
popularity, a hot set that shifts, bursts on one adapter), each pod's continuous batching with a step cost
model, adapter residency with LRU eviction and cold loads, and the metrics the benchmark reports.

Deterministic: every random draw comes from one seeded generator per purpose. No torch: the cost model's
figures are counted once by `bench/floors.py` (GPU) or taken from docs/benchmarks.md (this CPU).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

# -- cost model -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PodModel:
    """What one pod costs: a step is max(bytes read / bandwidth, FLOPs / rate) over `efficiency`, plus a
    fixed host overhead. An adapter load takes `load_latency_s` off the step when the pod's host cache
    holds it, plus a fetch from the store when not, and adds its bytes over the host-to-device link to the
    step that copies them."""

    name: str
    weight_bytes: float  # read once per step
    kv_bytes_per_token: float  # read per cached token per step
    flops_per_token: float  # forward FLOPs per token (2 x parameters)
    adapter_bytes_per_rank: float  # A and B of q, k, v, o, per unit of rank
    bandwidth: float  # bytes/s
    flops: float  # FLOP/s
    efficiency: float  # share of the roofline a real engine reaches
    step_overhead_s: float
    max_num_seqs: int
    max_batch_tokens: int
    adapter_pool_bytes: float  # pool bytes adapters may take (the rest is KV headroom)
    load_latency_s: float  # an adapter in the pod's host cache: pack and register
    load_bandwidth: float  # host-to-device bytes/s
    host_cache_bytes: float  # adapters kept packed in host memory (engine adapter_host_cache_bytes)
    store_latency_s: float  # an adapter not in the host cache: first byte from the adapter store
    store_bandwidth: float  # and its bytes, per pod
    ttft_slo_s: float  # a request is good when its first token comes within this

    def step_seconds(self, batch: int, context: float, prefill: int, adapter_bytes: float) -> float:
        tokens = batch + prefill
        read = self.weight_bytes + context * self.kv_bytes_per_token + adapter_bytes
        work = tokens * self.flops_per_token
        return max(read / self.bandwidth, work / self.flops) / self.efficiency + self.step_overhead_s

    def adapter_bytes(self, rank: int) -> float:
        return rank * self.adapter_bytes_per_rank


def gpu_model(device: str = "A100", shape: str = "llama-7b") -> PodModel:
    """A 7B model in fp16 on a datasheet GPU, counted by bench/floors.py's `decode_step_cost` (the roofline
    of docs/benchmarks.md). Efficiency 0.6 and 4 ms of host time per step put its saturated throughput on
    a ShareGPT-like mix near vLLM's published A100 Llama-2-7B figure (11.45 req/s, 2,694 output tok/s;
    vllm-project/vllm#11267); docs/placement.md compares the two."""
    from loraplex.engine.model.config import named_shape

    from .floors import DEVICE_PEAKS, decode_step_cost

    config = named_shape(shape)
    flops, bandwidth = DEVICE_PEAKS[device]
    one = decode_step_cost(config, batch=1, context=0, element=2, adapters=0, rank=1)
    ctx = decode_step_cost(config, batch=1, context=1, element=2, adapters=0, rank=1)
    lora = decode_step_cost(config, batch=1, context=0, element=2, adapters=1, rank=1)
    memory = 80e9 if device in ("A100", "H100") else 141e9
    pool = 0.9 * memory - one.weight_bytes
    return PodModel(
        name=f"{device}, {shape} fp16 (roofline)",
        weight_bytes=one.weight_bytes,
        kv_bytes_per_token=ctx.kv_bytes,
        flops_per_token=one.flops,
        adapter_bytes_per_rank=lora.adapter_bytes,
        bandwidth=bandwidth,
        flops=flops,
        efficiency=0.6,
        step_overhead_s=0.004,
        max_num_seqs=64,
        max_batch_tokens=2048,
        adapter_pool_bytes=0.2 * pool,  # 80% of the pool kept for KV
        load_latency_s=0.05,  # from the host cache: read, pack, register
        load_bandwidth=25e9,  # PCIe 4.0 x16, effective
        host_cache_bytes=4 * 2**30,  # the engine's default adapter_host_cache_bytes
        store_latency_s=0.05,  # S3-compatible store, first byte
        store_bandwidth=200e6,  # one object's GET
        ttft_slo_s=1.0,
    )


def cpu_model() -> PodModel:
    """SmolLM2-135M float32 on this 2-core machine, from docs/benchmarks.md: a decode step is 64 ms at one
    stream and ~156 ms at 32 (so ~61 ms + 3 ms a sequence, modelled as bandwidth-bound weight reads plus
    per-sequence KV), prefill ~2.4 ms a token (57% of the counted floor of 16.6 s for 12,180 tokens)."""
    weight = 540e6
    bandwidth = weight / 0.061
    return PodModel(
        name="2-core CPU, SmolLM2-135M fp32 (measured)",
        weight_bytes=weight,
        kv_bytes_per_token=0.003 * bandwidth / 300,  # ~3 ms a sequence at ~300 cached tokens
        flops_per_token=2 * 134.5e6,
        adapter_bytes_per_rank=30 * 4 * (576 + 192) * 4 / 2,  # q,k,v,o A and B rows, float32
        bandwidth=bandwidth,
        flops=2 * 134.5e6 / 0.0024,
        efficiency=1.0,
        step_overhead_s=0.0,
        max_num_seqs=16,
        max_batch_tokens=512,
        adapter_pool_bytes=0.2 * 1e9,  # 20% of the default 1 GiB pool
        load_latency_s=0.025,  # one adapter packed on the host (0.95 s for 42, docs/benchmarks.md)
        load_bandwidth=bandwidth,  # a copy in host memory
        host_cache_bytes=4 * 2**30,
        store_latency_s=0.005,  # a local directory store
        store_bandwidth=1e9,
        ttft_slo_s=5.0,
    )


# -- workload -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    adapters: int = 2000
    duration_s: float = 60.0
    load: float = 0.85  # mean arrival rate as a share of the pool's saturated throughput
    zipf: float = 1.0
    base_share: float = 0.1  # requests for the base model alone
    shift_s: float = 20.0  # the hot set is reshuffled this often
    hot: int = 20  # adapters in the hot set
    bursts: int = 3  # bursts over the run, each on one adapter
    burst_s: float = 10.0
    burst_pods: float = 2.0  # a burst's extra rate, in pods' worth of saturated throughput
    prompt_mean: int = 300
    output_mean: int = 150
    seed: int = 0

    def __post_init__(self) -> None:
        if self.adapters < 1 or self.duration_s <= 0 or not self.load > 0:
            raise ValueError("Workload: adapters >= 1, duration_s > 0 and load > 0 are required")


@dataclass
class Request:
    arrival: float
    adapter: int | None  # None: the base model
    prompt: int
    output: int
    pod: int = -1
    first_token: float = math.inf
    finished: float = math.inf
    left: int = 0  # prompt tokens still to prefill
    handle: object = None  # the policy's (e.g. the router's outstanding work)


def _length(rng: random.Random, mean: int, low: int, high: int) -> int:
    # Lognormal with sigma 0.8, the rough spread of chat prompts and answers (ShareGPT).
    value = rng.lognormvariate(math.log(mean) - 0.32, 0.8)
    return max(low, min(high, int(value)))


def adapter_ranks(workload: Workload) -> list[int]:
    rng = random.Random(f"ranks-{workload.seed}")
    return [rng.choice((8, 8, 16, 16, 16, 32, 64)) for _ in range(workload.adapters)]


def trace(workload: Workload, rate: float, burst_rate: float) -> list[Request]:
    """Poisson arrivals at `rate`/s with Zipf adapter popularity over a hot set that shifts every
    `shift_s`, plus `bursts` floods of `burst_rate`/s on one adapter each."""
    rng = random.Random(f"trace-{workload.seed}")
    n = workload.adapters
    weights = [1.0 / (i + 1) ** workload.zipf for i in range(n)]
    cumulative = [0.0]
    for w in weights:
        cumulative.append(cumulative[-1] + w)
    ranking = list(range(n))
    rng.shuffle(ranking)
    requests: list[Request] = []
    now, next_shift = 0.0, workload.shift_s
    while True:
        now += rng.expovariate(rate)
        if now >= workload.duration_s:
            break
        while now >= next_shift:  # the hot set moves: its members trade places with random others
            for rank in range(min(workload.hot, n)):
                other = rng.randrange(n)
                ranking[rank], ranking[other] = ranking[other], ranking[rank]
            next_shift += workload.shift_s
        adapter = None
        if rng.random() >= workload.base_share:
            adapter = ranking[_bisect(cumulative, rng.random() * cumulative[-1])]
        requests.append(_request(rng, workload, now, adapter))
    for _ in range(workload.bursts):
        start = rng.uniform(0, max(0.0, workload.duration_s - workload.burst_s))
        adapter, t = rng.randrange(n), start
        while True:
            t += rng.expovariate(burst_rate)
            if t >= start + workload.burst_s:
                break
            requests.append(_request(rng, workload, t, adapter))
    requests.sort(key=lambda r: r.arrival)
    return requests


def _bisect(cumulative: list[float], x: float) -> int:
    low, high = 0, len(cumulative) - 1
    while low < high - 1:
        mid = (low + high) // 2
        if cumulative[mid] <= x:
            low = mid
        else:
            high = mid
    return low


def _request(rng: random.Random, workload: Workload, at: float, adapter: int | None) -> Request:
    prompt = _length(rng, workload.prompt_mean, 16, 4096)
    return Request(at, adapter, prompt, _length(rng, workload.output_mean, 8, 1024))


def saturated_rps(model: PodModel, workload: Workload) -> float:
    """Requests/s one pod finishes with a full batch of the mean request (context at its midpoint)."""
    batch = model.max_num_seqs
    context = batch * (workload.prompt_mean + workload.output_mean / 2)
    decode = model.step_seconds(batch, context, 0, 0.0)
    prefill_share = workload.prompt_mean / model.max_batch_tokens  # steps of prefill per request
    step = decode + prefill_share * batch / workload.output_mean * (
        model.step_seconds(batch, context, model.max_batch_tokens - batch, 0.0) - decode
    )
    return batch / (workload.output_mean * step)


# -- pods -----------------------------------------------------------------------------------------------


class Events(Protocol):
    def at(self, time: float, action: Callable[[], None]) -> None: ...


@dataclass
class Pod:
    index: int
    model: PodModel
    sizes: list[float]  # adapter bytes, by adapter index
    events: Events
    on_first_token: Callable[[Request, float], None]
    on_finish: Callable[[Request, float], None]
    waiting: deque[Request] = field(default_factory=deque)
    prefilling: list[Request] = field(default_factory=list)
    running: list[tuple[int, int, Request]] = field(default_factory=list)  # heap of (last step, n, req)
    step_index: int = 0
    context: int = 0
    resident: OrderedDict[int, None] = field(default_factory=OrderedDict)  # least recently used first
    resident_bytes: float = 0.0
    loading: dict[int, float] = field(default_factory=dict)
    host: OrderedDict[int, None] = field(default_factory=OrderedDict)  # host cache, LRU first
    host_bytes: float = 0.0
    in_use: Counter[int] = field(default_factory=Counter)  # adapter -> requests prefilling or running
    copy_bytes: float = 0.0  # loads finished since the last step, copied in the next
    busy: bool = False
    loads: int = 0  # cold loads: started for a request that waits on it
    prewarms: int = 0  # loads asked for ahead of any request (off the request path)
    loaded_bytes: float = 0.0  # both kinds
    landing: dict[int, list[Callable[[bool], None]]] = field(default_factory=dict)  # prewarms waiting
    served: int = 0
    _n: int = 0

    # -- what the gateway sees (metrics)
    def queue_length(self) -> int:
        return len(self.waiting)

    def kv_usage(self) -> float:
        return min(1.0, (len(self.running) + len(self.prefilling)) / self.model.max_num_seqs)

    def active_adapters(self) -> set[int]:
        return {a for a, n in self.in_use.items() if n > 0}

    def waiting_adapters(self) -> set[int]:
        return {r.adapter for r in self.waiting if r.adapter is not None}

    def max_adapters(self) -> int:
        return max(1, int(self.model.adapter_pool_bytes / (sum(self.sizes) / len(self.sizes))))

    # -- work
    def submit(self, request: Request, now: float) -> None:
        request.pod = self.index
        request.left = request.prompt
        self.waiting.append(request)
        self._wake(now)

    def _wake(self, now: float) -> None:
        if not self.busy:
            self.busy = True
            self.events.at(now, lambda: self._step(now))

    def _step(self, now: float) -> None:
        self._admit(now)
        budget = self.model.max_batch_tokens - len(self.running)
        prefill, done = 0, []
        for request in self.prefilling:
            if budget <= 0:
                break
            chunk = min(request.left, budget)
            request.left -= chunk
            budget -= chunk
            prefill += chunk
            if request.left == 0:
                done.append(request)
        adapters = {r.adapter for _, _, r in self.running} | {r.adapter for r in self.prefilling}
        adapter_bytes = sum(self.sizes[a] for a in adapters if a is not None)
        batch = len(self.running)
        if batch == 0 and prefill == 0:
            self.busy = False  # waiting only on loads: a finished load wakes the pod
            return
        seconds = self.model.step_seconds(batch, self.context, prefill, adapter_bytes)
        seconds += self.copy_bytes / self.model.load_bandwidth
        self.copy_bytes = 0.0
        end = now + seconds
        self.events.at(end, lambda: self._land(end, done, batch, prefill))

    def _land(self, now: float, prefilled: list[Request], decoded: int, prefill: int) -> None:
        self.step_index += 1
        self.context += decoded + prefill
        for request in prefilled:
            self.prefilling.remove(request)
            self.on_first_token(request, now)
            self._n += 1
            heapq.heappush(self.running, (self.step_index + request.output - 1, self._n, request))
        while self.running and self.running[0][0] <= self.step_index:
            _, _, request = heapq.heappop(self.running)
            self.context -= request.prompt + request.output - 1  # the last token is never cached
            if request.adapter is not None:
                self.in_use[request.adapter] -= 1
            self.served += 1
            self.on_finish(request, now)
        self._step(now)

    def _admit(self, now: float) -> None:
        """Waiting requests join in order while the batch has room; one whose adapter is not resident
        starts its load and lets later ones pass (as the engine's scheduler does)."""
        room = self.model.max_num_seqs - len(self.running) - len(self.prefilling)
        kept: deque[Request] = deque()
        looked = 0
        while self.waiting and room > 0 and looked < 4 * self.model.max_num_seqs:
            request = self.waiting.popleft()
            looked += 1
            adapter = request.adapter
            if adapter is not None and adapter not in self.resident:
                if adapter not in self.loading:
                    self._load(adapter, now)
                kept.append(request)
                continue
            if adapter is not None:
                self.resident.move_to_end(adapter)
                self.in_use[adapter] += 1
            self.prefilling.append(request)
            room -= 1
        kept.extend(self.waiting)
        self.waiting = kept

    def prewarm(self, adapter: int, now: float, done: Callable[[bool], None]) -> None:
        """Load `adapter` before any request asks for it (the engine's POST /internal/prewarm): `done(True)`
        once resident, `done(False)` when every resident adapter is in use and it cannot fit (the engine
        then answers the host level; requests load it themselves later)."""
        if adapter in self.resident:
            self.resident.move_to_end(adapter)
            done(True)
        elif adapter in self.loading or self._load(adapter, now, prewarm=True):
            self.landing.setdefault(adapter, []).append(done)
        else:
            done(False)

    def _load(self, adapter: int, now: float, prewarm: bool = False) -> bool:
        size = self.sizes[adapter]
        for victim in list(self.resident):
            if self.resident_bytes + size <= self.model.adapter_pool_bytes:
                break
            if self.in_use[victim] == 0:
                del self.resident[victim]
                self.resident_bytes -= self.sizes[victim]
        if self.resident_bytes + size > self.model.adapter_pool_bytes:
            return False  # every resident adapter is in use: retried at a later step
        self.resident_bytes += size  # reserved now, so two loads cannot overcommit the pool
        self.loading[adapter] = now
        if prewarm:
            self.prewarms += 1
        else:
            self.loads += 1
        self.loaded_bytes += size
        ready = now + self.model.load_latency_s
        if adapter in self.host:
            self.host.move_to_end(adapter)
        else:  # fetched from the store into the host cache first
            ready += self.model.store_latency_s + size / self.model.store_bandwidth
            self.host[adapter] = None
            self.host_bytes += size
            while self.host_bytes > self.model.host_cache_bytes and len(self.host) > 1:
                dropped, _ = self.host.popitem(last=False)
                self.host_bytes -= self.sizes[dropped]

        def landed() -> None:
            del self.loading[adapter]
            self.resident[adapter] = None
            self.copy_bytes += size
            self._wake(ready)
            for done in self.landing.pop(adapter, []):
                done(True)

        self.events.at(ready, landed)
        return True


# -- the loop -------------------------------------------------------------------------------------------


class Policy(Protocol):
    """A router under test: where a request goes, and that it ended."""

    name: str

    def pick(self, request: Request, now: float) -> int: ...

    def finished(self, request: Request) -> None: ...


class Loop:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._n = 0
        self.now = 0.0

    def at(self, time: float, action: Callable[[], None]) -> None:
        self._n += 1
        heapq.heappush(self._heap, (time, self._n, action))

    def run(self, until: float) -> None:
        while self._heap and self._heap[0][0] <= until:
            self.now, _, action = heapq.heappop(self._heap)
            action()


@dataclass
class Result:
    policy: str
    pods: int
    requests: int
    finished: int
    goodput: float  # requests/s that finished with their first token within the SLO
    ttft_p50: float
    ttft_p99: float
    cold_loads_per_s: float  # loads a request waited on
    bytes_moved: float  # adapter bytes copied into pools, prewarms included
    pods_used: int
    prewarms_per_s: float = 0.0  # loads ahead of traffic, off the request path
    wall_s: float = 0.0


def simulate(
    model: PodModel,
    workload: Workload,
    pods: int,
    make_policy: Callable[[list[Pod], list[int], Loop], Policy],
    drain_s: float = 600.0,
) -> Result:
    """Run one policy over the workload's trace on `pods` pods; every request is accounted for. After the
    arrivals the pool runs until every request has finished, or for `drain_s` more at most: a policy that
    leaves queues behind pays for them in TTFT, and the loads those requests need are counted (a shorter
    drain hid the cold loads of the requests it never reached)."""
    rate = workload.load * pods * saturated_rps(model, workload)
    burst_rate = workload.burst_pods * saturated_rps(model, workload)
    requests = trace(workload, rate, burst_rate)
    ranks = adapter_ranks(workload)
    sizes = [model.adapter_bytes(r) for r in ranks]
    loop = Loop()
    ttfts: list[float] = []
    finished: list[Request] = []
    policy: Policy

    def first_token(request: Request, now: float) -> None:
        request.first_token = now
        ttfts.append(now - request.arrival)

    def finish(request: Request, now: float) -> None:
        request.finished = now
        finished.append(request)
        policy.finished(request)

    pool = [Pod(i, model, sizes, loop, first_token, finish) for i in range(pods)]
    policy = make_policy(pool, ranks, loop)
    for request in requests:

        def arrive(request: Request = request) -> None:
            pool[policy.pick(request, loop.now)].submit(request, loop.now)

        loop.at(request.arrival, arrive)
    end = workload.duration_s
    loop.run(end)
    while len(finished) < len(requests) and end < workload.duration_s + drain_s:
        end = min(end + 10.0, workload.duration_s + drain_s)
        loop.run(end)
    # Requests not served by the end of the drain count with their wait so far (censored, not dropped).
    waits = sorted(ttfts + [end - r.arrival for r in requests if r.first_token == math.inf])
    good = sum(1 for r in finished if r.first_token - r.arrival <= model.ttft_slo_s)
    return Result(
        policy=policy.name,
        pods=pods,
        requests=len(requests),
        finished=len(finished),
        goodput=good / workload.duration_s,
        ttft_p50=_quantile(waits, 0.5),
        ttft_p99=_quantile(waits, 0.99),
        cold_loads_per_s=sum(p.loads for p in pool) / workload.duration_s,
        bytes_moved=sum(p.loaded_bytes for p in pool),
        pods_used=sum(1 for p in pool if p.served),
        prewarms_per_s=sum(p.prewarms for p in pool) / workload.duration_s,
    )


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]
