"""The seven projections a LoRA adapter may target, and their sizes in a given base model.

Plain Python: the control plane validates uploads with it and carries no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

# Short name -> the Hugging Face module path inside a decoder layer.
MODULE_PATHS: dict[str, str] = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
MODULES = tuple(MODULE_PATHS)


@dataclass(frozen=True)
class BaseShape:
    """What a LoRA adapter must fit: layer count and every projection's (in, out) features."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    q_size: int  # heads * head_dim
    kv_size: int  # kv_heads * head_dim (smaller than q_size under GQA)

    def features(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a projection by short name."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q": (h, self.q_size),
            "k": (h, self.kv_size),
            "v": (h, self.kv_size),
            "o": (self.q_size, h),
            "gate": (h, i),
            "up": (h, i),
            "down": (i, h),
        }[module]


def module_name(layer: int, module: str) -> str:
    """The module's name as PEFT sees it inside the base model (what target and rank patterns match)."""
    return f"model.layers.{layer}.{MODULE_PATHS[module]}"
