"""Multi-LoRA serving matches transformers + PEFT token for token (float32, greedy), with adapters of
different ranks and targets mixed in one batch, a pool small enough to force adapter evictions and KV
preemption."""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path

import pytest
import torch

from loraplex.engine import EngineConfig, LLMEngine, SamplingParams
from tests.hf_reference import remembered

pytestmark = pytest.mark.slow
NEW_TOKENS = 12
STORY_SENTENCE = (
    "The lighthouse keeper climbed the steps each evening, trimmed the wick and watched the beam sweep "
    "across the grey water while ships passed in the night."
)

ADAPTERS = {
    "qv-r8": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "all-r16": {"r": 16, "lora_alpha": 16, "target_modules": "all-linear"},
    "qv-r64": {"r": 64, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"]},
    "ko-r8-rslora": {"r": 8, "lora_alpha": 8, "target_modules": ["k_proj", "o_proj"], "use_rslora": True},
    "attn-r16-pattern": {
        "r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "rank_pattern": {"k_proj": 8}, "alpha_pattern": {"o_proj": 8},
    },
    "down-r64-half": {
        "r": 64, "lora_alpha": 64, "target_modules": ["down_proj"], "layers_to_transform": list(range(15)),
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def peft_model(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """SmolLM2 in transformers with the six adapters; each saved as its own PEFT directory."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.hf_reference import hf_smollm2_dir

    base = AutoModelForCausalLM.from_pretrained(hf_smollm2_dir(), dtype=torch.float32)
    names = list(ADAPTERS)
    # PEFT draws A from torch's global generator: seeded, the adapters are the same every run (seed 0's
    # all-r16 ends one reply at EOS before NEW_TOKENS, which the full-length check below refuses).
    with torch.random.fork_rng():
        torch.manual_seed(1)
        model = get_peft_model(base, LoraConfig(**ADAPTERS[names[0]]), adapter_name=names[0])
        for name in names[1:]:
            model.add_adapter(name, LoraConfig(**ADAPTERS[name]))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "lora_B" in param_name:  # PEFT starts B at zero; a trained adapter's B is not
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    root = tmp_path_factory.mktemp("lora")
    dirs = {}
    for name in names:
        model.save_pretrained(root / name, selected_adapters=[name])
        saved = root / name / name if (root / name / name).is_dir() else root / name
        dirs[name] = saved
    model.eval()
    return model, dirs


def reference_tokens(model, prompt: list[int], adapter: str | None) -> list[int]:  # type: ignore[no-untyped-def]
    """transformers + PEFT, this request alone, with its adapter (or with adapters disabled)."""
    ids = torch.tensor([prompt])
    if adapter is not None:
        model.set_adapter(adapter)
    adapters_off = model.disable_adapter() if adapter is None else contextlib.nullcontext()
    with torch.inference_mode(), adapters_off:
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
            pad_token_id=2,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_mixed_adapter_batch_matches_peft_under_pressure(smollm2, peft_model) -> None:
    model, dirs = peft_model
    tokenizer = smollm2.tokenizer
    topics = ["the sea", "a bicycle", "volcanoes", "tea", "chess", "the moon", "bread", "rain", "owls",
              "trains", "music", "winter", "bees", "maps", "clocks", "rivers", "glass", "salt"]  # fmt: skip
    adapters: list[str | None] = [*ADAPTERS, None]
    requests = []
    for i, topic in enumerate(topics):
        # Long prompts (about 60 to 300 tokens) are prefilled in chunks and fill the pool.
        story = " ".join([STORY_SENTENCE] * (1 + i % 6))
        messages = [{"role": "user", "content": f"{story}\nNow write one sentence about {topic}."}]
        requests.append((tokenizer.encode_chat(messages), adapters[i % len(adapters)]))
    assert len(requests) >= 16

    # transformers + PEFT's tokens, computed once per machine for these exact adapter weights (their
    # digest is in the key) and requests (tests/hf_reference.py remembered).
    import peft

    weights = hashlib.sha256()
    for param_name, param in sorted(model.named_parameters()):
        if "lora_" in param_name:
            weights.update(param_name.encode() + param.detach().numpy().tobytes())
    expected = remembered(
        "lora-parity",
        (requests, NEW_TOKENS, weights.hexdigest(), peft.__version__),
        lambda: [reference_tokens(model, prompt, adapter) for prompt, adapter in requests],
    )
    ids = torch.tensor([requests[0][0]])
    with torch.inference_mode(), model.disable_adapter():
        base_logits = model(ids).logits[0, -1]
    for name in ADAPTERS:  # every adapter moves the model's predictions: the parity below means something
        model.set_adapter(name)
        with torch.inference_mode():
            assert (model(ids).logits[0, -1] - base_logits).abs().max() > 0.05, name

    # The six adapters take 76 pages of 16 tokens' worth, the 18 requests' KV about 140 more: 100 pages
    # hold neither all adapters and all KV at once, so adapters are evicted and chunked prefills of the
    # long prompts run the pool dry, which preempts the latest requests.
    engine = LLMEngine(
        EngineConfig(device="cpu", dtype="float32", num_pages=100, max_num_seqs=18, max_batch_tokens=256),
        loaded=smollm2,
    )
    for name, directory in dirs.items():
        engine.register_adapter(name, Path(directory))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    request_ids = [engine.add_request(prompt, params, adapter=adapter) for prompt, adapter in requests]
    tracked = {i: engine._requests[i] for i in request_ids}
    finished = {}
    endings = {}  # why each ended: a short reply says whether it stopped or was ended with an error
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.token_ids
                endings[out.request_id] = (out.finish_reason, out.error, tracked[out.request_id].adapter)
    assert sum(r.num_preemptions for r in tracked.values()) > 0, "expected KV preemption"
    assert engine.stats().adapter_evictions > 0, "expected adapter evictions"
    for request_id, want in zip(request_ids, expected, strict=True):
        got = finished[request_id]
        assert got == want[: len(got)] and len(got) == NEW_TOKENS, (got, want, endings[request_id])
    assert engine.pool.pages_by_kind()["kv"] == 0
