"""A Llama-family decoder in plain torch: RMSNorm, RoPE, GQA attention, SwiGLU MLP.

The model runs on a flat batch of tokens from many sequences at once ([T, hidden]); attention is the
only part that needs to know which token belongs to which sequence, and it is handed in as a callable
(`AttentionFn`) so the model stays plain and the CPU reference or the Triton kernels plug in beside it.
Q, K and V share one matmul, as do gate and up: fewer, larger matmuls are what a CPU or GPU runs fastest.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .errors import ModelLoadError
from .rope import apply_rotary, cos_sin_table

# (layer index, q [T, heads, D], k [T, kv_heads, D], v [T, kv_heads, D]) -> [T, heads, D]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (layer index, projection group "qkv" | "o" | "gate_up" | "down", input x, output y): adds each
# token's adapter delta to y in place.
LoraFn = Callable[[int, str, torch.Tensor, torch.Tensor], None]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32 and cast back before the weight, exactly as Hugging Face's LlamaRMSNorm.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


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
        hidden: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,
        attention: AttentionFn,
        lora: LoraFn | None = None,
    ) -> torch.Tensor:
        c = self.config
        tokens = hidden.shape[0]
        x = rms_norm(hidden, self.input_norm, c.rms_norm_eps)
        qkv = F.linear(x, self.qkv_proj, self.qkv_bias)  # [T, q + 2 kv]
        if lora is not None:
            lora(index, "qkv", x, qkv)
        # q and k heads rotate together: one rotary call instead of two.
        qk = apply_rotary(
            qkv[:, : c.q_size + c.kv_size].view(tokens, c.num_heads + c.num_kv_heads, c.head_dim), cos, sin
        )
        q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
        v = qkv[:, c.q_size + c.kv_size :].view(tokens, c.num_kv_heads, c.head_dim)
        attn = attention(index, q, k, v).reshape(tokens, c.q_size)  # [T, heads * D]
        out = F.linear(attn, self.o_proj)
        if lora is not None:
            lora(index, "o", attn, out)
        hidden = hidden + out
        x = rms_norm(hidden, self.post_attention_norm, c.rms_norm_eps)
        gate_up = F.linear(x, self.gate_up_proj)  # [T, 2 I]
        if lora is not None:
            lora(index, "gate_up", x, gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate) * up
        down = F.linear(act, self.down_proj)
        if lora is not None:
            lora(index, "down", act, down)
        return hidden + down


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
        cos, sin = cos_sin_table(c, max_positions or c.max_position_embeddings, dtype, device)
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
        for index, layer in enumerate(self.layers):
            hidden = layer(index, hidden, cos, sin, attention, lora)
        return self.compute_logits(hidden[logits_indices])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = rms_norm(hidden, self.norm, self.config.rms_norm_eps)
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(hidden, head).float()

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named tensors (model.layers.0.self_attn.q_proj.weight, ...) into place.

        Every tensor is checked against the config first: a wrong shape or a missing tensor raises one
        ModelLoadError that names it.
        """
        expected = expected_shapes(self.config)
        missing = [name for name in expected if name not in weights and not _is_optional(name, self.config)]
        if missing:
            raise ModelLoadError(f"checkpoint is missing {len(missing)} tensor(s), first: {missing[0]}")
        for name, shape in expected.items():  # model order, so the first mismatch is the one reported
            if name in weights and tuple(weights[name].shape) != shape:
                raise ModelLoadError(
                    f"shape mismatch for {name}: checkpoint has {tuple(weights[name].shape)}, "
                    f"the model config expects {shape}"
                )
        with torch.no_grad():
            self.embed_tokens.copy_(weights["model.embed_tokens.weight"])
            self.norm.copy_(weights["model.norm.weight"])
            if self.lm_head is not None:
                self.lm_head.copy_(weights.get("lm_head.weight", weights["model.embed_tokens.weight"]))
            for i, module in enumerate(self.layers):
                layer = cast(DecoderLayer, module)
                p = f"model.layers.{i}."
                attn = [weights[f"{p}self_attn.{n}_proj.weight"] for n in ("q", "k", "v")]
                layer.qkv_proj.copy_(torch.cat(attn, dim=0))
                if layer.qkv_bias is not None:
                    layer.qkv_bias.copy_(torch.cat([weights[f"{p}self_attn.{n}_proj.bias"] for n in "qkv"]))
                layer.o_proj.copy_(weights[f"{p}self_attn.o_proj.weight"])
                gate_up = [weights[f"{p}mlp.{n}_proj.weight"] for n in ("gate", "up")]
                layer.gate_up_proj.copy_(torch.cat(gate_up, dim=0))
                layer.down_proj.copy_(weights[f"{p}mlp.down_proj.weight"])
                layer.input_norm.copy_(weights[f"{p}input_layernorm.weight"])
                layer.post_attention_norm.copy_(weights[f"{p}post_attention_layernorm.weight"])


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
