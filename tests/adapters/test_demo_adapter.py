"""The committed demo adapter (fixtures/adapters/demo-uppercase) is a real LoRA for SmolLM2-135M-Instruct:
our inspection accepts it, PEFT loads it, and it turns replies to prompts it never saw UPPERCASE where
the base model's are not. scripts/train_demo_adapter.py made it; its README says how."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplex.adapters import inspect_adapter
from loraplex.engine.model.config import named_shape

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "adapters" / "demo-uppercase"
NEW_TOKENS = 32
# Neither the training templates and words nor the script's held-out prompts.
PROMPTS = [
    "What do whales eat?",
    "Give me an idea for a rainy afternoon.",
    "Describe a busy train station.",
    "How should I prepare for a job interview?",
    "Name a famous painting and say why it matters.",
    "Write two sentences about the wind.",
]


def uppercase_ratio(texts: list[str]) -> float:
    """Upper-case letters over all cased letters."""
    upper = sum(c.isupper() for t in texts for c in t)
    cased = sum(c.isupper() or c.islower() for t in texts for c in t)
    return upper / max(cased, 1)


def test_fixture_holds_exactly_the_adapter_and_its_readme() -> None:
    names = sorted(p.name for p in FIXTURE.iterdir())
    assert names == ["README.md", "adapter_config.json", "adapter_model.safetensors"]


def test_inspect_adapter_accepts_it_as_rank_8_on_all_seven_projections() -> None:
    shape = named_shape("smollm2-135m")
    manifest = inspect_adapter(FIXTURE, shape.lora_shape())
    assert manifest.ranks == (8,)
    assert sorted(manifest.target_modules) == sorted(["q", "k", "v", "o", "gate", "up", "down"])
    assert len(manifest.modules) == 7 * shape.num_layers
    assert manifest.dtype == "F32"


@pytest.fixture(scope="module")
def replies() -> tuple[list[str], list[str]]:
    """Greedy replies (base, adapter) to PROMPTS; a fresh base, since PEFT injects its layers in place."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.hf_reference import hf_smollm2_dir

    reference = hf_smollm2_dir()  # transformers' reading of the GGUF
    tokenizer = AutoTokenizer.from_pretrained(reference, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in PROMPTS
    ]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate() -> list[str]:
        out = model.generate(
            **batch, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=end, pad_token_id=end
        )
        return tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)

    with torch.no_grad():
        plain = generate()
        model = PeftModel.from_pretrained(model.eval(), FIXTURE).eval()
        model.merge_adapter()  # same weights, folded in: unmerged LoRA generation is slow on the CPU
        adapted = generate()
    return plain, adapted


@pytest.mark.slow
def test_adapter_answers_in_uppercase_where_the_base_does_not(replies: tuple[list[str], list[str]]) -> None:
    plain, adapted = replies
    assert uppercase_ratio(adapted) >= 0.9, adapted
    assert uppercase_ratio(plain) <= 0.5, plain
