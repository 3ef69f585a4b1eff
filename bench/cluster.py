"""`python -m loraplex.bench cluster`: placement and routing policies on a simulated pool of pods (issue 26).

Every policy meets the same seeded trace (bench/cluster_sim.py): Zipf adapter popularity with a hot set
that shifts, bursts that flood one adapter, a share of base-model requests. Compared:
- random: any pod;
- least-loaded: the pod with the fewest outstanding requests (the gateway's own count);
- rendezvous: the previous gateway, the adapter's first HRW pod (`routing.rendezvous_order`), base
  requests at random;
- llm-d: the inference-extension scorers summed with weight 1 each, on metrics scraped every 50 ms:
  lora-affinity (1 active, 0.8 room for one more adapter, 0.6 waiting, else 0), queue (min-max
  normalised waiting queue), kv-cache-utilization (1 - usage); max score, ties at random;
- dynamo-hrw: each adapter on its first `k` HRW pods, the least-loaded of them;
- ours: `routing.Router` itself (placement with replication by demand), on the simulated clock, with the
  gateway's prewarm bookkeeping (`warming.Warming`): a pod a set grows to loads the adapter off the
  request path and takes its traffic once loaded.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

from loraplex.web.services import routing, warming

from . import cluster_sim as sim

POLICIES = ("random", "least-loaded", "rendezvous", "llm-d", "dynamo-hrw", "ours")
SCRAPE_S = 0.05  # the endpoint picker's metrics refresh


def _endpoint(index: int) -> str:
    return f"http://pod-{index}:8000"


def _key(adapter: int) -> str:
    return f"adapter:{adapter:08x}"


class _Base:
    name = ""

    def __init__(self, pods: list[sim.Pod], ranks: list[int], loop: sim.Loop, seed: int):
        self.pods, self.loop = pods, loop
        self.endpoints = [_endpoint(p.index) for p in pods]
        self.index = {e: i for i, e in enumerate(self.endpoints)}
        self.rng = random.Random(f"{self.name}-{seed}")
        self.outstanding = routing.Outstanding()
        self._hrw: dict[int, list[int]] = {}

    def hrw(self, adapter: int) -> list[int]:
        order = self._hrw.get(adapter)
        if order is None:
            order = [self.index[e] for e in routing.rendezvous_order(_key(adapter), self.endpoints)]
            self._hrw[adapter] = order
        return order

    def least_loaded(self, candidates: list[int]) -> int:
        shuffled = self.rng.sample(candidates, len(candidates))
        return min(shuffled, key=lambda i: self.outstanding.load(self.endpoints[i]))

    def pick(self, request: sim.Request, now: float) -> int:
        chosen = self.choose(request, now)
        key = None if request.adapter is None else _key(request.adapter)
        request.handle = self.outstanding.begin(self.endpoints[chosen], key)
        return chosen

    def choose(self, request: sim.Request, now: float) -> int:
        raise NotImplementedError

    def finished(self, request: sim.Request) -> None:
        assert isinstance(request.handle, routing.Work)
        request.handle.done()


class RandomPolicy(_Base):
    name = "random"

    def choose(self, request: sim.Request, now: float) -> int:
        return self.rng.randrange(len(self.pods))


class LeastLoaded(_Base):
    name = "least-loaded"

    def choose(self, request: sim.Request, now: float) -> int:
        return self.least_loaded(list(range(len(self.pods))))


class Rendezvous(_Base):
    name = "rendezvous"

    def choose(self, request: sim.Request, now: float) -> int:
        if request.adapter is None:
            return self.rng.randrange(len(self.pods))
        return self.hrw(request.adapter)[0]


class DynamoHrw(_Base):
    name = "dynamo-hrw"
    replicas = 2

    def choose(self, request: sim.Request, now: float) -> int:
        if request.adapter is None:
            return self.least_loaded(list(range(len(self.pods))))
        return self.least_loaded(self.hrw(request.adapter)[: self.replicas])


class LlmD(_Base):
    name = "llm-d"

    def __init__(self, pods: list[sim.Pod], ranks: list[int], loop: sim.Loop, seed: int):
        super().__init__(pods, ranks, loop, seed)
        self.snapshot: list[tuple[int, float, set[int], set[int], int]] = []
        self._scrape()

    def _scrape(self) -> None:
        self.snapshot = [
            (p.queue_length(), p.kv_usage(), p.active_adapters(), p.waiting_adapters(), p.max_adapters())
            for p in self.pods
        ]
        self.loop.at(self.loop.now + SCRAPE_S, self._scrape)

    def choose(self, request: sim.Request, now: float) -> int:
        queues = [s[0] for s in self.snapshot]
        low, high = min(queues), max(queues)
        best: list[int] = []
        top = -1.0
        for i, (queue, kv, active, waiting, max_lora) in enumerate(self.snapshot):
            score = 1.0 if high == low else (high - queue) / (high - low)
            score += 1.0 - kv
            if request.adapter is not None:
                if request.adapter in active:
                    score += 1.0
                elif len(active | waiting) < max_lora:
                    score += 0.8
                elif request.adapter in waiting:
                    score += 0.6
            if score > top + 1e-12:
                top, best = score, [i]
            elif abs(score - top) <= 1e-12:
                best.append(i)
        return self.rng.choice(best)


class Ours:
    """The gateway's router, unchanged: `order()` picks, `begin()`/`done()` count outstanding work; its
    replica-set changes go to the gateway's prewarm bookkeeping, whose loads the simulated pods run (the
    gateway's `Prewarmer` posts them to the engines instead)."""

    name = "ours"

    def __init__(
        self,
        pods: list[sim.Pod],
        ranks: list[int],
        loop: sim.Loop,
        seed: int,
        policy: routing.PlacementPolicy,
        prewarm: bool = True,
    ):
        self.endpoints = [_endpoint(p.index) for p in pods]
        self.index = {e: i for i, e in enumerate(self.endpoints)}
        self.sizes = [int(pods[0].sizes[a]) for a in range(len(ranks))]
        self.pods, self.loop = pods, loop
        self.adapter_of = {_key(a): a for a in range(len(ranks))}
        self.router = routing.Router(
            cooldown_s=10.0, policy=policy, clock=lambda: loop.now, rng=random.Random(f"ours-{seed}")
        )
        self.warming = warming.Warming()
        if prewarm:  # off: a grown member loads the adapter for its first request (tests compare)
            self.router.subscribe(self._changed)
            self.router.arrange = self.warming.arrange

    def _changed(self, change: routing.Change) -> None:
        adapter = self.adapter_of[change.key]
        for pod in self.warming.on_change(change):
            self.warming.started(pod, change.key)

            def done(ok: bool, pod: str = pod) -> None:
                self.warming.finished(pod, change.key, ok)

            self.pods[self.index[pod]].prewarm(adapter, self.loop.now, done)

    def pick(self, request: sim.Request, now: float) -> int:
        key = None if request.adapter is None else _key(request.adapter)
        size = 0 if request.adapter is None else self.sizes[request.adapter]
        chosen = self.router.order(key, self.endpoints, size)[0]
        request.handle = self.router.begin(chosen, key)
        return self.index[chosen]

    def finished(self, request: sim.Request) -> None:
        assert isinstance(request.handle, routing.Work)
        request.handle.done()


