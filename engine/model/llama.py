"""A Llama-family decoder in plain torch: RMSNorm, RoPE, GQA attention, SwiGLU MLP.

The model runs on a flat batch of tokens from many sequences at once ([T, hidden]); attention is the
only part that needs to know which token belongs to which sequence, and it is handed in as a callable
(`AttentionFn`) so the model stays plain and the CPU reference or the Triton kernels plug in beside it.
Q, K and V share one matmul, as do gate and up: fewer, larger matmuls are what a CPU or GPU runs fastest.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.reference import apply_rotary
from .config import ModelConfig
from .errors import ModelLoadError
from .layer_ops import REFERENCE_OPS, LayerOps, ops_of
from .limits import DEFAULT_MAX_POSITIONS, MAX_CONTEXT_LENGTH
from .quant import QuantizedWeight, Weight, concat_rows, linear
from .rope import cos_sin_table

# (layer index, q [T, heads, D], k [T, kv_heads, D], v [T, kv_heads, D]) -> [T, heads, D]. An attention
# with a `layer_ops` attribute (layer_ops.py) also picks the norm/activation kernels, and when they say
# `rotary_in_attention` it is called as a RotaryAttentionFn instead.
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RotaryAttentionFn(Protocol):
    """Attention that rotates q and k itself (in place) by rope = (cos, sin) [T, 1, D] as it stores k, v."""

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor: ...


# (layer index, projection group "qkv" | "o" | "gate_up" | "down", input x, output y): adds each
# token's adapter delta to y in place.
LoraFn = Callable[[int, str, torch.Tensor, torch.Tensor], None]


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        c = config
        self.config = c
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.input_norm = nn.Parameter(torch.ones(c.hidden_size, **kw), requires_grad=False)
        self.post_attention_norm = nn.Parameter(torch.ones(c.hidden_size, **kw), requires_grad=False)
        self.qkv_proj = nn.Parameter(
            torch.empty(c.q_size + 2 * c.kv_size, c.hidden_size, **kw), requires_grad=False
        )
        self.qkv_bias = (
            nn.Parameter(torch.zeros(c.q_size + 2 * c.kv_size, **kw), requires_grad=False)
            if c.attention_bias
            else None
        )
        self.o_proj = nn.Parameter(torch.empty(c.hidden_size, c.q_size, **kw), requires_grad=False)
        self.gate_up_proj = nn.Parameter(
            torch.empty(2 * c.intermediate_size, c.hidden_size, **kw), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(c.hidden_size, c.intermediate_size, **kw), requires_grad=False
        )

    def forward(
        self,
        index: int,
        hidden: torch.Tensor,  # [T, hidden]: the residual stream
        delta: torch.Tensor | None,  # [T, hidden]: the previous layer's output, not yet added
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,
        attention: AttentionFn,
        lora: LoraFn | None = None,
        ops: LayerOps = REFERENCE_OPS,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream, this layer's output still to add). The adds are left to the next norm,
        which fuses them on the kernel path (the same two ops as before on the torch path)."""
        c = self.config
        tokens = hidden.shape[0]
        if delta is None:
            x = ops.rms_norm(hidden, self.input_norm, c.rms_norm_eps)
        else:
            hidden, x = ops.add_rms_norm(hidden, delta, self.input_norm, c.rms_norm_eps)
        qkv = linear(x, self.qkv_proj, self.qkv_bias)  # [T, q + 2 kv]
        if lora is not None:
            lora(index, "qkv", x, qkv)
        qk = qkv[:, : c.q_size + c.kv_size].view(tokens, c.num_heads + c.num_kv_heads, c.head_dim)
        v = qkv[:, c.q_size + c.kv_size :].view(tokens, c.num_kv_heads, c.head_dim)
        if ops.rotary_in_attention:
            q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
            attn = cast(RotaryAttentionFn, attention)(index, q, k, v, rope=(cos, sin))
        else:
            qk = apply_rotary(qk, cos, sin)  # q and k heads rotate together: one call instead of two
            attn = attention(index, qk[:, : c.num_heads], qk[:, c.num_heads :], v)
        attn = attn.reshape(tokens, c.q_size)  # [T, heads * D]
        out = linear(attn, self.o_proj)
        if lora is not None:
            lora(index, "o", attn, out)
        hidden, x = ops.add_rms_norm(hidden, out, self.post_attention_norm, c.rms_norm_eps)
        gate_up = linear(x, self.gate_up_proj)  # [T, 2 I]
        if lora is not None:
            lora(index, "gate_up", x, gate_up)
        act = ops.silu_mul(gate_up)  # [T, I]
        down = linear(act, self.down_proj)
        if lora is not None:
            lora(index, "down", act, down)
        return hidden, down


