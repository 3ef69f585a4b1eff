"""Decode steps replayed from CUDA graphs against eager steps, on a CUDA GPU (bench/gpu_kernel_check.sh).

tests/engine/test_graphs.py proves on the CPU that a replay needs nothing but its bucket's buffers, with a
stand-in backend. This is the same check with torch.cuda.CUDAGraph itself: one engine (graph decode on)
runs one mixed batch eagerly (its graphs set aside) and then from graphs: greedy and seeded sampling,
three adapters of different ranks and the base model, requests that finish at different steps so the
buckets shrink. The tokens must be identical; then the replays are counted and one decode step is timed
in each mode.

`python bench/cuda_graph_check.py [--model random:tiny] [--dtype float16]`: prints PASS or FAIL; exit 1 on
a mismatch or when no step replayed.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def make_engine(model: str, dtype: str, device: str):
    from loraplex.engine import EngineConfig, LLMEngine
    from loraplex.engine.lora.synthetic import SyntheticAdapter

    engine = LLMEngine(
        EngineConfig(
            model=model,
            device=device,
            dtype=dtype,
            kernels="triton",
            graph_decode="on",
            max_num_seqs=32,
            num_pages=1024,
            prefix_caching=False,
        )
    )
    if device == "cpu":
        from loraplex.engine.graphs import CpuGraphBackend, DecodeGraphs

        engine.runner.graphs = DecodeGraphs(CpuGraphBackend())
    for i, rank in enumerate((8, 16, 64)):  # heterogeneous ranks, as the kernels serve them
        engine.register_adapter(f"a{i}", SyntheticAdapter(engine.base_shape, seed=i, rank=rank))
    return engine


def workload(count: int) -> tuple[list[list[int]], list, list[str | None]]:
    from loraplex.engine import SamplingParams

    prompts = [list(range(10 + i, 20 + i + 5 * (i % 4))) for i in range(count)]
    params = [
        SamplingParams(max_tokens=6 + 3 * (i % 5), temperature=0.0, ignore_eos=True)
        if i % 2 == 0
        else SamplingParams(max_tokens=5 + 2 * (i % 7), temperature=0.8, top_p=0.9, seed=i, ignore_eos=True)
        for i in range(count)
    ]
    adapters = [(None, "a0", "a1", "a2")[i % 4] for i in range(count)]
    return prompts, params, adapters


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step_seconds(engine, batch: int, steps: int = 20) -> float:
    """Mean wall time of one decode step with `batch` running requests (synchronised)."""
    from loraplex.engine import SamplingParams

    params = SamplingParams(max_tokens=steps + 10, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        adapter = ("a0", "a1", "a2", None)[i % 4]
        engine.add_request(list(range(5 + i % 50, 40 + i % 50)), params, adapter=adapter)
    for _ in range(4):  # prefill, then warm steps (captures happen here)
        engine.step()
    sync()
    began = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    elapsed = (time.perf_counter() - began) / steps
    while engine.has_unfinished():
        engine.step()
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="random:tiny")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--requests", type=int, default=24)
    # cpu: a smoke test of this script (TRITON_INTERPRET=1, the tests' stand-in graph backend).
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--batches", default="1,8,32")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("FAIL: no CUDA device")
        return 1
    prompts, params, adapters = workload(args.requests)
    engine = make_engine(args.model, args.dtype, args.device)
    graphs = engine.runner.graphs
    if graphs is None:
        print("FAIL: graph_decode on gave no decode graphs")
        return 1
    tokens = {}
    for mode in ("off", "on"):
        engine.runner.graphs = graphs if mode == "on" else None
        tokens[mode] = [list(o.token_ids) for o in engine.generate(prompts, params, adapters)]
    stats = graphs.stats
    print(f"model {args.model} {args.dtype}, {args.requests} requests; graph stats: {stats}")
    same = sum(a == b for a, b in zip(tokens["off"], tokens["on"], strict=True))
    print(f"identical replies: {same}/{len(prompts)}")
    for i, (a, b) in enumerate(zip(tokens["off"], tokens["on"], strict=True)):
        if a != b:
            print(f"  request {i} ({adapters[i]}, {params[i].temperature}): eager {a} graph {b}")
    for batch in map(int, args.batches.split(",")):
        engine.runner.graphs = None
        eager = step_seconds(engine, batch)
        engine.runner.graphs = graphs
        replay = step_seconds(engine, batch)
        print(f"decode step, batch {batch:>3}: eager {eager * 1e3:8.3f} ms  graph {replay * 1e3:8.3f} ms  "
              f"({eager / replay:.2f}x)")  # fmt: skip
    ok = same == len(prompts) and stats.replays > 0
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
