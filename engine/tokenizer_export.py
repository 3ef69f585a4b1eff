"""The engine's tokenizer as a Hugging Face tokenizer directory (`loraplex tokenizer export DIR`).

Benchmark clients (guidellm, inference-perf) and token counters load a tokenizer with
`transformers.AutoTokenizer.from_pretrained(DIR)`; a GGUF model ships its vocabulary inside the file, so
they cannot. This writes what they read: tokenizer.json (the same `tokenizers` object the engine encodes
with, so every id is the engine's), tokenizer_config.json (special tokens, chat template, context length)
and special_tokens_map.json.

Only the tokenizer is read from the model: a GGUF's header (no tensor is dequantized), or a Hugging Face
directory's tokenizer files.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import processors

from .model.errors import ModelLoadError
from .tokenizer import Tokenizer

FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def load_tokenizer(source: str | Path | None = None) -> tuple[Tokenizer, int | None]:
    """The tokenizer of the model at `source` (None: the default SmolLM2), as the engine builds it, and
    the model's context length when it says (None otherwise)."""
    from .model.gguf_header import parse_gguf_header
    from .model.loader import default_model_path
    from .model.sources import fetch_model

    path = Path(fetch_model(str(source))).expanduser() if source is not None else default_model_path()
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").is_file() and len(ggufs) == 1:
            path = ggufs[0]
        elif not (path / "tokenizer.json").is_file():
            raise ModelLoadError(f"{path} has no tokenizer.json to export")
        else:
            return _built(path, lambda: Tokenizer.from_directory(path)), _hf_context(path)
    if path.suffix != ".gguf" or not path.is_file():
        raise ModelLoadError(f"{path}: expected a .gguf file or a Hugging Face model directory")
    try:
        data = np.memmap(path, mode="r")
    except (OSError, ValueError) as exc:  # ValueError: an empty file cannot be mapped
        raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from None
    metadata = parse_gguf_header(data, str(path)).metadata  # the header only: no tensor is read
    context = metadata.get(f"{metadata.get('general.architecture')}.context_length")
    return _built(path, lambda: Tokenizer.from_gguf_metadata(metadata)), _positive_int(context)


def _built(path: Path, build: Callable[[], Tokenizer]) -> Tokenizer:
    """What the tokenizers library raises on a model's tokenizer fields, as a ModelLoadError (as the
    engine's loader reports it)."""
    try:
        return build()
    except ModelLoadError:
        raise
    except Exception as exc:
        reason = " ".join(str(exc).split())[:300]
        raise ModelLoadError(f"{path}: cannot build its tokenizer ({type(exc).__name__}: {reason})") from None


def export_tokenizer(
    tokenizer: Tokenizer, directory: str | Path, model_max_length: int | None = None
) -> Path:
    """Write `tokenizer` into `directory` (made if missing; the three FILES replaced) and return it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    backend = BackendTokenizer.from_str(tokenizer.backend.to_str())  # a copy: the engine's stays as it is
    bos, bos_id = tokenizer.bos_token, tokenizer.bos_token_id
    if tokenizer.add_bos_token and bos is not None and bos_id is not None:
        # The engine puts BOS in front of a text itself (Tokenizer.encode); Hugging Face does it through
        # the post-processor, applied when add_special_tokens is true.
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    specials = _special_tokens(tokenizer)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "add_bos_token": tokenizer.add_bos_token,
        "add_eos_token": False,
        # The engine decodes exactly what the tokens spell: no spaces taken out around punctuation.
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length or 1_000_000_000_000_000_019_884_624_838_656,
    }
    if tokenizer.chat_template:
        config["chat_template"] = tokenizer.chat_template
    backend.save(str(directory / "tokenizer.json"))
    _write(directory / "tokenizer_config.json", config)
    _write(directory / "special_tokens_map.json", specials)
    return directory


def _special_tokens(tokenizer: Tokenizer) -> dict[str, str]:
    """bos and eos as Hugging Face names them, and pad as eos (a byte-level BPE model has no pad token of
    its own; clients that batch need one)."""
    specials = {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token}
    if tokenizer.eos_token is not None:
        specials["pad_token"] = tokenizer.eos_token
    return {name: token for name, token in specials.items() if token is not None}


def _write(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def _hf_context(directory: Path) -> int | None:
    config = directory / "config.json"
    if not config.is_file():
        return None
    try:
        return _positive_int(json.loads(config.read_text()).get("max_position_embeddings"))
    except (ValueError, AttributeError):
        return None


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
