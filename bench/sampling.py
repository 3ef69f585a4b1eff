"""Sampling a step's tokens (issue 16): the old per-row sampler (each row's logits to the host, then
`multinomial` on the CPU, one sync per row; kept here as the baseline, not in the engine) against the
engine's batched on-device sampler, on the same logits in the same run.

    python -m loraplex.bench sampling [--batch 64] [--vocab 49152 32000] [--repeats 5] [--device cpu]
        [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import torch

CASES = {  # name: SamplingParams fields
    "temperature 1": {"temperature": 1.0},
    "temperature 1, top-p 0.9": {"temperature": 1.0, "top_p": 0.9},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=64, help="rows sampled per step")
    parser.add_argument("--vocab", type=int, nargs="+", default=[49152, 32000], help="SmolLM2's, Llama-2's")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per sampler (median shown)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.set_defaults(run=run)


def old_sample(logits: torch.Tensor, requests: Sequence) -> list[int]:
    """The engine's sampler before issue 16, verbatim: per row, to the host, filter, multinomial."""
    greedy = logits.argmax(dim=-1).tolist()
    tokens: list[int] = []
    for row, request in enumerate(requests):
        params = request.params
        if params.greedy:
            tokens.append(int(greedy[row]))
            continue
        probs = _old_filtered_probs(logits[row].float().cpu(), params.temperature, params.top_k, params.top_p)
        tokens.append(int(torch.multinomial(probs, 1, generator=request.sampling.generator).item()))
    return tokens


def _old_filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = (cumulative - sorted_logits.softmax(-1)) >= top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits.softmax(-1)


def new_sample(logits: torch.Tensor, requests: Sequence) -> list[int]:
    from loraplex.engine.sampler import sample_step

    return sample_step(logits, requests).resolve()


def _median_ms(
    fn: Callable[[torch.Tensor, Sequence], list[int]],
    logits: torch.Tensor,
    requests: Sequence,
    repeats: int,
) -> float:
    times = []
    for _ in range(repeats):
        if logits.is_cuda:
            torch.cuda.synchronize(logits.device)
        start = time.perf_counter()
        fn(logits, requests)  # both return host lists: the time includes every copy and sync
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run(args: argparse.Namespace) -> int:
    from loraplex.engine import SamplingParams
    from loraplex.engine.request import Request, SamplingState

    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    print(
        f"sampling a step: batch {args.batch}, device {device}, {threads} threads, "
        f"median of {args.repeats} steps"
    )
    print(f"{'vocab':>6}  {'case':<26}{'old ms':>10}{'new ms':>10}{'speed-up':>10}")
    for vocab in args.vocab:
        logits = torch.randn(args.batch, vocab, generator=torch.Generator().manual_seed(vocab)) * 4
        logits = logits.to(device)
        for case, fields in CASES.items():
            params = SamplingParams(**fields)  # type: ignore[arg-type]
            requests = [
                Request(f"r{i}", [1], params, i, sampling=SamplingState(torch.Generator().manual_seed(i)))
                for i in range(args.batch)
            ]
            new_sample(logits, requests)  # warm both once (allocator, first-call costs)
            old_sample(logits, requests)
            new = _median_ms(new_sample, logits, requests, args.repeats)
            old = _median_ms(old_sample, logits, requests, args.repeats)
            print(f"{vocab:>6}  {case:<26}{old:>10.1f}{new:>10.1f}{old / new:>9.1f}x")
    return 0
