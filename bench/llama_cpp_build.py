"""The CMake options `make bench-deps` builds llama.cpp with: this CPU's instruction sets named one by one,
never `GGML_NATIVE` and never AMX.

`-march=native` (GGML_NATIVE=ON) turns on whatever the compiler sees, AMX included where the CPU has it. On
an Intel Xeon with AMX (2026-11-27) that build died with SIGILL in `bench quant`'s batched decode and gave
garbage on one stream: ggml's AMX path is not safe to take there. Naming each extension from the CPU's
own flags keeps the speed of AVX2/AVX512 and leaves AMX out on every host.

`python -m loraplex.bench.llama_cpp_build` prints the options for this machine (Makefile: bench-deps).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

# ggml's option → the /proc/cpuinfo flag that says the CPU runs it.
EXTENSIONS = (
    ("GGML_SSE42", "sse4_2"),
    ("GGML_AVX", "avx"),
    ("GGML_F16C", "f16c"),
    ("GGML_FMA", "fma"),
    ("GGML_BMI2", "bmi2"),
    ("GGML_AVX2", "avx2"),
    ("GGML_AVX_VNNI", "avx_vnni"),
    ("GGML_AVX512", "avx512f"),
    ("GGML_AVX512_VBMI", "avx512vbmi"),
    ("GGML_AVX512_VNNI", "avx512_vnni"),
    ("GGML_AVX512_BF16", "avx512_bf16"),
)
ALWAYS_OFF = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")
# What else the bench wants: OpenMP threads, no BLAS, no GPU backend, only the library built.
COMMON = (
    "-DGGML_NATIVE=OFF",
    "-DGGML_OPENMP=ON",
    "-DGGML_BLAS=OFF",
    "-DGGML_CUDA=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)


def cpu_flags(cpuinfo: str) -> set[str]:
    """The first processor's flags in a /proc/cpuinfo text (x86: `flags : fpu vme ...`)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def cmake_args(flags: Iterable[str]) -> list[str]:
    """Every x86 extension ggml has an option for, ON exactly where the CPU has it; AMX OFF everywhere.
    An AVX512 sub-extension without AVX512F itself stays off (ggml compiles them under -mavx512f)."""
    have = set(flags)
    on = {option for option, flag in EXTENSIONS if flag in have}
    if "GGML_AVX512" not in on:
        on -= {"GGML_AVX512_VBMI", "GGML_AVX512_VNNI", "GGML_AVX512_BF16"}
    args = list(COMMON)
    args += [f"-D{option}={'ON' if option in on else 'OFF'}" for option, _ in EXTENSIONS]
    args += [f"-D{option}=OFF" for option in ALWAYS_OFF]
    return args


def main(cpuinfo: Path = Path("/proc/cpuinfo")) -> int:
    text = cpuinfo.read_text() if cpuinfo.exists() else ""
    print(" ".join(cmake_args(cpu_flags(text))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
