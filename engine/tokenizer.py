"""Tokenizer and chat template, from a tokenizer.json or from a GGUF file's embedded vocabulary."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

# GGUF token types (llama.cpp): 3 marks control tokens such as <|im_start|>, 4 user-defined ones.
_CONTROL, _USER_DEFINED = 3, 4

# How each llama.cpp pre-tokenizer splits text before byte-level BPE; `None` is GPT-2's own regex.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS: dict[str, str | None] = {
    "gpt2": None,
    "default": None,
    "llama3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}


class TokenizerError(ValueError):
    """A tokenizer that cannot be built from what the model ships."""


@dataclass
class Tokenizer:
    backend: BackendTokenizer
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos_token: bool = False
    chat_template: str | None = None
    eos_token_ids: tuple[int, ...] = field(default=())

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.backend.token_to_id(self.bos_token)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self.backend.encode(text, add_special_tokens=False).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text for a conversation, rendered with the model's own template (`tools`: OpenAI's
        tool objects, for a template with a tools section; others never read them)."""
        if not self.chat_template:
            raise TokenizerError("this model has no chat template; send a plain prompt instead of messages")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise TokenizerError(f"message {i} must be an object with 'role' and 'content'")
        template = _template_environment().from_string(self.chat_template)
        return template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            tools=list(tools) if tools else None,
        )

    def encode_chat(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> list[int]:
        # The template writes any BOS itself, so none is added again (as Hugging Face does).
        return self.encode(
            self.apply_chat_template(messages, add_generation_prompt, tools), add_special_tokens=False
        )

    @classmethod
    def from_directory(cls, directory: str | Path) -> Tokenizer:
        """tokenizer.json, with tokenizer_config.json for the special tokens and chat template."""
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"no tokenizer.json in {directory}")
        backend = BackendTokenizer.from_file(str(path))
        config: dict[str, Any] = {}
        config_path = directory / "tokenizer_config.json"
        if config_path.is_file():
            config = json.loads(config_path.read_text())
        template = config.get("chat_template")
        template_file = directory / "chat_template.jinja"
        if template_file.is_file():
            template = template_file.read_text()
        if isinstance(template, list):  # a list of named templates: take the default
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return cls(
            backend=backend,
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            add_bos_token=bool(config.get("add_bos_token", False)),
            chat_template=template,
        )

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any]) -> Tokenizer:
        """Byte-level BPE from `tokenizer.ggml.*` (tokens, merges, token types, pre-tokenizer)."""
        kind = metadata.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise TokenizerError(
                f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2'); "
                "give a Hugging Face directory with tokenizer.json instead"
            )
        tokens: list[str] = metadata["tokenizer.ggml.tokens"]
        merges: list[str] = metadata.get("tokenizer.ggml.merges") or []
        if not merges:
            raise TokenizerError("GGUF byte-level tokenizer has no tokenizer.ggml.merges")
        types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        vocab = {_byte_level_spelling(token, alphabet): i for i, token in enumerate(tokens)}
        bpe = models.BPE(
            vocab=vocab,
            merges=[tuple(m.split(" ", 1)) for m in merges],  # type: ignore[misc]
            fuse_unk=False,
            ignore_merges=False,
        )
        backend = BackendTokenizer(bpe)
        backend.pre_tokenizer = _gguf_pre_tokenizer(str(metadata.get("tokenizer.ggml.pre", "default")))
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens(
            [
                AddedToken(t, special=True, normalized=False)
                for t, kind_ in zip(tokens, types, strict=False)
                if kind_ == _CONTROL and set(t) <= set(alphabet)
            ]
        )
        backend.add_tokens(
            [
                AddedToken(t, normalized=False)
                for t, kind_ in zip(tokens, types, strict=False)
                if kind_ == _USER_DEFINED
            ]
        )

        def token_at(key: str) -> str | None:
            index = metadata.get(key)
            return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None

        eos = token_at("tokenizer.ggml.eos_token_id")
        eos_ids = tuple(
            dict.fromkeys(
                int(i)
                for i in (
                    metadata.get("tokenizer.ggml.eos_token_id"),
                    metadata.get("tokenizer.ggml.eot_token_id"),
                )
                if i is not None
            )
        )
        return cls(
            backend=backend,
            bos_token=token_at("tokenizer.ggml.bos_token_id"),
            eos_token=eos,
            add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=metadata.get("tokenizer.chat_template"),
            eos_token_ids=eos_ids,
        )


def _gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre == "smollm":
        # SmolLM's own tokenizer.json: every digit on its own, then GPT-2's byte-level split.
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    if pre not in _PRE_TOKENIZER_SPLITS:
        raise TokenizerError(
            f"GGUF pre-tokenizer {pre!r} is not supported; "
            f"known: {', '.join(sorted([*_PRE_TOKENIZER_SPLITS, 'smollm']))}"
        )
    split = _PRE_TOKENIZER_SPLITS[pre]
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _byte_level_spelling(token: str, alphabet: list[str]) -> str:
    # Vocabularies are stored in the byte alphabet already; a token outside it is spelled out byte by byte.
    if set(token) <= set(alphabet):
        return token
    table = {b: c for b, c in zip(range(256), _bytes_to_unicode(), strict=True)}
    return "".join(table[b] for b in token.encode("utf-8"))


def _bytes_to_unicode() -> list[str]:
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    )
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    raise TokenizerError(f"chat template refused the conversation: {message}")


def _template_environment() -> jinja2.Environment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    return env
