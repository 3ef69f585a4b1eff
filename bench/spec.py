"""Prompt-lookup speculative decoding (issue 30): one stream on an input-grounded workload, with and without.

The workload is what prompt lookup is for: replies that repeat much of their input. Each prompt is a chat
turn asking the model to rewrite or edit a passage it is given, and to return the passage whole:
- prose: a paragraph of sentences drawn (seeded) from a fixed list, with a few words misspelt by swapping
  two letters; "fix the spelling mistakes";
- code: a small Python function made from a template (seeded names and numbers); "rename a variable";
- a list: a shopping list of seeded items and quantities; "add one item at the end".
Greedy decoding, end-of-sequence honoured (so replies end where the model ends them, at most
`--max-tokens`), one request at a time (one stream). Both engines share one loaded model (the default:
SmolLM2-135M-Instruct's Q4_1 GGUF file) and take turns prompt by prompt, each prompt `--repeats` times
keeping the fastest, so a spell of load from other processes does not fall on one setting only.

Printed: generated tokens per second of each (the replies' tokens over the summed wall time of their
generate calls, prefill included), the speedup, the acceptance rate (accepted draft tokens over drafted
ones), tokens per verified step, and whether every reply was identical token for token. `--json` prints
one JSON line per figure, the last with `speedup` and `identical`.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass
from typing import Any

from .lora import machine_line

SENTENCES = (
    "The library opens at nine in the morning and closes at six in the evening.",
    "Visitors may borrow up to five books at a time for three weeks.",
    "The reading room on the second floor is kept quiet at all hours.",
    "Children can join the story club that meets every Saturday afternoon.",
    "Late returns cost ten cents per book for each day they are overdue.",
    "The cafe next to the entrance serves tea, coffee and fresh sandwiches.",
    "Members can reserve a computer for one hour by asking at the front desk.",
    "A new collection of local history books arrived at the start of the month.",
    "Please switch your phone to silent mode before entering the study area.",
    "The garden behind the building is open to readers when the weather is fine.",
)
ITEMS = ("apples", "bread", "milk", "eggs", "rice", "carrots", "cheese", "onions", "butter", "tea", "soap")
CODE = """def {name}({items}, {rate}):
    {total} = 0
    for item in {items}:
        price = item["price"] * item["quantity"]
        if price > {limit}:
            price = price - {discount}
        {total} = {total} + price
    tax = {total} * {rate}
    return {total} + tax
