"""DoRA adapters served (issue 28 item 4): greedy tokens match transformers + PEFT in float32 with DoRA
adapters of several ranks and targets, a plain LoRA adapter and base rows in one batch; the per-channel
scale m / ||W0 + s·B·A|| is computed at load and kept in the pool (engine/lora/dora.py); the same
adapters answer alike through `loraplex generate` and the engine server."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from loraplex.engine import EngineConfig, LLMEngine, SamplingParams
from loraplex.engine.kernels import reference

pytestmark = pytest.mark.slow
NEW_TOKENS = 8
ROOT = Path(__file__).resolve().parents[2]

ADAPTERS = {
    "dora-qv-r8": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "use_dora": True},
    "dora-all-r16": {"r": 16, "lora_alpha": 16, "target_modules": "all-linear", "use_dora": True},
    "dora-od-r4-rslora": {
        "r": 4, "lora_alpha": 8, "target_modules": ["o_proj", "down_proj"], "use_rslora": True,
        "layers_to_transform": list(range(0, 30, 2)), "use_dora": True,
    },
    "dora-gu-r32-pattern": {
        "r": 32, "lora_alpha": 32, "target_modules": ["gate_proj", "up_proj"], "rank_pattern": {"up_proj": 8},
        "use_dora": True,
    },
    "lora-qkv-r8": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj"]},
}  # fmt: skip
DORA = [name for name, config in ADAPTERS.items() if config.get("use_dora")]
PROMPTS = [
    "The lighthouse keeper climbed the steps each evening and",
    "Write one sentence about bees.",
    "Paris is the capital of",
    "Tea is made by",
    "The moon orbits",
    "Rain falls when",
]


@pytest.fixture(scope="module")
def peft_model(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """SmolLM2 in transformers with the adapters, each saved as its own PEFT directory. B is random (PEFT
    starts it at zero) and the magnitudes are moved off their initial ||W0 + s·B·A|| by up to ±30% per
    channel, so a served adapter that ignored m (or the norm) would answer otherwise."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.hf_reference import hf_smollm2_dir

    base = AutoModelForCausalLM.from_pretrained(hf_smollm2_dir(), dtype=torch.float32)
    names = list(ADAPTERS)
    model = get_peft_model(base, LoraConfig(**ADAPTERS[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, LoraConfig(**ADAPTERS[name]))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "lora_B" in param_name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
            elif "lora_magnitude_vector" in param_name:
                param.mul_(1 + 0.3 * (2 * torch.rand(param.shape, generator=generator) - 1))
    root = tmp_path_factory.mktemp("dora")
    dirs = {}
    for name in names:
        model.save_pretrained(root / name, selected_adapters=[name])
        dirs[name] = root / name / name if (root / name / name).is_dir() else root / name
    model.eval()
    return model, dirs


def reference_tokens(model, prompt: list[int], adapter: str | None) -> list[int]:  # type: ignore[no-untyped-def]
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


@pytest.fixture(scope="module")
def requests_and_expected(smollm2, peft_model):  # type: ignore[no-untyped-def]
    """(prompt ids, adapter) for every adapter and the base, and PEFT's greedy tokens for each."""
    from peft.tuners.lora import dora

    model, _ = peft_model
    tokenizer = smollm2.tokenizer
    adapters: list[str | None] = [*ADAPTERS, None]
    requests = [(tokenizer.encode(PROMPTS[i % len(PROMPTS)]), a) for i, a in enumerate(adapters)]
    # PEFT recomputes B·A and ||W0 + s·B·A|| at every forward unless told to keep them (in eval mode, per
    # adapter): the same values, computed once per module instead of once per token.
    caching, dora.ENABLE_DORA_CACHING = dora.ENABLE_DORA_CACHING, True
    try:
        return requests, [reference_tokens(model, prompt, adapter) for prompt, adapter in requests]
    finally:
        dora.ENABLE_DORA_CACHING = caching


def test_dora_adapters_in_a_mixed_batch_match_peft(smollm2, peft_model, requests_and_expected) -> None:
    _, dirs = peft_model
    requests, expected = requests_and_expected
    engine = LLMEngine(
        EngineConfig(device="cpu", dtype="float32", num_pages=200, max_num_seqs=16, max_batch_tokens=512),
        loaded=smollm2,
    )
    for name, directory in dirs.items():
        engine.register_adapter(name, Path(directory))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    ids = [engine.add_request(prompt, params, adapter=adapter) for prompt, adapter in requests]
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = (out.token_ids, out.error)
    for request_id, want, (_, adapter) in zip(ids, expected, requests, strict=True):
        assert finished[request_id][0] == want, (adapter, finished[request_id], want)

    # The scales the pool holds are what the test is about: g moves channels by up to 30%, plain LoRA
    # adapters hold none.
    pool = engine.loader.pool_rows
    for name in DORA:
        scales = engine.loader.resident[name].d_rows
        assert scales, name
        h = torch.cat([reference.gather_rows(pool, rows).flatten() for rows in scales.values()])
        assert h.abs().max() > 0.1, name
    assert not engine.loader.resident["lora-qkv-r8"].d_rows


def test_dora_scale_matches_peft_weight_norm(smollm2, peft_model) -> None:
    """g - 1 in the pool is PEFT's own mag_norm_scale - 1 for a module, in float32."""
    model, dirs = peft_model
    engine = LLMEngine(EngineConfig(device="cpu", dtype="float32", num_pages=64), loaded=smollm2)
    engine.register_adapter("d", Path(dirs["dora-all-r16"]))
    engine.warm_adapter("d")
    layer = model.base_model.model.model.layers[3].self_attn.k_proj
    weight = layer.base_layer.weight
    lora_weight = layer.lora_B["dora-all-r16"].weight @ layer.lora_A["dora-all-r16"].weight
    norm = layer.lora_magnitude_vector["dora-all-r16"].get_weight_norm(
        weight, lora_weight, layer.scaling["dora-all-r16"]
    )
    g = layer.lora_magnitude_vector["dora-all-r16"].weight / norm
    rows = engine.loader.resident["d"].d_rows["qkv"][3]  # q 576 | k 192 | v 192
    h = reference.gather_rows(engine.loader.pool_rows, rows)[576 : 576 + 192]
    torch.testing.assert_close(h, (g - 1).detach(), rtol=1e-5, atol=1e-6)


def test_loraplex_generate_answers_with_a_dora_adapter(smollm2, peft_model, requests_and_expected) -> None:
    """`loraplex generate --adapter` with a DoRA adapter prints PEFT's greedy completion."""
    _, dirs = peft_model
    requests, expected = requests_and_expected
    index = list(ADAPTERS).index("dora-all-r16")
    prompt = PROMPTS[index % len(PROMPTS)]
    assert requests[index][0] == smollm2.tokenizer.encode(prompt)
    result = subprocess.run(
        [str(Path(sys.executable).parent / "loraplex"), "generate", "--prompt", prompt, "--dtype", "float32",
         "--device", "cpu", "--max-tokens", str(NEW_TOKENS), "--adapter", str(dirs["dora-all-r16"])],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "2"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    want = smollm2.tokenizer.decode(expected[index])
    assert result.stdout == want + ("" if want.endswith("\n") else "\n")  # the CLI ends the line


def test_server_answers_with_dora_and_plain_adapters_at_once(
    engine_factory, smollm2, peft_model, requests_and_expected
) -> None:
    """The engine server, DoRA and plain LoRA adapters and the base model asked together (one batch):
    each /v1/completions answer is PEFT's greedy completion."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.engine.server.conftest import BASE, INTERNAL, TOKEN, running_server

    _, dirs = peft_model
    requests, expected = requests_and_expected
    adapters = [f"{name}={directory}" for name, directory in dirs.items()]
    with running_server(engine_factory, internal_token=TOKEN, adapters=adapters) as server:

        def complete(index: int) -> str:
            adapter = requests[index][1]
            body = {
                "model": adapter or BASE,
                "prompt": PROMPTS[index % len(PROMPTS)],
                "max_tokens": NEW_TOKENS,
                "temperature": 0,
            }
            response = httpx.post(f"{server.url}/v1/completions", json=body, headers=INTERNAL, timeout=300)
            assert response.status_code == 200, response.text
            return str(response.json()["choices"][0]["text"])

        with ThreadPoolExecutor(len(requests)) as pool:
            texts = list(pool.map(complete, range(len(requests))))
    for index, text in enumerate(texts):
        assert text == smollm2.tokenizer.decode(expected[index]), requests[index][1]
