"""The multi-LoRA benchmark's quick mode on a tiny random Llama: it runs end to end, every request is
served in full, and its figures are sane (adapters change outputs, large adapter sets load adapters)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from loraplex.bench import lora

TINY: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Llama saved as a HF directory: both the engine and transformers load it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(directory)
    return directory


def quick_args(model: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    lora.add_arguments(parser)
    return parser.parse_args(["--quick", "--model", str(model), *extra])


def test_quick_mode_serves_everything_with_sane_figures(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = lora.run_benchmarks(quick_args(tiny_model))
    size = lora.QUICK
    expected_runs = {"a:engine", "a:transformers", "b:base", "b:lora"}
    expected_runs |= {f"c:{size['adapters_scale']}", f"c:{size['adapters_small']}"}
    assert set(report.runs) == expected_runs
    for name, run in report.runs.items():
        assert len(run.outputs) == size["requests"], name
        assert all(len(out) == size["max_tokens"] for out in run.outputs), name
        assert run.seconds > 0 and run.tokens_per_second > 0, name
    # Distinct adapters must change what the model says, or (b) compared the base model with itself.
    assert lora.same_outputs(report.runs["b:base"], report.runs["b:lora"]) < size["requests"]
    # Every request in (b) has its own adapter: each was loaded into the pool.
    assert report.runs["b:lora"].stats["adapter_loads"] == size["requests"]
    assert report.runs["b:base"].stats["adapter_loads"] == 0
    many = report.runs[f"c:{size['adapters_scale']}"].stats
    assert many["adapter_loads"] == many["distinct_adapters"] > 1
    assert many["host_hits"] + many["host_waits"] + many["host_misses"] == many["adapter_loads"]
    assert [f.part for f in report.findings] == ["(a)", "(b)", "(c)"]
    table = capsys.readouterr().out
    assert "| part | comparison |" in table and table.count("| (") == 3
    assert "q_proj, k_proj, v_proj, o_proj" in table


def test_parts_can_be_chosen(tiny_model: Path) -> None:
    report = lora.run_benchmarks(quick_args(tiny_model, "--parts", "b", "--requests", "3"))
    assert set(report.runs) == {"b:base", "b:lora"}
    assert report.runs["b:lora"].stats["adapter_loads"] == 3


def test_zipf_popularity_favours_the_first_adapters() -> None:
    import random

    picks = lora.zipf_choices(1000, 5000, random.Random(0))
    assert picks.count(0) > picks.count(1) > picks.count(9) and len(set(picks)) > 100
    assert lora.scale_ranks(10, 0) == lora.scale_ranks(1000, 0)[:10]
    assert set(lora.scale_ranks(1000, 0)) == set(lora.SCALE_RANKS)
