"""The loader's whole-tensor decoders of Q4_0, Q4_1 and Q8_0 equal the `gguf` package's, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from loraplex.engine.model.gguf_dequant import dequantize_blocks, fast_types


@pytest.mark.parametrize("kind", sorted(fast_types()))
def test_random_blocks_decode_as_gguf_decodes_them(kind: str) -> None:
    qtype = GGMLQuantizationType[kind]
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((48, 128)).astype(np.float32) * rng.uniform(0.01, 4, (48, 1)).astype(
        np.float32
    )
    raw = quantize(weights, qtype)
    want = dequantize(raw, qtype).reshape(-1)
    got = dequantize_blocks(raw, kind)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    assert np.abs(got - weights.reshape(-1)).max() < np.abs(weights).max() / 4  # it is the weights


@pytest.mark.parametrize("kind", sorted(fast_types()))
def test_arbitrary_bytes_decode_as_gguf_decodes_them(kind: str) -> None:
    # Any bit pattern, negative and large scales and offsets included (a finite fp16 everywhere).
    qtype = GGMLQuantizationType[kind]
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
    raw = np.random.default_rng(1).integers(0, 256, (16, 4 * size), dtype=np.uint8)
    scales = raw.reshape(-1, size)[:, : 4 if kind == "Q4_1" else 2]
    scales[:, 1::2] &= 0x7B  # keep exponents below fp16's inf/nan
    np.testing.assert_array_equal(dequantize_blocks(raw, kind), dequantize(raw, qtype).reshape(-1))


def test_the_default_models_tensors_load_as_gguf_decodes_them() -> None:
    from loraplex.engine.model.gguf_header import parse_gguf_header
    from loraplex.engine.model.gguf_loader import _map, _tensor_data
    from loraplex.engine.model.loader import default_model_path

    path = default_model_path()
    data = _map(path)
    header = parse_gguf_header(data, str(path))
    seen = set()
    for tensor in header.tensors:
        kind = tensor.ggml_type.name
        if kind in fast_types() and kind not in seen:  # the first tensor of each type
            seen.add(kind)
            raw = _tensor_data(data, tensor)
            want = np.asarray(dequantize(raw, tensor.ggml_type), dtype=np.float32).reshape(-1)
            np.testing.assert_array_equal(dequantize_blocks(raw, kind), want)
    assert seen == {"Q4_1", "Q8_0"}, seen
