"""What a request asks of generation; validated once, when it is made, against the shared limits."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from loraplex.wire import limits

from .structured_output import StructuredOutput

# Where the engine's range differs from the wire's: top_k -1 (no limit) is mapped to 0 before a
# SamplingParams is made.
_TOP_K = limits.Range(0, limits.MAX_TOP_K, integer=True)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 means no limit
    top_p: float = 1.0
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None: none; k: the sampled token's log-probability and the k most likely
    # Penalties (engine/penalties.py has their math): OpenAI's presence and frequency over the output's
    # tokens, HF's repetition penalty over prompt and output (1: none), and a bias per token id.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    # Structured outputs: the output follows this JSON schema (engine/grammar.py masks the tokens that
    # would break it), made by StructuredOutput.of, which bounds it. None: free text.
    structured: StructuredOutput | None = None
    # Speculative decoding (when the engine runs it): at most this many draft tokens per step for this
    # request, 0 turns it off; None: the engine's num_speculative_tokens. Greedy outputs are the same
    # either way; sampled ones follow the same distribution.
    num_speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        """Every number in the range of wire/limits.py (the bounds the HTTP API checks first), so
        no caller of the offline API hands the sampler a value it would overflow on: a LimitExceeded
        (a ValueError) naming the field otherwise. The engine checks top_k and logprobs against its
        vocabulary when the request is added."""
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        limits.check_stop(list(self.stop))
        if any(not s for s in self.stop):
            raise limits.LimitExceeded("stop", "stop strings must not be empty")
        limits.check_stop_token_ids(tuple(self.stop_token_ids))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        limits.check_number("max_tokens", self.max_tokens)
        limits.check_number("temperature", self.temperature)
        limits.check_number("top_k", self.top_k, _TOP_K)
        limits.check_number("top_p", self.top_p)
        limits.check_number("min_p", self.min_p)
        limits.check_number("seed", self.seed)
        limits.check_number("logprobs", self.logprobs, limits.LOGPROBS)
        limits.check_number("presence_penalty", self.presence_penalty)
        limits.check_number("frequency_penalty", self.frequency_penalty)
        limits.check_number("repetition_penalty", self.repetition_penalty)
        limits.check_number("num_speculative_tokens", self.num_speculative_tokens)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise limits.LimitExceeded("logit_bias", "logit_bias must map token ids to numbers")
            limits.check_logit_bias(self.logit_bias)
            # A copy with integer keys (OpenAI's JSON keys are strings), so no caller changes it later.
            bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            object.__setattr__(self, "logit_bias", bias or None)
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise limits.LimitExceeded("response_format", "structured must be a StructuredOutput")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether the sampler changes this request's logits before choosing (a row that is not pays
        nothing for the others that are)."""
        penalties = self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        return bool(penalties or self.logit_bias)
