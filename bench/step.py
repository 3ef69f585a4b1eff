"""`python -m loraplex.bench step --device cuda|cpu`: one decode step's time against its counted floor.

For each batch size (1, 32, 256 by default) the engine admits that many requests of `--context`
prompt tokens, each with its own synthetic adapter (rank `--rank` on q, k, v, o) as long as there are
`--adapters` of them, prefills them, then times `--steps` decode steps. The floor beside each time is
the step's counted bytes (weights, every cached key and value, the step's adapters) over the memory
bandwidth and its FLOPs over the peak rate (`floors.decode_step_cost`): on CUDA the datasheet peaks of
the GPU when it is listed in `floors.DEVICE_PEAKS`, on the CPU the rates measured in the same run.

`--count` also runs one decode step under the dispatch counter (bench/dispatch.py) and prints the aten
ops and Triton launches of the step and of its forward, and the host reads (device syncs) of each.

CUDA: Llama-2-7B-shaped random weights, float16. CPU: the real SmolLM2-135M, float32.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from .floors import DEVICE_PEAKS, copy_bandwidth, decode_step_cost, matmul_rate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--batches", default="1,32,256", help="comma-separated batch sizes")
    parser.add_argument("--context", type=int, default=256, help="prompt tokens of every request")
    parser.add_argument("--adapters", type=int, default=2000, help="adapters registered (one per request)")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10, help="decode steps timed per batch size")
    parser.add_argument("--model", default=None, help="default: random:llama-7b (cuda), SmolLM2 (cpu)")
    parser.add_argument("--dtype", default=None, help="default: float16 (cuda), float32 (cpu)")
    parser.add_argument("--kernels", default="auto", choices=("auto", "torch", "triton"))
    parser.add_argument(
        "--graph-decode", default="auto", choices=("auto", "on", "off"), help="EngineConfig.graph_decode"
    )
    parser.add_argument("--count", action="store_true", help="also count ops and syncs of one step")
    parser.set_defaults(run=run)


def make_engine(args: argparse.Namespace, max_batch: int) -> Any:
    from loraplex.engine import EngineConfig, LLMEngine

    cuda = args.device == "cuda"
    pages_per_request = -(-(args.context + 2 * args.steps + 8) // 16) + 1
    # Passed only when asked for, so the command also runs on engines from before the setting.
    graph = {} if args.graph_decode == "auto" else {"graph_decode": args.graph_decode}
    config = EngineConfig(
        **graph,
        model=args.model or ("random:llama-7b" if cuda else None),
        device=args.device,
        dtype=args.dtype or ("float16" if cuda else "float32"),
        kernels=args.kernels,
        max_num_seqs=max_batch,
        max_batch_tokens=max(2048, max_batch),
        # On the CPU the pool is sized for the run (the default budget is small); on CUDA it takes its
        # share of free memory.
        num_pages=None if cuda else max_batch * (pages_per_request + 40) + 64,
        max_model_len=args.context + 64 + 2 * args.steps,
    )
    return LLMEngine(config)


def fill_decodes(engine: Any, batch: int, args: argparse.Namespace, first_adapter: int) -> None:
    """Admit `batch` requests (adapter i of the registered ones each) and prefill them all."""
    from loraplex.engine import SamplingParams

    vocab = engine.loaded.config.vocab_size
    params = SamplingParams(max_tokens=4 * args.steps + 8, temperature=0.0, ignore_eos=True)
    generator = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(100, vocab, (args.context,), generator=generator).tolist()
        adapter = f"a{(first_adapter + i) % args.adapters}" if args.adapters else None
        engine.add_request(prompt, params, adapter=adapter)
    scheduler = engine.scheduler
    while scheduler.waiting or any(
        r.num_computed_tokens < len(r.prompt_token_ids) for r in scheduler.running
    ):
        engine.step()


def peaks(args: argparse.Namespace, engine: Any) -> tuple[float, float, str]:
    """(FLOP/s, bytes/s, where they come from) for the floor."""
    if args.device == "cuda":
        name = torch.cuda.get_device_name()
        for key, (flops, bandwidth) in DEVICE_PEAKS.items():
            if key in name:
                return flops, bandwidth, f"{name} datasheet"
        raise SystemExit(f"no datasheet peaks for {name}: add it to bench/floors.py DEVICE_PEAKS")
    dtype = engine.loaded.model.dtype
    return matmul_rate(64, engine.loaded.config, dtype), copy_bandwidth(), "measured in this run"


def count_step(engine: Any) -> dict[str, int]:
    """Ops, launches and host reads of one decode step and of its forward (build, run, finite flags)."""
    from .dispatch import DispatchCounter

    forward_counts: dict[str, int] = {}
    # The forward proper: the runner's `forward` (metadata copy to logits and finite flags, no host read
    # by design); engines from before it have `_launch`, or `_forward`, which also checks the flags.
    if hasattr(engine.runner, "forward"):
        owner, name = engine.runner, "forward"
    else:
        owner, name = engine, "_launch" if hasattr(engine, "_launch") else "_forward"
    original = getattr(owner, name)

    def counted(chunks: Any, *feed: Any) -> Any:
        counter = DispatchCounter()
        with counter as trace:
            logits = original(chunks, *feed)
        forward_counts["forward_ops"] = trace.launches
        forward_counts["forward_triton"] = sum(1 for name, _ in trace.ops if name.startswith("triton:"))
        forward_counts["forward_host_reads"] = len(trace.host_reads)
        return logits

    setattr(owner, name, counted)
    try:
        with DispatchCounter() as step_trace:
            engine.step()
    finally:
        delattr(owner, name)  # the bound method again
    return {
        "step_ops": step_trace.launches,
        "step_host_reads": len(step_trace.host_reads),
        **forward_counts,
    }


def run(args: argparse.Namespace) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a GPU; use --device cpu here")
    from loraplex.engine.lora.synthetic import SyntheticAdapter

    batches = [int(b) for b in args.batches.split(",")]
    engine = make_engine(args, max(batches))
    config = engine.loaded.config
    for i in range(args.adapters):
        engine.register_adapter(f"a{i}", SyntheticAdapter(config.lora_shape(), seed=i, rank=args.rank))
    flops_rate, bandwidth, source = peaks(args, engine)
    element = engine.loaded.model.dtype.itemsize
    print(
        f"decode step, {config.name} {engine.loaded.model.dtype} on {args.device}, context {args.context}, "
        f"{args.adapters} adapters of rank {args.rank}; peaks {flops_rate / 1e9:.0f} GFLOP/s, "
        f"{bandwidth / 1e9:.0f} GB/s ({source})"
    )
    print(f"{'batch':>6}{'GB read':>10}{'GFLOP':>10}{'floor ms':>10}{'step ms':>10}{'x floor':>9}")
    first = 0
    for batch in batches:
        fill_decodes(engine, batch, args, first)
        first += batch
        engine.step()  # warm: the first decode step of this size
        sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
        sync()
        started = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        sync()
        seconds = (time.perf_counter() - started) / args.steps
        context = args.context + 2 + args.steps // 2  # the mean context of the timed steps
        cost = decode_step_cost(config, batch, context, element, args.adapters, args.rank)
        floor = cost.floor_seconds(flops_rate, bandwidth)
        print(
            f"{batch:>6}{cost.bytes / 1e9:>10.2f}{cost.flops / 1e9:>10.1f}{floor * 1e3:>10.2f}"
            f"{seconds * 1e3:>10.2f}{seconds / floor:>9.1f}"
        )
        if args.count:
            counts = count_step(engine)
            print("        " + ", ".join(f"{k} {v}" for k, v in counts.items()))
        for request_id in list(engine._requests):
            engine.abort(request_id)
    return 0
