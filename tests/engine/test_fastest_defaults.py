"""`loraplex serve` and `up` default to the fastest setting the CPU supports; EngineConfig stays exact."""

from __future__ import annotations

from pathlib import Path

from loraplex.engine.config import EngineConfig
from loraplex.engine.model.loader import auto_quantization, default_model_path
from loraplex.engine.server.settings import ServerSettings


def test_serve_defaults_to_int4_and_the_compiled_decode_step_and_the_engine_to_neither() -> None:
    served = ServerSettings().engine_config()
    assert (served.quantization, served.compile_decode) == ("auto", True)
    plain = EngineConfig()
    assert (plain.quantization, plain.compile_decode) == ("none", False)
    exact = ServerSettings(dtype="float32", quantization="none", compile_decode=False).engine_config()
    assert (exact.dtype, exact.quantization, exact.compile_decode) == ("float32", "none", False)


def test_auto_quantization_keeps_a_q4_gguf_as_int4_on_the_cpu_only(tmp_path: Path) -> None:
    assert auto_quantization(None, "cpu")[0] == "int4"  # the bundled SmolLM2 is Q4_1
    assert auto_quantization(default_model_path(), "cpu")[0] == "int4"
    assert auto_quantization(None, "cuda")[0] == "none"
    assert auto_quantization("random:tiny", "cpu")[0] == "none"
    assert auto_quantization(tmp_path, "cpu")[0] == "none"  # no GGUF there
