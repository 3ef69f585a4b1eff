"""`loraplex tokenizer export DIR`: the engine's tokenizer as a Hugging Face directory that
transformers' AutoTokenizer loads as it is and that tokenizes, decodes and renders the chat template
exactly as the engine does."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from loraplex.cli.main import main
from loraplex.engine.tokenizer import Tokenizer
from loraplex.engine.tokenizer_export import FILES, export_tokenizer

LORAPLEX = str(Path(sys.executable).parent / "loraplex")

TEXTS = [
    "Hello, world!",
    "",
    " ",
    "  leading and trailing spaces  ",
    "tabs\tand\r\nWindows and\nUnix new lines\n\n\n",
    "Digits 0123456789, 3.14159 and 1,000,000",
    "Ünïcödé: naïve café, 日本語のテキスト, 한국어, Ελληνικά, עברית, Русский текст",
    "emoji 🚀🔥👩‍👩‍👧 and flags 🇫🇷 and combining e\u0301",
    "code: def f(x):\n    return x ** 2  # comment",
    "<|im_start|>user\nspecial tokens written as text<|im_end|>\n<|endoftext|>",
    "punctuation!!! ... ??? --- ''' \"\"\" `backticks`",
    "a" * 500,
]
CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse. Réponds en français. 🇫🇷"},
        {"role": "user", "content": "Capitale de l'Allemagne ?"},
        {"role": "assistant", "content": "Berlin."},
        {"role": "user", "content": "Et du Japon ? 日本"},
    ],
]


@pytest.fixture(scope="module")
def exported(smollm2: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Any]:
    """The bundled model's tokenizer exported by the CLI, loaded back by transformers."""
    directory = tmp_path_factory.mktemp("tokenizer") / "smollm2"
    assert main(["tokenizer", "export", str(directory)]) == 0
    assert sorted(p.name for p in directory.iterdir()) == sorted(FILES)
    return smollm2.tokenizer, AutoTokenizer.from_pretrained(directory)


@pytest.mark.parametrize("text", TEXTS)
def test_texts_tokenize_and_decode_as_the_engine_does(exported: tuple[Tokenizer, Any], text: str) -> None:
    engine, hf = exported
    for special in (True, False):
        ids = engine.encode(text, add_special_tokens=special)
        assert hf.encode(text, add_special_tokens=special) == ids
        assert hf.decode(ids) == engine.decode(ids, skip_special_tokens=False) == text
        assert hf.decode(ids, skip_special_tokens=True) == engine.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_the_chat_template_renders_as_the_engine_does(
    exported: tuple[Tokenizer, Any], messages: list[dict[str, str]]
) -> None:
    engine, hf = exported
    for generation in (True, False):
        text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
        assert text == engine.apply_chat_template(messages, add_generation_prompt=generation)
        ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation)
        ids = ids["input_ids"] if not isinstance(ids, list) else ids
        assert ids == engine.encode_chat(messages, add_generation_prompt=generation)


def test_special_tokens_vocabulary_and_context(exported: tuple[Tokenizer, Any]) -> None:
    engine, hf = exported
    assert hf.bos_token == engine.bos_token and hf.eos_token == engine.eos_token
    assert hf.eos_token_id == engine.eos_token_ids[0] and hf.pad_token == hf.eos_token
    assert len(hf) == engine.vocab_size == 49152
    assert hf.model_max_length == 8192  # llama.context_length of the GGUF
    batch = hf(["short", "a longer text"], padding=True)  # what a batching client does
    assert len(batch["input_ids"][0]) == len(batch["input_ids"][1])


def test_a_model_that_adds_bos_gets_it_from_transformers_too(smollm2: Any, tmp_path: Path) -> None:
    engine = dataclasses.replace(smollm2.tokenizer, add_bos_token=True)
    hf = AutoTokenizer.from_pretrained(export_tokenizer(engine, tmp_path / "bos", 2048))
    for text in TEXTS[:6]:
        ids = engine.encode(text)
        assert ids[0] == engine.bos_token_id
        assert hf.encode(text) == ids
        assert hf.encode(text, add_special_tokens=False) == engine.encode(text, add_special_tokens=False)
    config = json.loads((tmp_path / "bos" / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is True and config["model_max_length"] == 2048


def test_the_command_writes_over_an_old_export_and_reports_a_bad_model(tmp_path: Path) -> None:
    target = tmp_path / "out"
    target.mkdir()
    (target / "tokenizer.json").write_text("stale")
    done = subprocess.run(
        [LORAPLEX, "tokenizer", "export", str(target)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(target)
    assert json.loads((target / "tokenizer.json").read_text())["model"]["type"] == "BPE"
    missing = subprocess.run(
        [LORAPLEX, "tokenizer", "export", str(tmp_path / "x"), "--model", str(tmp_path / "missing.gguf")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 2 and missing.stdout == ""
    assert "does not exist" in missing.stderr
