"""Per-token cost of structured decoding's token mask (issue 27 item 4): xgrammar against llguidance.

For one JSON schema, B matchers walk the same valid output token by token (SmolLM2's tokenizer, as
`loraplex tokenizer export` writes it). Each timed token is what the engine's host does per step for its
grammar rows: fill the B rows' token bitmask, then advance each matcher by the token it "sampled". The
figure is µs per step (all B rows) and per row-token (step / B), median over the output's tokens, batch 1
and 32. Each library runs its own batched entry point (xgrammar's BatchGrammarMatcher, llguidance's
LLExecutor) with the threads this machine has.

    python -m loraplex.bench grammar [--batch 1 32] [--repeats 3] [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "active", "role", "tags"],
    "additionalProperties": False,
}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "active": True, "role": "admin", "tags": ["math", "engines"]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32], help="grammar rows per step")
    parser.add_argument("--repeats", type=int, default=3, help="walks of the output per library and batch")
    parser.add_argument(
        "--tokenizer", default=None, help="a Hugging Face tokenizer directory (default: export)"
    )
    parser.set_defaults(run=run)


Step = Callable[[int], None]  # one step: fill the batch's masks, advance every matcher by token t


def xgrammar_walk(hf_tokenizer: Any, vocab: int, batch: int) -> tuple[Step, Callable[[], None]]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(
        SCHEMA, any_whitespace=False, separators=(",", ":")
    )
    bitmask = xgr.allocate_token_bitmask(batch, vocab)
    batcher = xgr.BatchGrammarMatcher()
    matchers: list[Any] = []

    def reset() -> None:
        matchers[:] = [xgr.GrammarMatcher(compiled) for _ in range(batch)]

    def step(token: int) -> None:
        if batch == 1:
            matchers[0].fill_next_token_bitmask(bitmask)
            ok = [matchers[0].accept_token(token)]
        else:
            batcher.batch_fill_next_token_bitmask(matchers, bitmask)
            ok = xgr.BatchGrammarMatcher.batch_accept_token(matchers, [token] * batch)
        if not all(ok):
            raise RuntimeError(f"xgrammar refused token {token}")

    return step, reset


def llguidance_walk(hf_tokenizer: Any, vocab: int, batch: int) -> tuple[Step, Callable[[], None]]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    bitmask = llguidance.torch.allocate_token_bitmask(batch, vocab)
    executor = llguidance.LLExecutor()
    matchers: list[Any] = []

    def reset() -> None:
        matchers[:] = [llguidance.LLMatcher(tokenizer, grammar) for _ in range(batch)]

    def step(token: int) -> None:
        if batch == 1:
            llguidance.torch.fill_next_token_bitmask(matchers[0], bitmask, 0)
            ok = [matchers[0].consume_token(token)]
        else:
            llguidance.torch.fill_next_token_bitmask_par(
                executor, [(m, i) for i, m in enumerate(matchers)], bitmask
            )
            ok = executor.consume_token_par([(m, token) for m in matchers])
        if not all(ok):
            raise RuntimeError(f"llguidance refused token {token}: {matchers[0].get_error()}")

    return step, reset


LIBRARIES = {"xgrammar": xgrammar_walk, "llguidance": llguidance_walk}


def measure(step: Step, reset: Callable[[], None], tokens: list[int], repeats: int) -> float:
    """Median seconds of one step over every token of `repeats` walks of the output."""
    times: list[float] = []
    for _ in range(repeats):
        reset()
        for token in tokens:
            start = time.perf_counter()
            step(token)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _tokenizer_dir(given: str | None, scratch: Path) -> Path:
    if given is not None:
        return Path(given)
    from loraplex.engine.tokenizer_export import export_tokenizer, load_tokenizer

    tokenizer, context = load_tokenizer()
    return export_tokenizer(tokenizer, scratch, context)


def run(args: argparse.Namespace) -> int:
    import transformers

    with tempfile.TemporaryDirectory() as scratch:
        directory = _tokenizer_dir(args.tokenizer, Path(scratch))
        hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    vocab = len(hf_tokenizer)
    tokens = hf_tokenizer.encode(json.dumps(INSTANCE, separators=(",", ":")), add_special_tokens=False)
    print(f"schema output: {len(tokens)} tokens, vocabulary {vocab}")
    print(f"{'library':<12} {'batch':>5} {'µs/step':>10} {'µs/row-token':>13}")
    for name, walk in LIBRARIES.items():
        for batch in args.batch:
            step, reset = walk(hf_tokenizer, vocab, batch)
            seconds = measure(step, reset, tokens, args.repeats)
            print(f"{name:<12} {batch:>5} {seconds * 1e6:>10.1f} {seconds * 1e6 / batch:>13.1f}")
    return 0
