"""DoRA adapters on the engine's Triton path give what they give on the torch path (the CPU stacker),
with plain LoRA adapters and base rows in the same steps, through chunked prefills (segments) and
decodes (per token). On the CPU the kernels run in Triton's interpreter (tests/conftest.py); on a GPU
natively."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

from loraplex.adapters import AdapterManifest
from loraplex.engine import EngineConfig, LLMEngine, SamplingParams
from loraplex.engine.lora.dora import served_base_weights
from loraplex.engine.lora.layout import GROUPS
from loraplex.engine.lora.sources import DoraWeights, LoraWeights
from loraplex.engine.lora.synthetic import SyntheticAdapter
from loraplex.engine.model.loader import load_model

pytestmark = pytest.mark.slow  # the interpreter runs every kernel of a few dozen steps
_GROUP_OF = {module: group for group, modules in GROUPS.items() for module in modules}


@dataclass(frozen=True)
class SyntheticDora:
    """A SyntheticAdapter made DoRA: magnitudes m = ||W0 + s·B·A|| moved by up to ±30% per channel, so
    g = m / ||W0 + s·B·A|| is what a trained DoRA adapter's is (near 1, not 1)."""

    lora: SyntheticAdapter
    model: torch.nn.Module

    @property
    def manifest(self) -> AdapterManifest:
        manifest = self.lora.manifest
        config = dataclasses.replace(manifest.config, use_dora=True)
        modules = tuple(dataclasses.replace(m, dora=True) for m in manifest.modules)
        sha = ("d" + manifest.sha256)[:64]
        return dataclasses.replace(manifest, sha256=sha, config=config, modules=modules)

    def load(self, dtype: torch.dtype) -> LoraWeights:
        weights = self.lora.load(dtype)
        base = served_base_weights(self.model)
        generator = torch.Generator().manual_seed(self.lora.seed + 100)
        magnitudes = {}
        for m in self.manifest.modules:
            group = _GROUP_OF[m.module]
            column = sum(
                self.lora.base.features(o)[1] for o in GROUPS[group][: GROUPS[group].index(m.module)]
            )
            # On the host, where the adapter's A and B are (the engine moves them to the base's device).
            w0 = base(m.layer, group)[column : column + m.out_features].float().cpu()
            a, b = (t.float() for t in weights[(m.layer, m.module)])
            norm = torch.linalg.vector_norm(w0 + m.scale * (b @ a), dim=1)
            magnitudes[(m.layer, m.module)] = norm * (
                1 + 0.3 * (2 * torch.rand(norm.shape, generator=generator) - 1)
            )
        return DoraWeights(weights, magnitudes)


def run(
    kernels: str, prompts: list[list[int]], adapters: list[str | None], dora: bool = True
) -> list[list[int]]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loaded = load_model("random:tiny", torch.float32, device, seed=3)
    engine = LLMEngine(
        EngineConfig(
            model="random:tiny", device=device, dtype="float32", num_pages=16, page_size=16,
            max_num_seqs=4, max_batch_tokens=24, kernels=kernels,
        ),
        loaded=loaded,
    )  # fmt: skip
    assert engine.runner.use_kernels == (kernels == "triton")
    base = loaded.config.lora_shape()
    strong = {"strength": 1.0}
    qv = SyntheticAdapter(base, seed=1, rank=4, targets=("q", "v"), **strong)
    all7 = SyntheticAdapter(
        base, seed=2, rank=8, targets=("q", "k", "v", "o", "gate", "up", "down"), **strong
    )
    plain = SyntheticAdapter(base, seed=3, rank=5, targets=("gate", "down"), **strong)
    engine.register_adapter("dora-qv", SyntheticDora(qv, loaded.model) if dora else qv)
    engine.register_adapter("dora-all", SyntheticDora(all7, loaded.model) if dora else all7)
    engine.register_adapter("plain", plain)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = engine.generate(prompts, params, adapters=adapters)
    assert all(o.error is None for o in outputs), [o.error for o in outputs]
    return [o.token_ids for o in outputs]


def test_dora_on_the_kernels_matches_the_torch_path() -> None:
    generator = torch.Generator().manual_seed(0)
    lengths = [3, 17, 9, 1, 12]
    prompts = [torch.randint(1, 512, (n,), generator=generator).tolist() for n in lengths]
    names: list[str | None] = ["dora-qv", "dora-all", None, "plain", "dora-all"]
    reference = run("torch", prompts, names)
    assert run("triton", prompts, names) == reference
    # the scale matters: the same adapters as plain LoRA answer otherwise (and the plain/base rows alike)
    plain = run("torch", prompts, names, dora=False)
    assert [p for p, n in zip(plain, names, strict=True) if n and n.startswith("dora")] != [
        r for r, n in zip(reference, names, strict=True) if n and n.startswith("dora")
    ]
    assert [p for p, n in zip(plain, names, strict=True) if not (n or "").startswith("dora")] == [
        r for r, n in zip(reference, names, strict=True) if not (n or "").startswith("dora")
    ]
