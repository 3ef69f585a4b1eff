"""Real PEFT adapters parse to exactly the modules, ranks, scales and weights PEFT itself uses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from loraplex.adapters import MODULES, AdapterError, BaseShape, inspect_adapter
from loraplex.adapters.digest import adapter_digest
from loraplex.adapters.manifest import WEIGHTS_FILE
from loraplex.adapters.weights import load_lora_weights

from .conftest import TINY_SHAPE, VARIANTS

_SHORT = {
    "q_proj": "q",
    "k_proj": "k",
    "v_proj": "v",
    "o_proj": "o",
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
}


def peft_modules(model) -> dict[tuple[int, str], tuple[int, float, torch.Tensor, torch.Tensor]]:  # type: ignore[no-untyped-def]
    """(layer, module) -> (rank, scale, A, B) as the PEFT model holds them."""
    found = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            parts = name.split(".")
            layer = int(parts[parts.index("layers") + 1])
            found[(layer, _SHORT[parts[-1]])] = (
                module.r["default"],
                module.scaling["default"],
                module.lora_A["default"].weight.detach(),
                module.lora_B["default"].weight.detach(),
            )
    return found


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_manifest_and_weights_match_peft(peft_adapters, variant: str) -> None:
    directory, model = peft_adapters[variant]
    manifest = inspect_adapter(directory, TINY_SHAPE)
    expected = peft_modules(model)
    assert {(m.layer, m.module) for m in manifest.modules} == set(expected)
    weights = load_lora_weights(directory, manifest)
    for m in manifest.modules:
        rank, scale, a, b = expected[(m.layer, m.module)]
        assert m.rank == rank and m.scale == pytest.approx(scale)
        torch.testing.assert_close(weights[(m.layer, m.module)][0], a)
        torch.testing.assert_close(weights[(m.layer, m.module)][1], b)
    assert manifest.sha256 == adapter_digest(directory)
    assert manifest.weights_bytes == (directory / WEIGHTS_FILE).stat().st_size


def test_patterns_give_heterogeneous_ranks(peft_adapters) -> None:
    manifest = inspect_adapter(peft_adapters["all-linear-patterns"][0], TINY_SHAPE)
    ranks = {(m.layer, m.module): m.rank for m in manifest.modules}
    assert ranks[(0, "down")] == 4 and ranks[(1, "q")] == 16 and ranks[(0, "q")] == 8
    assert manifest.ranks == (4, 8, 16)
    assert len(manifest.target_modules) == 7


def copy_adapter(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(directory: Path, **changes) -> None:  # type: ignore[no-untyped-def]
    path = directory / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"use_dora": True}, "layer 0 q: lora_magnitude_vector is missing .* \\(use_dora is true\\)"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "bias 'all' is not supported"),
        ({"target_modules": ["embed_tokens"]}, "'embed_tokens' is an embedding"),
        ({"target_modules": ["fc1"]}, "'fc1' is not a supported projection"),
        ({"target_modules": []}, "target_modules is empty"),
        ({"peft_type": "PREFIX_TUNING"}, "peft_type 'PREFIX_TUNING'"),
        ({"r": 0}, "r must be a positive integer"),
        ({"rank_pattern": {"q_proj": -1}}, "rank_pattern"),
        ({"target_modules": "(unclosed"}, "target_modules: .* is not a regular expression RE2 accepts"),
    ],
)
def test_unsupported_config_is_refused_naming_the_field(
    peft_adapters, tmp_path: Path, changes, message
) -> None:  # type: ignore[no-untyped-def]
    directory = copy_adapter(peft_adapters["qv-r8"][0], tmp_path / "a")
    edit_config(directory, **changes)
    with pytest.raises(AdapterError, match=message):
        inspect_adapter(directory, TINY_SHAPE)


def test_shape_mismatch_names_layer_and_module(peft_adapters) -> None:
    other = BaseShape(num_layers=2, hidden_size=64, intermediate_size=96, q_size=64, kv_size=64)
    with pytest.raises(
        AdapterError, match=r"layer 0 v: lora_B has shape \[32, 8\], the base model needs \[64, 8\]"
    ):
        inspect_adapter(peft_adapters["qv-r8"][0], other)


def test_rank_that_disagrees_with_the_config_is_refused(peft_adapters, tmp_path: Path) -> None:
    directory = copy_adapter(peft_adapters["qv-r8"][0], tmp_path / "a")
    edit_config(directory, r=4)
    with pytest.raises(AdapterError, match=r"layer 0 q: lora_A has shape \[8, 64\].*\[4, 64\]"):
        inspect_adapter(directory, TINY_SHAPE)


def test_adapter_for_a_deeper_model_is_refused(peft_adapters) -> None:
    shallow = BaseShape(num_layers=1, hidden_size=64, intermediate_size=96, q_size=64, kv_size=32)
    with pytest.raises(AdapterError, match="layer 1 is past the base model's 1 layers"):
        inspect_adapter(peft_adapters["qv-r8"][0], shallow)


def test_missing_tensor_is_named(peft_adapters, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    directory = copy_adapter(peft_adapters["qv-r8"][0], tmp_path / "a")
    tensors = load_file(str(directory / WEIGHTS_FILE))
    del tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]
    save_file(tensors, str(directory / WEIGHTS_FILE))
    with pytest.raises(AdapterError, match="layer 1 v: lora_B is missing"):
        inspect_adapter(directory, TINY_SHAPE)


def test_pickled_weights_are_refused(peft_adapters, tmp_path: Path) -> None:
    directory = copy_adapter(peft_adapters["qv-r8"][0], tmp_path / "a")
    torch.save({"x": torch.zeros(2)}, directory / "adapter_model.bin")
    with pytest.raises(AdapterError, match=r"adapter_model\.bin is refused"):
        inspect_adapter(directory, TINY_SHAPE)
    (directory / "adapter_model.bin").unlink()
    torch.save({"x": torch.zeros(2)}, directory / WEIGHTS_FILE)  # a pickle under the safe name
    with pytest.raises(AdapterError, match="is a pickle"):
        inspect_adapter(directory, TINY_SHAPE)


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda d: (d / "adapter_config.json").unlink(), "adapter_config.json is missing"),
        (lambda d: (d / "adapter_config.json").write_text("{not json"), "not valid JSON"),
        (lambda d: (d / WEIGHTS_FILE).unlink(), "adapter_model.safetensors is missing"),
        (
            lambda d: (d / WEIGHTS_FILE).write_bytes(b'\x07\x00\x00\x00\x00\x00\x00\x00{"a": 1'),
            "header is not valid JSON",
        ),
        (lambda d: (d / WEIGHTS_FILE).write_bytes(b"\xff" * 16), "not a safetensors file"),
    ],
)
def test_damaged_directories_are_refused(peft_adapters, tmp_path: Path, damage, message) -> None:  # type: ignore[no-untyped-def]
    directory = copy_adapter(peft_adapters["qv-r8"][0], tmp_path / "a")
    damage(directory)
    with pytest.raises(AdapterError, match=message):
        inspect_adapter(directory, TINY_SHAPE)


def test_adapter_for_smollm2_fits_its_gqa_and_mlp_widths(tmp_path: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from loraplex.engine.model.config import named_shape

    shape = named_shape("smollm2-135m").lora_shape()
    assert shape.features("k") == (576, 192) and shape.features("down") == (1536, 576)
    hf_config = LlamaConfig(
        vocab_size=64, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, tie_word_embeddings=True,
    )  # fmt: skip
    with torch.device("meta"):
        base = LlamaForCausalLM(hf_config)
    model = get_peft_model(base, LoraConfig(r=8, target_modules="all-linear"))
    model.to_empty(device="cpu")
    with torch.no_grad():  # to_empty leaves whatever memory held, NaNs included: the check would refuse
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.zero_()
    model.save_pretrained(tmp_path / "smol")
    manifest = inspect_adapter(tmp_path / "smol", shape)
    assert len(manifest.modules) == 30 * 7
    assert manifest.num_parameters == 30 * 8 * sum(sum(shape.features(m)) for m in MODULES)


@pytest.fixture(scope="module")
def dora_adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A PEFT DoRA adapter (use_dora) for the tiny Llama: lora_magnitude_vector beside A and B."""
    from .conftest import make_peft_adapter

    directory = tmp_path_factory.mktemp("dora") / "dora"
    make_peft_adapter(
        directory, seed=5, r=4, lora_alpha=8, target_modules=["q_proj", "gate_proj"], use_dora=True
    )
    return directory


