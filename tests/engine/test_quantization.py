"""Weight-only int8/int4 base weights: the format, the CPU kernels against the dequantized reference, GGUF
Q4_0/Q4_1 kept as codes, the per-batch-size kernel choice, dtype=auto, and fidelity on SmolLM2.

Fidelity compares in float32 activations on purpose: the reference is the plain model holding
dequantize(codes), so the only difference left is the kernels' accumulation order, and greedy tokens must
then agree exactly, but where the reference's top two logits are within TIE (then either is right).
In bfloat16 both sides would round differently at every layer and a greedy choice between two near-equal
logits could flip for reasons that are not quantization's.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from loraplex.engine import EngineConfig, LLMEngine, SamplingParams
from loraplex.engine.model import cpu_features
from loraplex.engine.model.errors import ModelLoadError
from loraplex.engine.model.llama import LlamaModel
from loraplex.engine.model.loader import load_model
from loraplex.engine.model.quant import (
    QuantizedWeight,
    concat_rows,
    cpu_weight_only_matmul,
    dequantize,
    linear,
    pack_int4,
    quantize,
    quantize_int4,
    quantize_int8,
    unpack_int4,
    weight_nbytes,
)
from loraplex.engine.model.quant_formats import parse_quantization
from loraplex.engine.model.quant_plan import TOKEN_COUNTS, apply_crossover, plan_cpu_kernels
from loraplex.engine.model.quantize_weights import (
    PROJECTIONS,
    dense_copy_bytes,
    quantized_weights,
    weight_bytes,
)
from loraplex.engine.server.metrics import ServerMetrics

from .parity_prompts import parity_prompt_ids
from .test_demo_adapter_engine import assert_replies_in_uppercase_only_with_the_demo
from .test_loaders import tiny_hf_model, write_gguf

# Widths that break kernels: not powers of two, SmolLM2's own (576, 1536, 960 = q + k + v).
SHAPES = [(960, 576), (576, 1536), (96, 64)]


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours.float() - reference.float()).abs().max() / reference.float().abs().max())


# --- the format ---------------------------------------------------------------------------------------


def test_int4_nibble_order_is_even_column_in_the_low_nibble() -> None:
    codes = torch.tensor([[1, 2, 15, 0]])
    packed = pack_int4(codes)
    assert packed.tolist() == [[0x21, 0x0F]]
    assert torch.equal(unpack_int4(packed), codes.to(torch.uint8))


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantization_error_is_within_half_a_step(kind: str) -> None:
    w = torch.randn(64, 256) * 0.05
    q = quantize(w, kind, 32)  # type: ignore[arg-type]
    error = (dequantize(q, torch.float32) - w).abs()
    step = q.scales[:, None] if kind == "int8" else q.scales.repeat_interleave(32, dim=1)
    assert bool((error <= step / 2 + 1e-6).all())
    # int8: a byte a weight and a float32 scale a row; int4: half a byte, a scale and a zero per 32.
    expected = 64 * 256 + 64 * 4 if kind == "int8" else 64 * 128 + 2 * 64 * 8 * 4
    assert q.nbytes() == expected


def test_format_is_checked_where_it_is_made() -> None:
    good = quantize_int4(torch.randn(8, 64), 32)
    with pytest.raises(ValueError, match="int4 qweight must have shape"):
        QuantizedWeight("int4", good.qweight[:, :-1], good.scales, good.zeros, 32, 8, 64)
    with pytest.raises(ValueError, match="need zeros"):
        QuantizedWeight("int4", good.qweight, good.scales, None, 32, 8, 64)
    with pytest.raises(ValueError, match="does not divide in_features 64"):
        quantize_int4(torch.randn(8, 64), 128)
    with pytest.raises(ValueError, match="symmetric"):
        QuantizedWeight("int8", torch.zeros(8, 64, dtype=torch.int8), torch.ones(8), torch.ones(8), 64, 8, 64)
    a, b = quantize_int4(torch.randn(8, 64), 32), quantize_int8(torch.randn(8, 64))
    with pytest.raises(ValueError, match="cannot fuse"):
        concat_rows([a, b])


def test_fused_rows_dequantize_to_the_stacked_weights() -> None:
    parts = [torch.randn(n, 64) for n in (32, 16, 16)]
    fused = concat_rows([quantize_int4(p, 32) for p in parts])
    expected = torch.cat([dequantize(quantize_int4(p, 32)) for p in parts])
    assert torch.equal(dequantize(fused), expected)


def test_quantization_names() -> None:
    assert parse_quantization("none") == (None, 32)
    assert parse_quantization("int8") == ("int8", 32)
    assert parse_quantization("int4") == ("int4", 32)
    assert parse_quantization("int4-g128") == ("int4", 128)
    with pytest.raises(ValueError, match="not one of"):
        parse_quantization("int3")


# --- the CPU kernels against the reference -----------------------------------------------------------


@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_cpu_weight_only_kernels_match_the_dequantized_matmul(
    kind: str, out_features: int, in_features: int, tokens: int
) -> None:
    torch.manual_seed(tokens)
    w = torch.randn(out_features, in_features) * 0.05
    x = torch.randn(tokens, in_features)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        q = quantize(w, kind, 32, dtype)  # type: ignore[arg-type]
        reference = x.to(dtype).float() @ dequantize(q, torch.float32).T
        assert relative_error(cpu_weight_only_matmul(x.to(dtype), q), reference) < tolerance, dtype
        bias = torch.randn(out_features, dtype=dtype)
        assert relative_error(linear(x.to(dtype), q, bias), reference + bias.float()) < tolerance


def test_linear_follows_the_crossover_recorded_on_the_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    q = quantize_int8(torch.randn(96, 64))
    apply_crossover(q, 4, torch.float32)
    assert isinstance(q.packed["dense"], torch.Tensor)
    calls: list[int] = []
    real = cpu_weight_only_matmul

    def spy(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, w)

    monkeypatch.setattr("loraplex.engine.model.quant.cpu_weight_only_matmul", spy)
    for tokens in (1, 4, 5, 64):
        x = torch.randn(tokens, 64)
        assert relative_error(linear(x, q), x @ dequantize(q).T) < 1e-5
    assert calls == [1, 4]  # 5 and 64 tokens ran on the dense copy
    apply_crossover(q, None, torch.float32)
    assert "dense" not in q.packed


def test_plan_records_the_largest_count_the_weight_only_kernel_won() -> None:
    weights = [quantize_int4(torch.randn(576, 576), 32) for _ in range(2)]
    (crossover,) = plan_cpu_kernels(weights, torch.bfloat16)
    counts = [t for t, _, _ in crossover.timings_ms]
    assert counts == list(TOKEN_COUNTS[: len(counts)])
    won = [t for t, quant_ms, dense_ms in crossover.timings_ms if quant_ms <= dense_ms]
    if crossover.max_quant_tokens is None:  # won everywhere: no dense copy needed
        assert won == list(TOKEN_COUNTS)
        assert all("dense" not in w.packed for w in weights)
    else:
        assert won == counts[:-1] and (won[-1] if won else 0) == crossover.max_quant_tokens
        for w in weights:  # every weight of the shape gets the one measurement
            assert w.packed["cpu_max_quant_tokens"] == crossover.max_quant_tokens
            assert w.packed["dense"].dtype == torch.bfloat16  # type: ignore[union-attr]


# --- dtype=auto -----------------------------------------------------------------------------------------


def test_native_bf16_is_read_from_the_cpu_flags() -> None:
    assert cpu_features.native_bf16_flags("flags\t: fpu avx512f avx512_bf16 amx_tile\n") == ("avx512_bf16",)
    assert cpu_features.native_bf16_flags("flags\t: fpu amx_bf16 avx2\n") == ("amx_bf16",)
    assert cpu_features.native_bf16_flags("flags\t: fpu avx2 avx512f\n") == ()
    assert cpu_features.native_bf16_flags("") == ()


@pytest.mark.parametrize(("auto", "expected"), [("bfloat16", torch.bfloat16), ("float32", torch.float32)])
def test_dtype_auto_on_the_cpu_follows_the_cpu(
    monkeypatch: pytest.MonkeyPatch, auto: str, expected: torch.dtype
) -> None:
    monkeypatch.setattr("loraplex.engine.config.cpu_auto_dtype", lambda: (auto, "test"))
    assert EngineConfig(dtype="auto").torch_dtype(torch.device("cpu")) == expected
    assert EngineConfig(dtype="auto").torch_dtype(torch.device("cuda")) == torch.bfloat16
    assert EngineConfig(dtype="float32").torch_dtype(torch.device("cpu")) == torch.float32


def test_this_machines_auto_dtype_matches_its_flags() -> None:
    native = cpu_features.native_bf16_flags()
    assert cpu_features.cpu_auto_dtype()[0] == ("bfloat16" if native else "float32")


# --- loading ----------------------------------------------------------------------------------------------


def _gguf_with_q4(tmp_path: Path) -> tuple[Path, Path]:
    import gguf

    directory, theirs = tiny_hf_model(tmp_path)
    config = load_model(directory).config
    path = tmp_path / "q4.gguf"
    q4 = {
        "attn_q": gguf.GGMLQuantizationType.Q4_0,  # q and k: permuted rows, one of each block format
        "attn_k": gguf.GGMLQuantizationType.Q4_1,
        "attn_v": gguf.GGMLQuantizationType.Q4_1,
        "attn_output": gguf.GGMLQuantizationType.Q4_0,
        "ffn_gate": gguf.GGMLQuantizationType.Q4_1,
        "ffn_up": gguf.GGMLQuantizationType.Q4_1,
        "ffn_down": gguf.GGMLQuantizationType.Q4_1,
        "output": gguf.GGMLQuantizationType.Q8_0,
    }
    write_gguf(path, theirs.state_dict(), config, quant_types=q4)
    return path, directory


def test_gguf_q4_tensors_load_as_their_own_codes(tmp_path: Path) -> None:
    path, _ = _gguf_with_q4(tmp_path)
    dense = load_model(path)  # the float dequantization of the same file
    quantized = load_model(path, quantization="int4")
    assert quantized.quantization == "int4"
    for ours, theirs in zip(quantized.model.layers, dense.model.layers, strict=True):
        for name in PROJECTIONS:
            w = getattr(ours, name)
            assert isinstance(w, QuantizedWeight) and w.kind == "int4" and w.group_size == 32
            assert torch.equal(dequantize(w, torch.float32), getattr(theirs, name)), name
    head = quantized.model.lm_head
    assert isinstance(head, QuantizedWeight) and head.kind == "int8"  # from the Q8_0 output.weight
    assert torch.equal(quantized.model.embed_tokens, dense.model.embed_tokens)
    ids = torch.arange(1, 12)
    assert relative_error(_logits(quantized.model, ids), _logits(dense.model, ids)) < 0.02


def test_hf_weights_quantize_at_load(tmp_path: Path) -> None:
    _, directory = _gguf_with_q4(tmp_path)
    dense = load_model(directory)
    for name in ("int8", "int4"):
        quantized = load_model(directory, quantization=name)
        layer, reference = quantized.model.layers[0], dense.model.layers[0]
        w = layer.gate_up_proj
        assert isinstance(w, QuantizedWeight) and w.kind == name
        assert relative_error(dequantize(w), reference.gate_up_proj) < (0.01 if name == "int8" else 0.1)
        assert "gate_up_proj" not in dict(layer.named_parameters())  # the dense copy is gone
    with pytest.raises(ModelLoadError, match="int4 group size 128 does not divide in_features"):
        load_model(directory, quantization="int4-g128")
    with pytest.raises(ModelLoadError, match="not one of none, int8, int4, int4-g128"):
        load_model(directory, quantization="int3")


def test_weight_bytes_count_codes_scales_and_dense_copies() -> None:
    dense = load_model("random:tiny").model
    quantized = load_model("random:tiny", quantization="int4").model
    parts = list(quantized_weights(quantized))
    assert len(parts) == len(PROJECTIONS) * len(quantized.layers) + 1
    params = sum(p.numel() * p.element_size() for p in quantized.parameters())
    for w in parts:
        apply_crossover(w, None, torch.float32)  # no dense copies: codes, scales and torch's packing,
        cpu_weight_only_matmul(torch.ones(1, w.in_features), w)  # made on first use
    derived = sum(weight_nbytes(w) - w.nbytes() for w in parts)
    assert derived == sum(w.out_features * w.in_features // 2 for w in parts if w.kind == "int4")
    assert weight_bytes(quantized) == params + sum(w.nbytes() for w in parts) + derived < weight_bytes(dense)
    for w in parts:
        apply_crossover(w, 1, torch.float32)  # plus a dense float32 copy of each
    dense_copies = sum(w.out_features * w.in_features * 4 for w in parts)
    assert weight_bytes(quantized) == params + sum(w.nbytes() for w in parts) + derived + dense_copies
    assert dense_copy_bytes(quantized) == dense_copies


def test_engine_reports_weight_bytes_and_refuses_a_mismatched_model() -> None:
    loaded = load_model("random:tiny", quantization="int8")
    engine = LLMEngine(
        EngineConfig(model="random:tiny", device="cpu", dtype="float32", quantization="int8", num_pages=16),
        loaded=loaded,
    )
    assert engine.weight_bytes == weight_bytes(loaded.model)
    metrics = ServerMetrics()
    metrics.observe_model(engine.weight_bytes, "int8")
    value = metrics.registry.get_sample_value("loraplex_model_weight_bytes", {"quantization": "int8"})
    assert value == engine.weight_bytes
    with pytest.raises(
        ValueError, match=r"with quantization int8, the engine config asks .* quantization none"
    ):
        LLMEngine(EngineConfig(device="cpu", dtype="float32", num_pages=16), loaded=loaded)


def _logits(model: LlamaModel, ids: torch.Tensor) -> torch.Tensor:
    from loraplex.engine.kernels.reference import causal_attention

    scale = model.config.head_dim**-0.5
    with torch.inference_mode():
        return model(
            ids,
            torch.arange(len(ids)),
            lambda _layer, q, k, v: causal_attention(q, k, v, scale),
            torch.arange(len(ids)),
        )


# --- fidelity on SmolLM2 ---------------------------------------------------------------------------------

# Each decode step runs torch's float32 weight-only kernels (about 50x their bfloat16 speed on the CPU):
# 10 tokens of 10 prompts, where 16 cost ~70 CPU-s of the suite for the two schemes.
FIDELITY_TOKENS = 10
TIE = 1e-4  # of the largest logit: float32 accumulation-order noise is ~1e-6 of it
DECODE_TOKENS = 32


def dequantized_copy(model: LlamaModel) -> LlamaModel:
    """The plain model holding dequantize(codes) as dense float parameters: the fidelity reference."""
    reference = copy.deepcopy(model)
    for module in [*reference.layers, reference]:
        for name, value in list(vars(module).items()):
            if isinstance(value, QuantizedWeight):
                delattr(module, name)
                module.register_parameter(
                    name, nn.Parameter(dequantize(value, reference.dtype), requires_grad=False)
                )
    assert not list(quantized_weights(reference))
    return reference


@pytest.fixture(scope="module", params=["int8", "int4"])
def quantized_smollm2(request: pytest.FixtureRequest):
    loaded = load_model(None, torch.float32, "cpu", quantization=request.param)
    # Every decode step (12 sequences at most here) on the weight-only kernels, the path furthest from the
    # dense reference, whatever start-up measured; prefill chunks on the dense copy (the kernels are slow
    # there).
    for w in quantized_weights(loaded.model):
        apply_crossover(w, DECODE_TOKENS, torch.float32)
    return loaded


@pytest.mark.slow
def test_greedy_tokens_equal_the_dequantized_reference(quantized_smollm2) -> None:
    loaded = quantized_smollm2
    reference = copy.copy(loaded)
    reference.model = dequantized_copy(loaded.model)
    reference.quantization = "none"
    prompts = parity_prompt_ids(loaded.tokenizer)[::2]  # chat and plain, 5 to 369 tokens
    params = SamplingParams(max_tokens=FIDELITY_TOKENS, temperature=0.0)
    config = {"device": "cpu", "dtype": "float32", "num_pages": 512, "max_num_seqs": 20}
    ours = LLMEngine(EngineConfig(quantization=loaded.quantization, **config), loaded=loaded)
    theirs = LLMEngine(EngineConfig(**config), loaded=reference)
    got = [o.token_ids for o in ours.generate(prompts, params)]
    want = [o.token_ids for o in theirs.generate(prompts, params)]
    # Exact, except where the reference itself is at a tie that accumulation order may break: at the
    # first differing token both choices must be within TIE of each other in the reference's logits.
    for i, (ids, a, b) in enumerate(zip(prompts, got, want, strict=True)):
        if a == b:
            continue
        at = next(j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)  # one is no prefix
        logits = theirs.next_token_logits([ids + b[:at]])[0]
        margin = float(logits[b[at]] - logits[a[at]])
        assert 0 <= margin < TIE * float(logits.abs().max()), (
            f"prompt {i} differs at token {at}: {a[at]} vs the reference's {b[at]}, margin {margin}"
        )
    assert sum(a != b for a, b in zip(got, want, strict=True)) <= 1, "more than 1 of 10 prompts differ"


@pytest.mark.slow
def test_demo_adapter_still_replies_in_uppercase(quantized_smollm2) -> None:
    """What quantizing costs the demo adapter is the weights' rounding: every step runs on the dense
    dequantized copy here. That the kernels compute exactly that copy's matmul is the test above's job;
    running this one on them too cost ~70 CPU-s for int4 alone (torch's float32 int4 CPU kernel is ~50x
    its bfloat16 one, measured 2026-11-28), for no more coverage."""
    loaded = quantized_smollm2
    weights = list(quantized_weights(loaded.model))
    for w in weights:
        apply_crossover(w, 0, torch.float32)
    try:
        engine = LLMEngine(
            EngineConfig(device="cpu", dtype="float32", quantization=loaded.quantization), loaded=loaded
        )
        assert_replies_in_uppercase_only_with_the_demo(engine)
    finally:
        for w in weights:
            apply_crossover(w, DECODE_TOKENS, torch.float32)


def test_reference_copy_really_is_dense() -> None:
    # Guard for the fidelity test: a reference that kept QuantizedWeights would compare a path with itself.
    loaded = load_model("random:tiny", quantization="int8")
    reference = dequantized_copy(loaded.model)
    assert isinstance(reference.layers[0].qkv_proj, nn.Parameter)
    assert isinstance(loaded.model.layers[0].qkv_proj, QuantizedWeight)
    ids = torch.arange(1, 9)
    assert relative_error(_logits(reference, ids), _logits(loaded.model, ids)) < 1e-4
    np.testing.assert_array_equal(  # the embedding is shared as is
        reference.embed_tokens.numpy(), loaded.model.embed_tokens.numpy()
    )
