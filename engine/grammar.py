"""Structured outputs: JSON schemas compiled into grammars (xgrammar) and their token masks.

xgrammar was chosen over llguidance by `python -m loraplex.bench grammar` (docs/benchmarks.md): its mask
for SmolLM2's 49k-token vocabulary costs a few µs per token where llguidance's costs tens.

A request with `SamplingParams.structured` gets a `Grammar` when it is added (engine.py): a matcher over
one compiled grammar, shared by every request with the same schema through `GrammarCache` (keyed by the
schema's digest, least recently used dropped). Its state is a function of the request's output tokens and
nothing else: the scheduler's stop check advances it with each token as it lands on the host
(engine/stopping.py), never a pending one, so a step rolled back or a request preempted and recomputed
leaves it right. The sampler asks it for the next token's mask (`mask_rows`), read-only.

**Semantics** of the mask, for a grammar row i: x[i, v] = -inf unless token v may come next in the
grammar (the end-of-sequence tokens once the JSON is complete). Rows without a grammar are not touched.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from loraplex.wire.limits import LimitExceeded

from .structured_output import StructuredOutput

if TYPE_CHECKING:
    from .request import Request
    from .tokenizer import Tokenizer

# Compiled grammars kept (each holds its token mask cache: tens of KiB to a few MiB for large schemas).
CACHE_SIZE = 64
# JSON's separators: no free whitespace, which a small model could otherwise emit until max_tokens.
SEPARATORS = (", ", ": ")
_LOCATION = re.compile(r"^\[[^\]]*\] \S+:\d+: ")  # xgrammar's "[time] file.cc:123: " prefix


class Grammar:
    """One request's place in its grammar."""

    def __init__(self, matcher: Any):
        self.matcher = matcher  # xgrammar.GrammarMatcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the next token's allowed set into row `row` of a host int32 bitmask [R, ceil(V / 32)]."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance by a landed token; False if the grammar does not allow it (it is then unchanged)."""
        return bool(self.matcher.accept_token(token))

    @property
    def complete(self) -> bool:
        """The output is complete: the grammar ended (an end-of-sequence token was accepted after it)."""
        return bool(self.matcher.is_terminated())


class GrammarCache:
    """Compiles schemas for one tokenizer, keeping the last CACHE_SIZE compiled grammars by digest. The
    tokenizer's grammar tables are built on the first schema (a second or so), not at engine start."""

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int], size: int = CACHE_SIZE
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.size = size
        self.compiled: OrderedDict[str, Any] = OrderedDict()
        self._compiler: Any = None
        self.compilations = 0  # schemas compiled (not found in the cache): for tests and stats
        # The server compiles on a worker thread (prepare) while the engine's loop reads the cache.
        self._lock = threading.Lock()

    def grammar(self, spec: StructuredOutput) -> Grammar:
        """A fresh matcher for `spec`; LimitExceeded naming spec.param if its schema cannot compile."""
        import xgrammar as xgr

        return Grammar(xgr.GrammarMatcher(self._compiled(spec), override_stop_tokens=self.eos_token_ids))

    def prepare(self, spec: StructuredOutput) -> None:
        """Compile `spec` into the cache (LimitExceeded naming spec.param if it cannot compile). The server
        calls this on a worker thread before a request reaches the engine's loop: a new schema takes from
        milliseconds to seconds to compile, and on the loop that would stall every running request."""
        self._compiled(spec)

    def _compiled(self, spec: StructuredOutput) -> Any:
        key = spec.digest
        with self._lock:
            found = self.compiled.get(key)
            if found is not None:
                self.compiled.move_to_end(key)
                return found
        try:
            found = self.compiler().compile_json_schema(
                spec.schema, any_whitespace=False, separators=SEPARATORS, strict_mode=spec.strict
            )
        except RuntimeError as error:  # xgrammar's every refusal of a schema
            reason = _LOCATION.sub("", str(error).strip())
            raise LimitExceeded(spec.param, f"{spec.param} cannot be used as a grammar: {reason}") from None
        with self._lock:
            self.compilations += 1
            self.compiled[key] = found
            if len(self.compiled) > self.size:
                self.compiled.popitem(last=False)
        return found

    def compiler(self) -> Any:
        with self._lock:  # built once, by whichever thread asks first
            if self._compiler is None:
                self._compiler = self._build_compiler()
            return self._compiler

    def _build_compiler(self) -> Any:
        import xgrammar as xgr
        from tokenizers import Tokenizer as BackendTokenizer
        from transformers import PreTrainedTokenizerFast

        backend = BackendTokenizer.from_str(self.tokenizer.backend.to_str())  # a copy: the engine's stays
        info = xgr.TokenizerInfo.from_huggingface(
            PreTrainedTokenizerFast(tokenizer_object=backend),
            vocab_size=self.vocab_size,
            stop_token_ids=self.eos_token_ids,
        )
        return xgr.GrammarCompiler(info, max_threads=2)


def mask_rows(logits: torch.Tensor, requests: Sequence[Request], rows: list[int]) -> torch.Tensor:
    """Logits [S, V] with each grammar row's disallowed tokens at -inf (a new tensor; the other rows keep
    their bits). The masks are filled on the host ([G, ceil(V / 32)] int32, one bit per token), copied
    once and unpacked on the logits' device."""
    vocab = logits.shape[-1]
    words = -(-vocab // 32)
    bitmask = torch.empty(len(rows), words, dtype=torch.int32, pin_memory=logits.device.type == "cuda")
    for j, i in enumerate(rows):
        grammar = requests[i].sampling.grammar
        assert grammar is not None
        grammar.fill(bitmask, j)
    device_mask = bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = (
        ((device_mask[:, :, None] >> shifts) & 1).view(len(rows), words * 32)[:, :vocab].bool()
    )  # [G, V]
    index = torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)
    masked = logits.index_select(0, index).float().masked_fill(~allowed, float("-inf"))
    return logits.float().index_copy(0, index, masked)


__all__ = ["CACHE_SIZE", "Grammar", "GrammarCache", "mask_rows"]
