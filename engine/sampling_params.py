"""What a request asks of generation; validated once, when it is made."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20


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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be between 0 and 100, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 (no limit) or positive, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:  # also refuses NaN
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