class LlamaModel(nn.Module):
    """Weights and forward pass; knows nothing of pages, requests or sampling."""

    rope_cos: torch.Tensor  # [max_positions, head_dim]
    rope_sin: torch.Tensor

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        max_positions: int | None = None,
    ):
        super().__init__()
        c = config
        self.config = c
        self.dtype = dtype
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.embed_tokens = nn.Parameter(torch.empty(c.vocab_size, c.hidden_size, **kw), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(c, dtype, device) for _ in range(c.num_layers))
        self.norm = nn.Parameter(torch.ones(c.hidden_size, **kw), requires_grad=False)
        self.lm_head = (
            None
            if c.tie_word_embeddings
            else nn.Parameter(torch.empty(c.vocab_size, c.hidden_size, **kw), requires_grad=False)
        )
        cos, sin = cos_sin_table(c, rotary_positions(c, max_positions), dtype, device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        attention: AttentionFn,
        logits_indices: torch.Tensor,  # [S]: the tokens whose next-token logits are wanted
        lora: LoraFn | None = None,
    ) -> torch.Tensor:
        """Float32 logits [S, vocab] for the selected tokens."""
        hidden = F.embedding(input_ids, self.embed_tokens)  # [T, hidden]
        cos = self.rope_cos[positions].unsqueeze(1)  # [T, 1, D]
        sin = self.rope_sin[positions].unsqueeze(1)
        ops = ops_of(attention)
        delta = None
        for index, layer in enumerate(self.layers):
            hidden, delta = layer(index, hidden, delta, cos, sin, attention, lora, ops)
        if delta is not None:
            hidden = hidden + delta
        return self.compute_logits(hidden[logits_indices], ops)

    def compute_logits(self, hidden: torch.Tensor, ops: LayerOps = REFERENCE_OPS) -> torch.Tensor:
        hidden = ops.rms_norm(hidden, self.norm, self.config.rms_norm_eps)
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return linear(hidden, head).float()

    def load_weights(self, weights: Mapping[str, Weight]) -> None:
        """Copy Hugging Face-named tensors (model.layers.0.self_attn.q_proj.weight, ...) into place.

        Every tensor is checked against the config first: a wrong shape or a missing tensor raises one
        ModelLoadError that names it. A QuantizedWeight (quant.py) replaces its projection's parameter;
        a quantized lm_head of a tied model sits beside the dense embedding, which lookups need as rows.
        """
        check_shapes(self.config, {name: tuple(weight.shape) for name, weight in weights.items()})
        with torch.no_grad():
            _set_weight(self, "embed_tokens", [weights["model.embed_tokens.weight"]])
            _set_weight(self, "norm", [weights["model.norm.weight"]])
            head = weights.get("lm_head.weight")
            if self.lm_head is not None or isinstance(head, QuantizedWeight):
                _set_weight(
                    self, "lm_head", [head if head is not None else weights["model.embed_tokens.weight"]]
                )
            for i, module in enumerate(self.layers):
                layer = cast(DecoderLayer, module)
                p = f"model.layers.{i}."
                attn = [weights[f"{p}self_attn.{n}_proj.weight"] for n in ("q", "k", "v")]
                _set_weight(layer, "qkv_proj", attn)
                if layer.qkv_bias is not None:
                    _set_weight(layer, "qkv_bias", [weights[f"{p}self_attn.{n}_proj.bias"] for n in "qkv"])
                _set_weight(layer, "o_proj", [weights[f"{p}self_attn.o_proj.weight"]])
                gate_up = [weights[f"{p}mlp.{n}_proj.weight"] for n in ("gate", "up")]
                _set_weight(layer, "gate_up_proj", gate_up)
                _set_weight(layer, "down_proj", [weights[f"{p}mlp.down_proj.weight"]])
                _set_weight(layer, "input_norm", [weights[f"{p}input_layernorm.weight"]])
                _set_weight(layer, "post_attention_norm", [weights[f"{p}post_attention_layernorm.weight"]])


