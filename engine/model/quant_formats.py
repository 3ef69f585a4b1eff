"""The quantization choices, torch-free: engine/config.py builds its options (and the CLI its flags) from
these without importing torch. The format itself is defined in quant.py."""

from __future__ import annotations

# int4 groups 32 weights per scale: 32 divides every width GGUF quantizes (128 does not divide SmolLM2's
# 576) and is what Q4_0/Q4_1 use; int4-g128 is a quarter of the scales where 128 divides the widths.
QUANTIZATIONS = ("none", "int8", "int4", "int4-g128")
INT4_GROUP_SIZES = (32, 128)
DEFAULT_INT4_GROUP_SIZE = 32
# Q4_0 and Q4_1 blocks hold 32 weights: the group size of every int4 tensor read from a GGUF file.
GGUF_GROUP_SIZE = 32


def parse_quantization(name: str) -> tuple[str | None, int]:
    """(kind "int8" | "int4" | None, int4 group size) of a QUANTIZATIONS name."""
    if name not in QUANTIZATIONS:
        raise ValueError(f"quantization {name!r} is not one of {', '.join(QUANTIZATIONS)}")
    if name == "none":
        return None, DEFAULT_INT4_GROUP_SIZE
    kind, _, group = name.partition("-g")
    return kind, int(group) if group else DEFAULT_INT4_GROUP_SIZE
