"""What the CPU computes natively, read once: decides whether dtype=auto means bfloat16 on the CPU.

No torch at import (engine/config.py imports this and the CLI must not wait for torch).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

# Instruction sets with bfloat16 dot products: AMX tiles (Sapphire Rapids on) or AVX512-BF16 (Cooper Lake,
# Zen 4 on). Without one, torch emulates bfloat16 matmuls through float32 conversions and is slower.
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The `flags` of /proc/cpuinfo (empty where there is none, e.g. macOS)."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.is_file() else ""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def native_bf16_flags(cpuinfo: str | None = None) -> tuple[str, ...]:
    """The bfloat16 instruction sets this CPU has, of NATIVE_BF16_FLAGS (empty: none)."""
    flags = cpu_flags(cpuinfo)
    return tuple(f for f in NATIVE_BF16_FLAGS if f in flags)


@cache
def cpu_auto_dtype() -> tuple[str, str]:
    """(dtype name, why) for dtype=auto on the CPU: bfloat16 where computed natively, else float32."""
    native = native_bf16_flags()
    if native:
        return "bfloat16", f"the CPU computes bfloat16 natively ({', '.join(native)})"
    return "float32", f"the CPU has none of {', '.join(NATIVE_BF16_FLAGS)}, so bfloat16 would be emulated"