def test_dora_adapter_is_accepted_with_its_magnitudes(dora_adapter: Path) -> None:
    from safetensors.torch import load_file

    from loraplex.engine.lora.sources import DirectorySource, magnitudes_of

    manifest = inspect_adapter(dora_adapter, TINY_SHAPE)
    assert manifest.dora and all(m.dora for m in manifest.modules)
    assert {(m.layer, m.module) for m in manifest.modules} == {(0, "q"), (0, "gate"), (1, "q"), (1, "gate")}
    assert manifest.num_parameters == sum(
        m.rank * (m.in_features + m.out_features) + m.out_features for m in manifest.modules
    )
    tensors = load_file(str(dora_adapter / WEIGHTS_FILE))
    magnitudes = magnitudes_of(DirectorySource.open(dora_adapter, TINY_SHAPE).load(torch.bfloat16))
    for (layer, module), m in magnitudes.items():
        path = "self_attn.q_proj" if module == "q" else "mlp.gate_proj"
        saved = tensors[f"base_model.model.model.layers.{layer}.{path}.lora_magnitude_vector"]
        assert m.dtype == torch.float32 and torch.equal(m, saved)  # float32 whatever A and B are read in


def test_dora_magnitudes_are_checked(dora_adapter: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    name = "base_model.model.model.layers.1.mlp.gate_proj.lora_magnitude_vector"
    plain = copy_adapter(dora_adapter, tmp_path / "plain")
    edit_config(plain, use_dora=False)
    with pytest.raises(
        AdapterError, match=r"is a DoRA magnitude vector, but adapter_config\.json does not set"
    ):
        inspect_adapter(plain, TINY_SHAPE)

    def rewritten(directory: Path, edit) -> Path:  # type: ignore[no-untyped-def]
        tensors = load_file(str(directory / WEIGHTS_FILE))
        edit(tensors)
        save_file(tensors, str(directory / WEIGHTS_FILE))
        return directory

    older = rewritten(
        copy_adapter(dora_adapter, tmp_path / "older"), lambda t: t.update({f"{name}.weight": t.pop(name)})
    )
    assert inspect_adapter(older, TINY_SHAPE).dora  # PEFT before 0.12 saved it with .weight
    both = rewritten(
        copy_adapter(older, tmp_path / "both"), lambda t: t.update({name: t[f"{name}.weight"] * 2})
    )
    with pytest.raises(AdapterError, match="are both layer 1 gate lora_magnitude_vector"):
        inspect_adapter(both, TINY_SHAPE)
    short = rewritten(copy_adapter(dora_adapter, tmp_path / "short"), lambda t: t.update({name: t[name][:5]}))
    with pytest.raises(
        AdapterError, match=r"layer 1 gate: lora_magnitude_vector has shape \[5\], .* needs \[96\]"
    ):
        inspect_adapter(short, TINY_SHAPE)
    missing = rewritten(copy_adapter(dora_adapter, tmp_path / "missing"), lambda t: t.pop(name))
    with pytest.raises(AdapterError, match=r"layer 1 gate: lora_magnitude_vector is missing"):
        inspect_adapter(missing, TINY_SHAPE)
