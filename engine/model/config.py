"""Model shape and rotary settings shared by the loaders, the model and the KV cache."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from loraplex.adapters.shapes import BaseShape


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency scaling (`rope_type: llama3` in a Hugging Face config)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.low_freq_factor <= 0 or self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"rope scaling needs factor > 0 and high_freq_factor > low_freq_factor > 0, got {self}"
            )


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has biases on q, k and v
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = field(default=(2,))
    name: str = "llama"

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // max(self.num_heads, 1))
        positive = {
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "vocab_size": self.vocab_size,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
        }
        for key, value in positive.items():
            if value <= 0:
                raise ValueError(f"model config {key} must be positive, got {value}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def lora_shape(self) -> BaseShape:
        """What a LoRA adapter for this model must fit (the adapters package checks against it)."""
        return BaseShape(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            q_size=self.q_size,
            kv_size=self.kv_size,
        )

    def num_parameters(self) -> int:
        per_layer = (
            self.hidden_size * (self.q_size + 2 * self.kv_size)
            + self.q_size * self.hidden_size
            + 3 * self.hidden_size * self.intermediate_size
            + 2 * self.hidden_size
        )
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + self.hidden_size


# Shapes for random-weight models (tests and benchmarks). Numbers follow the public configs.
NAMED_SHAPES: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        name="tiny",
        hidden_size=64,
        intermediate_size=160,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=512,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
    "smollm2-135m": ModelConfig(
        name="smollm2-135m",
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        vocab_size=49152,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
    ),
    "smollm2-360m": ModelConfig(
        name="smollm2-360m",
        hidden_size=960,
        intermediate_size=2560,
        num_layers=32,
        num_heads=15,
        num_kv_heads=5,
        vocab_size=49152,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
    ),
    "llama-7b": ModelConfig(
        name="llama-7b",
        hidden_size=4096,
        intermediate_size=11008,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    "llama-13b": ModelConfig(
        name="llama-13b",
        hidden_size=5120,
        intermediate_size=13824,
        num_layers=40,
        num_heads=40,
        num_kv_heads=40,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    "llama3-8b": ModelConfig(
        name="llama3-8b",
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192),
        bos_token_id=128000,
        eos_token_ids=(128001, 128009),
    ),
    "mistral-7b": ModelConfig(
        name="mistral-7b",
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        vocab_size=32000,
        max_position_embeddings=32768,
    ),
}


def named_shape(name: str) -> ModelConfig:
    """The config of a named shape, or a ValueError listing the known names."""
    try:
        return replace(NAMED_SHAPES[name])
    except KeyError:
        raise ValueError(
            f"unknown model shape {name!r}; known shapes: {', '.join(sorted(NAMED_SHAPES))}"
        ) from None