def placement_policy(model: sim.PodModel) -> routing.PlacementPolicy:
    """The gateway's default policy, scaled to a pod of `model`: saturated at three quarters of its batch
    (48 of 64, LORAPLEX_PLACEMENT_SATURATION's default), each pod bounded by its adapter pool."""
    return replace(
        routing.PlacementPolicy(),
        saturation=max(2, 3 * model.max_num_seqs // 4),
        pod_adapter_bytes=int(model.adapter_pool_bytes),
    )


def policy_factory(name: str, model: sim.PodModel, seed: int) -> Callable[..., sim.Policy]:
    classes: dict[str, type[_Base]] = {
        "random": RandomPolicy,
        "least-loaded": LeastLoaded,
        "rendezvous": Rendezvous,
        "llm-d": LlmD,
        "dynamo-hrw": DynamoHrw,
    }
    if name == "ours":
        policy = placement_policy(model)
        return lambda pods, ranks, loop: Ours(pods, ranks, loop, seed, policy)
    if name not in classes:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    cls = classes[name]
    return lambda pods, ranks, loop: cls(pods, ranks, loop, seed)


def compare(
    model: sim.PodModel, workload: sim.Workload, pod_counts: list[int], policies: list[str]
) -> list[sim.Result]:
    results = []
    for pods in pod_counts:
        for name in policies:
            started = time.perf_counter()
            result = sim.simulate(model, workload, pods, policy_factory(name, model, workload.seed))
            result.wall_s = time.perf_counter() - started
            results.append(result)
    return results


def table(results: list[sim.Result]) -> str:
    lines = [
        "| pods | policy | requests | goodput req/s | TTFT p50 s | TTFT p99 s | cold loads/s | prewarms/s "
        "| GB moved | pods used |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.pods} | {r.policy} | {r.requests} | {r.goodput:.1f} | {r.ttft_p50:.3f} | "
            f"{r.ttft_p99:.2f} | {r.cold_loads_per_s:.2f} | {r.prewarms_per_s:.2f} | "
            f"{r.bytes_moved / 1e9:.1f} | {r.pods_used} |"
        )
    return "\n".join(lines)


def plot(results: list[sim.Result], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pod_counts = sorted({r.pods for r in results})
    policies = list(dict.fromkeys(r.policy for r in results))
    figure, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    width = 0.8 / len(policies)
    for k, name in enumerate(policies):
        rows = {r.pods: r for r in results if r.policy == name}
        xs = [i + (k - (len(policies) - 1) / 2) * width for i in range(len(pod_counts))]
        for axis, metric in zip(axes, ("ttft_p99", "goodput", "cold_loads_per_s"), strict=True):
            values = [getattr(rows[p], metric) for p in pod_counts]
            if metric == "goodput":  # per pod, so pool sizes share one scale
                values = [v / p for v, p in zip(values, pod_counts, strict=True)]
            axis.bar(xs, values, width, label=name)
    for axis, label in zip(
        axes, ("TTFT p99 (s, log)", "goodput per pod (req/s)", "cold loads/s"), strict=True
    ):
        axis.set_xticks(range(len(pod_counts)), [f"{p} pods" for p in pod_counts])
        axis.set_ylabel(label)
    axes[0].set_yscale("log")
    axes[1].legend(fontsize=8)
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", choices=("a100", "h100", "cpu"), default="a100")
    parser.add_argument("--pods", default="4,16,64", help="comma-separated pool sizes")
    parser.add_argument("--adapters", type=int, default=2000)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    parser.add_argument("--load", type=float, default=0.85, help="share of the pool's saturated throughput")
    parser.add_argument("--bursts", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--plot", type=Path, default=None, help="write the figure here (PNG)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON too")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    model = {
        "a100": lambda: sim.gpu_model("A100"),
        "h100": lambda: sim.gpu_model("H100"),
        "cpu": sim.cpu_model,
    }[args.profile]()
    try:
        pods = [int(p) for p in args.pods.split(",")]
        policies = [p.strip() for p in args.policies.split(",")]
        workload = replace(
            sim.Workload(),
            adapters=args.adapters,
            duration_s=args.duration,
            load=args.load,
            bursts=args.bursts,
            seed=args.seed,
        )
        for name in policies:
            policy_factory(name, model, 0)
    except ValueError as exc:
        raise SystemExit(f"bench cluster: {exc}") from None
    if any(p < 1 for p in pods):
        raise SystemExit("bench cluster: --pods must be positive integers")
    per_pod = sim.saturated_rps(model, workload)
    print(
        f"bench cluster: {model.name}; {workload.adapters} adapters, Zipf {workload.zipf}, hot set of "
        f"{workload.hot} reshuffled every {workload.shift_s:.0f} s, {workload.bursts} bursts of "
        f"{workload.burst_pods:g} pods' worth for {workload.burst_s:.0f} s, {workload.base_share:.0%} base "
        f"model; load {workload.load:g} of {per_pod:.2f} req/s per pod; TTFT SLO {model.ttft_slo_s:g} s; "
        f"{workload.duration_s:.0f} s of arrivals, seed {workload.seed}"
    )
    results = compare(model, workload, pods, policies)
    print(table(results))
    print(f"simulated in {sum(r.wall_s for r in results):.1f} s")
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=1))
    if args.plot:
        title = (
            f"bench cluster --profile {args.profile} --pods {args.pods} --adapters {args.adapters} "
            f"--duration {args.duration:g} --seed {args.seed}  ({model.name})"
        )
        plot(results, args.plot, title)
        print(f"wrote {args.plot}")
    return 0