def _set_weight(module: nn.Module, name: str, parts: list[Weight]) -> None:
    """Copy dense parts (concatenated by rows) into the parameter, or put the fused quantized weight in
    its place (the dense parameter is dropped: quantizing is for the memory it saves)."""
    if all(isinstance(part, torch.Tensor) for part in parts):
        dense = [cast(torch.Tensor, part) for part in parts]
        getattr(module, name).copy_(dense[0] if len(dense) == 1 else torch.cat(dense, dim=0))
        return
    if not all(isinstance(part, QuantizedWeight) for part in parts):
        raise ModelLoadError(f"{name}: its parts mix dense and quantized tensors; quantize them alike")
    module._parameters.pop(name, None)
    setattr(module, name, concat_rows([cast(QuantizedWeight, part) for part in parts]))


def rotary_positions(config: ModelConfig, max_positions: int | None) -> int:
    """Rows of the rotary tables: the positions the engine will serve (its max_model_len), else the
    model's context length up to DEFAULT_MAX_POSITIONS; never what a file claims unbounded (a GGUF's
    context_length of 2**27 made 2 GiB of tables)."""
    if max_positions is None:
        return min(config.max_position_embeddings, DEFAULT_MAX_POSITIONS)
    if not 0 < max_positions <= MAX_CONTEXT_LENGTH:
        raise ModelLoadError(f"max_model_len must be from 1 to {MAX_CONTEXT_LENGTH}, got {max_positions}")
    return max_positions


def check_shapes(
    config: ModelConfig, shapes: Mapping[str, tuple[int, ...]], layers_field: str = "num_layers"
) -> None:
    """Refuse a checkpoint whose tensors (Hugging Face names -> shapes) do not fit `config`: more layers
    declared (`layers_field`, as the file names it) than it holds tensors for, a missing tensor, a wrong
    shape. Called on the shapes alone, before the model or any weight is allocated."""
    held = {int(m.group(1)) for name in shapes if (m := _LAYER_NAME.match(name))}
    if config.num_layers > len(held):
        raise ModelLoadError(
            f"{layers_field} is {config.num_layers}, but the checkpoint holds tensors for {len(held)} layers"
        )
    expected = expected_shapes(config)
    missing = [name for name in expected if name not in shapes and not _is_optional(name, config)]
    if missing:
        raise ModelLoadError(f"checkpoint is missing {len(missing)} tensor(s), first: {missing[0]}")
    for name, shape in expected.items():  # model order, so the first mismatch is the one reported
        if name in shapes and tuple(shapes[name]) != shape:
            raise ModelLoadError(
                f"shape mismatch for {name}: checkpoint has {tuple(shapes[name])}, "
                f"the model config expects {shape}"
            )


# A layer index as checkpoints write it (at most six digits, no leading zeros): counted, never int()'d long.
_LAYER_NAME = re.compile(r"model\.layers\.(0|[1-9][0-9]{0,5})\.")


def _is_optional(name: str, config: ModelConfig) -> bool:
    return name == "lm_head.weight" and config.tie_word_embeddings


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names of a Llama checkpoint and the shape each must have."""
    c = config
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
        "model.norm.weight": (c.hidden_size,),
        "lm_head.weight": (c.vocab_size, c.hidden_size),
    }
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes[f"{p}self_attn.q_proj.weight"] = (c.q_size, c.hidden_size)
        shapes[f"{p}self_attn.k_proj.weight"] = (c.kv_size, c.hidden_size)
        shapes[f"{p}self_attn.v_proj.weight"] = (c.kv_size, c.hidden_size)
        shapes[f"{p}self_attn.o_proj.weight"] = (c.hidden_size, c.q_size)
        shapes[f"{p}mlp.gate_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[f"{p}mlp.up_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[f"{p}mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
        shapes[f"{p}input_layernorm.weight"] = (c.hidden_size,)
        shapes[f"{p}post_attention_layernorm.weight"] = (c.hidden_size,)
        if c.attention_bias:
            shapes[f"{p}self_attn.q_proj.bias"] = (c.q_size,)
            shapes[f"{p}self_attn.k_proj.bias"] = (c.kv_size,)
            shapes[f"{p}self_attn.v_proj.bias"] = (c.kv_size,)
    return shapes
