"""Real PEFT adapters on a tiny random Llama, made once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.adapters import BaseShape

TINY = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
TINY_SHAPE = BaseShape(num_layers=2, hidden_size=64, intermediate_size=96, q_size=64, kv_size=32)

# name -> PEFT LoraConfig arguments
VARIANTS = {
    "qv-r8": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "all-linear-patterns": {
        "r": 8,
        "lora_alpha": 8,
        "target_modules": "all-linear",
        "use_rslora": True,
        "rank_pattern": {"down_proj": 4, "model.layers.1.self_attn.q_proj": 16},
        "alpha_pattern": {"gate_proj": 32},
    },
    "layer1-only": {
        "r": 2,
        "lora_alpha": 4,
        "target_modules": ["k_proj", "o_proj"],
        "layers_to_transform": [1],
    },
    "regex": {"r": 1, "lora_alpha": 1, "target_modules": r".*\.(up_proj|k_proj)"},
    "full-names": {"r": 4, "lora_alpha": 8, "target_modules": ["model.layers.0.mlp.down_proj"]},
}


def make_peft_adapter(directory: Path, seed: int = 0, **lora_args):  # type: ignore[no-untyped-def]
    """Save a PEFT LoRA for the tiny Llama with random (non-zero) A and B; returns the PEFT model."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    base = LlamaForCausalLM(LlamaConfig(**TINY))
    model = get_peft_model(base, LoraConfig(**lora_args))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.1)
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="session")
def peft_adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object]]:
    root = tmp_path_factory.mktemp("peft")
    return {
        name: (root / name, make_peft_adapter(root / name, seed=i, **args))
        for i, (name, args) in enumerate(VARIANTS.items())
    }
