"""The llama.cpp build options `make bench-deps` uses: this CPU's extensions by name, AMX never."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from loraplex.bench.llama_cpp_build import cmake_args, cpu_flags

# /proc/cpuinfo flags (abridged) of the two hosts the bench has met.
XEON_WITH_AMX = (
    "fpu sse4_2 avx f16c fma bmi2 avx2 avx_vnni avx512f avx512vbmi avx512_vnni avx512_bf16 "
    "amx_bf16 amx_tile amx_int8"
)
EPYC_AVX2 = "fpu sse4_2 avx f16c fma bmi2 avx2"


def options(args: list[str]) -> dict[str, str]:
    return dict(a.removeprefix("-D").split("=", 1) for a in args)


def test_a_xeon_with_amx_gets_avx512_and_no_amx() -> None:
    got = options(cmake_args(XEON_WITH_AMX.split()))
    assert got["GGML_NATIVE"] == "OFF"  # -march=native would enable AMX: the SIGILL of issue 30
    assert got["GGML_AVX512"] == got["GGML_AVX512_VNNI"] == got["GGML_AVX512_BF16"] == "ON"
    assert got["GGML_AVX2"] == got["GGML_AVX_VNNI"] == "ON"
    assert got["GGML_AMX_TILE"] == got["GGML_AMX_INT8"] == got["GGML_AMX_BF16"] == "OFF"


def test_an_avx2_host_gets_no_avx512() -> None:
    got = options(cmake_args(EPYC_AVX2.split()))
    assert got["GGML_AVX2"] == got["GGML_FMA"] == got["GGML_F16C"] == got["GGML_BMI2"] == "ON"
    assert got["GGML_AVX512"] == got["GGML_AVX512_BF16"] == got["GGML_AVX_VNNI"] == "OFF"


def test_avx512_sub_extensions_need_avx512f() -> None:
    got = options(cmake_args(["avx2", "avx512_bf16", "avx512_vnni"]))
    assert got["GGML_AVX512"] == got["GGML_AVX512_BF16"] == got["GGML_AVX512_VNNI"] == "OFF"


def test_flags_are_read_from_the_first_processor() -> None:
    text = "processor\t: 0\nflags\t\t: fpu avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu\n"
    assert cpu_flags(text) == {"fpu", "avx2", "fma"}
    assert cpu_flags("no flags here") == set()


def test_the_module_prints_this_machines_options(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"flags : {EPYC_AVX2}\n")
    code = (
        "from pathlib import Path; from loraplex.bench.llama_cpp_build import main; "
        f"main(Path({str(cpuinfo)!r}))"
    )
    printed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert options(printed.split()) == options(cmake_args(EPYC_AVX2.split()))