"""


def _misspell(sentence: str, rng: random.Random) -> str:
    words = sentence.split(" ")
    long = [i for i, w in enumerate(words) if len(w) > 4 and w.isalpha()]
    for i in rng.sample(long, min(2, len(long))):
        w = words[i]
        j = rng.randrange(1, len(w) - 2)
        words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2 :]
    return " ".join(words)


EDITOR = "You are an editor. Reply with the edited text only."
CODE_EDITOR = "You are a code editor. Reply with the corrected code only."
KINDS = ("spelling", "replace", "list", "code")
DEFAULT_KINDS = ("spelling", "replace", "list")


def _message(kind: str, rng: random.Random) -> list[dict[str, str]]:
    """One chat (system and user message) of the given kind, from `rng`."""
    if kind == "spelling":
        text = " ".join(_misspell(s, rng) for s in rng.sample(SENTENCES, 4))
        return [
            {"role": "system", "content": EDITOR},
            {"role": "user", "content": f"Correct the mistakes: {text}"},
        ]
    if kind == "replace":
        text = " ".join(rng.sample(SENTENCES, 4))
        word = rng.choice([w for w in text.split() if len(w) > 4 and w.isalpha() and w.islower()])
        return [
            {"role": "system", "content": EDITOR},
            {"role": "user", "content": f"Replace every '{word}' with '{word.upper()}' in: {text}"},
        ]
    if kind == "list":
        items = rng.sample(ITEMS, 6)
        lines = "\n".join(f"- {rng.randrange(1, 6)} {_misspell(item, rng)}" for item in items)
        return [
            {"role": "system", "content": EDITOR},
            {"role": "user", "content": f"Correct the spelling in this list:\n{lines}"},
        ]
    names = rng.sample(("total", "amount", "subtotal", "cost", "value"), 1)
    code = CODE.format(
        name=rng.choice(("compute_bill", "order_total", "checkout")),
        items=rng.choice(("items", "cart", "products")),
        rate=rng.choice(("tax_rate", "rate")),
        total=names[0],
        limit=rng.randrange(20, 90),
        discount=rng.randrange(2, 9),
    )
    code = code.replace("quantity", "quantiy", 1)
    return [
        {"role": "system", "content": CODE_EDITOR},
        {"role": "user", "content": f"Fix the typo in this code:\n\n```python\n{code}```"},
    ]


def workload(count: int, seed: int, kinds: tuple[str, ...] = DEFAULT_KINDS) -> list[list[dict[str, str]]]:
    """`count` chats cycling through `kinds`, from `seed`."""
    rng = random.Random(seed)
    return [_message(kinds[index % len(kinds)], rng) for index in range(count)]


@dataclass
class Run:
    label: str
    seconds: float = 0.0
    tokens: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def _generate(engine: Any, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    from loraplex.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    started = time.perf_counter()
    (output,) = engine.generate([prompt], params)
    seconds = time.perf_counter() - started
    if output.error:
        raise RuntimeError(output.error)
    return seconds, list(output.token_ids)


def run(args: argparse.Namespace) -> int:
    import torch

    from loraplex.engine import EngineConfig, LLMEngine
    from loraplex.engine.model.loader import load_model

    config = {"device": "cpu", "model": args.model, "dtype": args.dtype, "quantization": args.quantization}
    plain_config = EngineConfig(**config)
    loaded = load_model(
        plain_config.model,
        plain_config.torch_dtype(torch.device("cpu")),
        torch.device("cpu"),
        plain_config.seed,
        quantization=plain_config.quantization,
    )
    plain = LLMEngine(plain_config, loaded=loaded)
    spec = LLMEngine(
        EngineConfig(
            **config,
            speculative="ngram",
            num_speculative_tokens=args.k,
            prompt_lookup_max=args.ngram_max,
            prompt_lookup_min=args.ngram_min,
        ),
        loaded=loaded,
    )
    tokenizer = plain.tokenizer
    assert tokenizer is not None
    kinds = tuple(args.kinds.split(","))
    if not kinds or any(k not in KINDS for k in kinds):
        raise SystemExit(f"--kinds takes a comma-separated list of {', '.join(KINDS)}")
    prompts = [tokenizer.encode_chat(chat) for chat in workload(args.prompts, args.seed, kinds)]
    for engine in (plain, spec):  # one-time costs out of the figures
        _generate(engine, prompts[0][:16], 4)
    runs = {"plain": Run("without speculation"), "spec": Run(f"ngram k={args.k}")}
    identical = True
    replies: dict[str, list[list[int]]] = {"plain": [], "spec": []}
    for index, prompt in enumerate(prompts):
        order = ("plain", "spec") if index % 2 == 0 else ("spec", "plain")
        best: dict[str, float] = {}
        for _ in range(args.repeats):
            for key in order:
                seconds, tokens = _generate(plain if key == "plain" else spec, prompt, args.max_tokens)
                best[key] = min(best.get(key, seconds), seconds)
                if len(replies[key]) <= index:
                    replies[key].append(tokens)
                elif replies[key][index] != tokens:
                    raise RuntimeError(f"{key}: a greedy reply changed between repeats")
        for key in order:
            runs[key].seconds += best[key]
            runs[key].tokens += len(replies[key][index])
        identical = identical and replies["plain"][index] == replies["spec"][index]
    stats = spec.stats().spec
    assert stats is not None
    speedup = runs["spec"].tokens_per_second / runs["plain"].tokens_per_second
    figures: list[dict[str, Any]] = [
        {"setting": runs[k].label, "tokens": runs[k].tokens, "seconds": round(runs[k].seconds, 3),
         "tokens_per_second": round(runs[k].tokens_per_second, 2)}
        for k in ("plain", "spec")
    ]  # fmt: skip
    figures.append(
        {
            "acceptance_rate": round(stats.acceptance_rate, 3),
            "tokens_per_step": round(stats.tokens_per_step, 2),
            "draft_tokens": stats.draft_tokens,
            "accepted_tokens": stats.accepted_tokens,
        }
    )
    figures.append({"speedup": round(speedup, 2), "identical": identical})
    if args.json:
        for figure in figures:
            print(json.dumps(figure))
        return 0 if identical else 1
    print(machine_line())
    print(
        f"{len(prompts)} prompts ({', '.join(kinds)} edits), greedy, at most {args.max_tokens} tokens, one "
        f"stream; model {loaded.source} ({plain_config.dtype_name(torch.device('cpu'))}, quantization "
        f"{loaded.quantization}); k={args.k}, n-grams {args.ngram_max}..{args.ngram_min}; best of "
        f"{args.repeats} per prompt"
    )
    for key in ("plain", "spec"):
        r = runs[key]
        print(f"{r.label:>22}: {r.tokens_per_second:7.2f} tok/s ({r.tokens} tokens in {r.seconds:.2f} s)")
    print(
        f"speedup {speedup:.2f}x; acceptance rate {stats.acceptance_rate:.1%} ({stats.accepted_tokens} of "
        f"{stats.draft_tokens} draft tokens); {stats.tokens_per_step:.2f} tokens per verified step; "
        f"outputs identical: {'yes' if identical else 'NO'}"
    )
    return 0 if identical else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a model path or URI (default: SmolLM2-135M's GGUF)")
    parser.add_argument(
        "--dtype",
        default="float32",
        help="the engines' dtype: float32, where greedy replies are exact (in bfloat16 a reply can change "
        "with the step's shape: a prefix-cache hit or a verify step rounds differently)",
    )
    parser.add_argument("--quantization", default="none", help="the engines' weight quantization")
    parser.add_argument("--prompts", type=int, default=6, help="prompts in the workload")
    parser.add_argument(
        "--kinds",
        default=",".join(DEFAULT_KINDS),
        help=f"edits the prompts cycle through, of {', '.join(KINDS)}",
    )
    parser.add_argument("--max-tokens", type=int, default=160, help="tokens per reply at most")
    parser.add_argument("-k", type=int, default=8, help="draft tokens per step at most")
    parser.add_argument("--ngram-max", type=int, default=3, help="longest n-gram matched")
    parser.add_argument("--ngram-min", type=int, default=1, help="shortest n-gram matched")
    parser.add_argument("--repeats", type=int, default=2, help="runs per prompt and setting (fastest kept)")
    parser.add_argument("--seed", type=int, default=0, help="the workload's seed")
    parser.add_argument("--json", action="store_true", help="one JSON line per figure instead of the text")
    parser.set_defaults(run=run)
