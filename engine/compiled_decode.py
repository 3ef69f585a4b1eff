"""The CPU decode step compiled by torch.compile (Inductor's C++ backend): a transform around the model.

A decode layer on the CPU in eager torch is a few hundred small ops (norms, rotary, the paged gather,
softmax, LoRA), each paying Python and dispatcher time far above its arithmetic; compiled, each layer is
a handful of fused C++ loops beside the weight matmuls. What is compiled is one decoder layer as a pure
function of tensors (`decode_layer`): every layer of the model has the same shapes, so the one graph
serves all of them (torch's "regional compilation"), and compiling it takes seconds, not the minutes a
whole unrolled model would. The model itself stays plain (model/llama.py): this module reads its weights.

Which steps: graph-ready decode-only steps (engine/batch.py's DecodeBuckets pads them to batch-size
buckets). The runner sends every other step (prefill, mixed, speculative verify, prompt scoring, a
batch larger than the largest bucket, a DoRA adapter in the batch) to the eager model, and so does a
step that would need a new compile once warm-up has passed (`fail_on_recompile`): compiling happens at
warm-up only, never on a request's path.

Shapes: the batch size, the context width (pages of the step's longest decode) and the LoRA stacks'
adapter count and rank are dynamic dimensions (one graph each for a batch of one and of more: torch
specializes sizes 0 and 1), so the graphs compiled at warm-up serve every bucket, context and adapter
set. Per batch size only the weights' kernel may differ: a quantized weight runs torch's weight-only
kernel up to its measured crossover and its dense copy beyond (model/quant_plan.py), as eager does.

Attention: the decode token attends to its cached context, gathered by block table from the pool
(positions before its own), and to its own new key and value directly; the step's new keys and values
of every layer are written to the pool in one scatter after the last layer, so the compiled layer
mutates nothing. LoRA: each row's adapter matrices are gathered per row from the adapter set's stacks
(engine/lora/step.py's, plus one zero adapter that rows without an adapter point at) and applied as two
small reductions that Inductor fuses with the gather.

Inductor caches compiled graphs on disk (its FX graph cache, TORCHINDUCTOR_CACHE_DIR; `cache_dir`
below), so a second start loads them instead of compiling.

Calling: a step calls the layer once per layer (30 for SmolLM2-135M), and torch.compile's entry (its
Python wrapper, the frame hook, the guards, the bytecode that unpacks the arguments) costs ~50 us a call
at one stream, ~1.5 ms a step. So warm-up records each graph Inductor compiles (`_Entries`, the backend)
with the arguments of the call that compiled it, and from them a direct entry: the compiled graph and
the paths of its inputs in decode_layer's arguments. Warm steps call that entry; its key (batch of one or
more, the weight kernels, LoRA or none) is what tells warm-up's graphs apart, the other dimensions being
dynamic. Warm-up checks each direct entry against torch.compile's on a second layer (the same outputs,
bit for bit) and keeps torch.compile's entry for a key whose check fails or whose graph it did not see.
"""

from __future__ import annotations

import logging
import os
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from .batch import StepBatch
from .kernels import reference
from .lora.layout import GROUPS
from .model.llama import DecoderLayer, LlamaModel
from .model.quant import QuantizedWeight, cpu_int4_packing, dequantize

if TYPE_CHECKING:
    from torch.fx import GraphModule

log = logging.getLogger(__name__)

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# A LoRA group's stacks always hold at least this many adapters (the set's and zero ones) and ranks:
# torch specializes a dimension of size 0 or 1, and one graph should serve every set.
_MIN_STACK = 2


def default_cache_dir() -> Path:
    """Where Inductor keeps compiled graphs: TORCHINDUCTOR_CACHE_DIR, else ~/.cache/loraplex/inductor."""
    configured = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "loraplex" / "inductor"


# -- the compiled function ---------------------------------------------------------------------------


def _linear(kind: str, weight: tuple[torch.Tensor, ...], x: torch.Tensor) -> torch.Tensor:
    """x @ W.T for a weight as `layer_weights` packs it: ("dense", (w,)), ("int8", (codes, scales)) or
    ("int4:<group size>", (torch's packed codes, scales_and_zeros))."""
    if kind == "dense":
        return F.linear(x, weight[0])
    if kind == "int8":
        return torch.ops.aten._weight_int8pack_mm(x, weight[0], weight[1])
    group_size = int(kind.split(":")[1])
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight[0], group_size, weight[1])


def _lora(
    x: torch.Tensor, y: torch.Tensor, stacks: tuple[torch.Tensor, ...] | None, layer: torch.Tensor
) -> torch.Tensor:
    """y + each row's adapter delta. stacks = (a [L, G, in, R] A^T, b [L, G, R, out] scaled B^T, the
    row's adapter [T] in 0..G-1): computed in the stacks' dtype, rounded once into y's."""
    if stacks is None:
        return y
    a, b, rows = stacks
    adapters = a.shape[1]
    index = layer * adapters + rows  # [T] into the stacks seen as [L * G, ...]
    a_rows = a.flatten(0, 1)[index]  # [T, in, R]
    b_rows = b.flatten(0, 1)[index]  # [T, R, out]
    shrunk = (x.to(a.dtype)[:, :, None] * a_rows).sum(1)  # [T, R]
    delta = (shrunk[:, :, None] * b_rows).sum(1)  # [T, out]
    return y + delta.to(y.dtype)


def paged_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    memory: torch.Tensor,
    layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One decode token per row attending to its cached context and to its own new key and value.

    Shapes: q [B, heads, D]; k, v [B, kv_heads, D] (not in the pool yet); memory the pool [N, layers, 2,
    kv_heads, P, D]; layer a 0-d int64 tensor; block_tables [B, W] int64 (entries past a row's context
    may be any page: masked); context_lens [B] int64, the row's own token included.
    Semantics: out[b, h] = softmax(q[b, h] · [K_b[g, :n-1]; k[b, g]]^T * scale) [V_b[g, :n-1]; v[b, g]],
    g = h // (heads / kv_heads), n = context_lens[b]: reference.paged_decode_attention's, with the
    row's own key and value taken from k, v rather than read back from the pool.
    """
    batch, heads, dim = q.shape
    _, layers, _, kv_heads, page_size, _ = memory.shape
    width = block_tables.shape[1]
    pages = memory.flatten(0, 1)[block_tables * layers + layer]  # [B, W, 2, kv_heads, P, D]
    cached = pages.permute(2, 0, 3, 1, 4, 5).reshape(2, batch, kv_heads, width * page_size, dim)
    keys = torch.cat([cached[0], k[:, :, None]], dim=2)  # [B, kv_heads, S + 1, D]
    values = torch.cat([cached[1], v[:, :, None]], dim=2)
    query = q.view(batch, kv_heads, heads // kv_heads, dim).float()  # [B, kv_heads, G, D]
    # Products and sums, not matmuls: Inductor fuses them with the gather into one loop, where a batched
    # matmul of these small shapes is an external call that costs more than its arithmetic.
    scores = (query[:, :, :, None, :] * keys[:, :, None].float()).sum(-1) * scale  # [B, kv_heads, G, S+1]
    position = torch.arange(width * page_size + 1, device=q.device)
    visible = (position[None, :] < context_lens[:, None] - 1) | (position[None, :] == width * page_size)
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1)
    out = (probs[..., None] * values[:, :, None].float()).sum(-2)  # [B, kv_heads, G, D]
    return out.to(q.dtype).reshape(batch, heads, dim)


def decode_layer(
    kinds: tuple[str, str, str, str],
    weights: tuple[Any, ...],
    lora: tuple[tuple[torch.Tensor, ...] | None, ...],
    hidden: torch.Tensor,
    delta: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    memory: torch.Tensor,
    layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    shape: tuple[int, int, int, float, float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decoder layer of a decode step, as DecoderLayer.forward computes it (same reference ops):
    (residual stream, this layer's output still to add, the rows' new keys, values [B, kv_heads, D]).
    `weights`: (input norm, post-attention norm, qkv, o, gate_up, down) as `layer_weights` packs them;
    `lora`: per group of GROUPS, its stacks (see _lora) or None; `shape`: (heads, kv_heads, head_dim,
    rms_norm_eps, attention scale). `delta` of the first layer is zeros."""
    heads, kv_heads, dim, eps, scale = shape
    input_norm, post_norm, qkv_w, o_w, gate_up_w, down_w = weights
    lora_qkv, lora_o, lora_gate_up, lora_down = lora
    tokens = hidden.shape[0]
    hidden, x = reference.add_rms_norm(hidden, delta, input_norm, eps)
    qkv = _lora(x, _linear(kinds[0], qkv_w, x), lora_qkv, layer)  # [B, q + 2 kv]
    qk = qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    qk = reference.apply_rotary(qk, cos, sin)
    q, k = qk[:, :heads], qk[:, heads:]
    attn = paged_decode_attention(q, k, v, memory, layer, block_tables, context_lens, scale)
    attn = attn.reshape(tokens, heads * dim)
    out = _lora(attn, _linear(kinds[1], o_w, attn), lora_o, layer)
    hidden, x = reference.add_rms_norm(hidden, out, post_norm, eps)
    gate_up = _lora(x, _linear(kinds[2], gate_up_w, x), lora_gate_up, layer)
    act = reference.silu_mul(gate_up)
    down = _lora(act, _linear(kinds[3], down_w, act), lora_down, layer)
    return hidden, down, k, v


# -- weights and LoRA stacks as the compiled layer takes them -------------------------------------------


def pack_weight(
    w: torch.Tensor | QuantizedWeight, tokens: int, dtype: torch.dtype
) -> tuple[str, tuple[Any, ...]]:
    """A projection's weight for `_linear` at a batch of `tokens` rows: the kernel eager's `linear`
    would run there (quant.py's `_quantized_matmul`: weight-only up to the measured crossover)."""
    if isinstance(w, torch.Tensor):
        return "dense", (w,)
    limit = w.packed.get("cpu_max_quant_tokens")
    if isinstance(limit, int) and tokens > limit:
        dense = w.packed.get("dense")
        if not (isinstance(dense, torch.Tensor) and dense.dtype == dtype):
            dense = w.packed["dense"] = dequantize(w, dtype)
        return "dense", (dense,)
    if w.kind == "int8":
        scales = w.scales if w.scales.dtype == dtype else w.scales.to(dtype)
        return "int8", (w.qweight, scales)
    packed, scales_and_zeros = cpu_int4_packing(w, dtype)
    return f"int4:{w.group_size}", (packed, scales_and_zeros)


@dataclass(frozen=True)
class LayerWeights:
    kinds: tuple[str, str, str, str]
    tensors: tuple[Any, ...]  # decode_layer's `weights`


def layer_weights(layer: DecoderLayer, tokens: int, dtype: torch.dtype) -> LayerWeights:
    if layer.qkv_bias is not None:
        raise ValueError("the compiled decode step does not take attention biases (Qwen2)")
    packed = [pack_weight(getattr(layer, name), tokens, dtype) for name in PROJECTIONS]
    kinds = tuple(kind for kind, _ in packed)
    tensors = (layer.input_norm, layer.post_attention_norm, *(t for _, t in packed))
    return LayerWeights(kinds, tensors)  # type: ignore[arg-type]


@dataclass
class LoraStacks:
    """One adapter set's stacks for the compiled layer: per group, A^T and B^T with zero adapters
    appended (rows with no adapter, or whose adapter does not adapt the group, point at the first), and
    the map from a row's slot (+1; slot -1: none) to its index in the group's stack."""

    groups: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # group -> (a, b, slot_to_index)

    def rows(self, decode_slots: torch.Tensor) -> tuple[tuple[torch.Tensor, ...] | None, ...]:
        """decode_layer's `lora` for a step whose rows have these slots ([B] int32, -1: none)."""
        slots = decode_slots.long() + 1
        out: list[tuple[torch.Tensor, ...] | None] = []
        for group in GROUPS:
            a, b, slot_to_index = self.groups[group]
            out.append((a, b, slot_to_index[slots]))
        return tuple(out)


def make_stacks(
    stacks: dict[str, Any],
    num_slots: int,
    widths: dict[str, tuple[int, int]],
    layers: int,
    dtype: torch.dtype,
) -> LoraStacks:
    """LoraStacks from a set's engine/lora/step.py Stacks (group -> Stack with slots, a [L, G, in, R],
    b [L, G, R, out]); a group none of the set adapts gets zero stacks, so every step has one shape of
    work (widths: group -> (in, out))."""
    groups = {}
    for group in GROUPS:
        stack = stacks.get(group)
        if stack is None:
            inner, outer = widths[group]
            a = torch.zeros(layers, _MIN_STACK, inner, _MIN_STACK, dtype=dtype)
            b = torch.zeros(layers, _MIN_STACK, _MIN_STACK, outer, dtype=dtype)
            slot_to_index = torch.zeros(num_slots + 1, dtype=torch.int64)
        else:
            count = len(stack.slots)
            zeros = max(1, _MIN_STACK - count)
            a = torch.cat([stack.a, stack.a.new_zeros(layers, zeros, *stack.a.shape[2:])], dim=1)
            b = torch.cat([stack.b, stack.b.new_zeros(layers, zeros, *stack.b.shape[2:])], dim=1)
            slot_to_index = torch.full((num_slots + 1,), count, dtype=torch.int64)
            slot_to_index[torch.tensor(stack.slots) + 1] = torch.arange(count)
        groups[group] = (a, b, slot_to_index)
    return LoraStacks(groups)


# -- the step ----------------------------------------------------------------------------------------


class NotCompiled(RuntimeError):
    """The step would need a graph warm-up did not compile: the runner runs it eagerly instead."""


class CompiledDecode:
    """The model's decode step with its layers compiled; `run` takes a graph-ready decode batch."""

    def __init__(self, model: LlamaModel, memory: torch.Tensor, page_size: int):
        if model.device.type != "cpu":
            raise ValueError("the compiled decode step is for the CPU; CUDA replays captured graphs")
        # Inductor reads its cache's place from the environment when it first compiles: ours, unless set.
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(default_cache_dir()))
        self.model = model
        self.memory = memory
        self.page_size = page_size
        c = model.config
        self.shape = (c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps, c.head_dim**-0.5)
        self.layers = [torch.tensor(i, dtype=torch.int64) for i in range(c.num_layers)]
        self._weights: dict[int, list[LayerWeights]] = {}  # batch size -> each layer's
        self._entries = _Entries()
        self._layer = torch.compile(
            _own_copy(decode_layer), backend=self._entries, fullgraph=True, dynamic=None
        )
        # (batch of one, weight kernels, LoRA or none) -> the graph's direct entry (module docstring)
        self._direct: dict[tuple[object, ...], Callable[[Sequence[Any]], Any]] = {}
        self.steps = 0  # decode steps the compiled layers ran
        self.warm = False  # after warm-up: a step that needs a new graph raises NotCompiled
        self.fallbacks = 0

    def weights(self, tokens: int) -> list[LayerWeights]:
        weights = self._weights.get(tokens)
        if weights is None:
            dtype = self.model.dtype
            weights = [layer_weights(layer, tokens, dtype) for layer in self.model.layers]  # type: ignore[arg-type]
            self._weights[tokens] = weights
        return weights

    def run(self, batch: StepBatch, lora: LoraStacks | None) -> torch.Tensor:
        """Float32 logits [S, vocab] of a graph-ready decode batch (S: its sampled rows, padding last).
        NotCompiled if it would need a new graph after warm-up."""
        decode = batch.decode
        assert decode is not None and batch.prefill is None
        # Pages of the widest context, at least _MIN_STACK (size 1 is specialized; the extra is masked).
        width = max(max(decode.num_blocks), _MIN_STACK)
        tables = decode.block_tables[:, :width]
        lora_rows = None
        if lora is not None and batch.lora is not None and batch.lora.decode_slots is not None:
            lora_rows = lora.rows(batch.lora.decode_slots)
        return self.forward(
            batch.input_ids, batch.positions, batch.slots, tables, decode.context_lens, batch.logits_indices,
            lora_rows,
        )  # fmt: skip

    def forward(
        self,
        input_ids: torch.Tensor,  # [B]
        positions: torch.Tensor,  # [B]
        slots: torch.Tensor,  # [B] KV slot of each row's token
        block_tables: torch.Tensor,  # [B, W]
        context_lens: torch.Tensor,  # [B]
        logits_indices: torch.Tensor,  # [S]
        lora: tuple[tuple[torch.Tensor, ...] | None, ...] | None,
    ) -> torch.Tensor:
        model = self.model
        batch = input_ids.shape[0]
        # Copies made here (in inference mode, contiguous), so the graphs' guards on the tables' layout
        # and dispatch keys hold for a step's views of its metadata as for warm-up's tensors.
        block_tables = block_tables.clone(memory_format=torch.contiguous_format)
        context_lens = context_lens.clone()
        hidden = F.embedding(input_ids, model.embed_tokens)  # [B, hidden]
        cos = model.rope_cos[positions].unsqueeze(1)  # [B, 1, D]
        sin = model.rope_sin[positions].unsqueeze(1)
        delta = torch.zeros_like(hidden)
        lora_args = lora if lora is not None else (None,) * len(GROUPS)
        _mark_dynamic(hidden, delta, cos, sin, block_tables, context_lens, lora=lora)
        weights = self.weights(batch)
        key = (batch == 1, tuple(w.kinds for w in weights), lora is None)
        args: list[Any] = [
            None, None, lora_args, hidden, delta, cos, sin, self.memory, None, block_tables, context_lens,
            self.shape,
        ]  # fmt: skip
        direct = self._direct.get(key) if self.warm else None
        if direct is not None:
            keys, values = self._run_direct(direct, args, weights)
        else:
            keys, values = self._run_compiled(key, args, weights)
        hidden, delta = args[3], args[4]
        self.steps += 1
        self._write_kv(torch.stack(keys, 1), torch.stack(values, 1), slots)
        hidden = hidden + delta
        return model.compute_logits(hidden[logits_indices])

    def _run_direct(
        self, direct: Callable[[Sequence[Any]], Any], args: list[Any], weights: list[LayerWeights]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        keys, values = [], []
        for layer_weights_, layer in zip(weights, self.layers, strict=True):
            args[1], args[8] = layer_weights_.tensors, layer
            args[3], args[4], k, v = direct(args)
            keys.append(k)
            values.append(v)
        return keys, values

    def _run_compiled(
        self, key: tuple[object, ...], args: list[Any], weights: list[LayerWeights]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The layers through torch.compile's entry; at warm-up, the direct entry of a graph compiled by
        the first layer's call, checked on the second layer's."""
        keys, values = [], []
        stance = "fail_on_recompile" if self.warm else "default"
        seen = len(self._entries.graphs)
        direct = None
        try:
            with torch.compiler.set_stance(stance):
                for i, (layer_weights_, layer) in enumerate(zip(weights, self.layers, strict=True)):
                    args[0], args[1], args[8] = layer_weights_.kinds, layer_weights_.tensors, layer
                    if direct is not None:
                        self._check_direct(key, direct, args)
                        direct = None
                    outputs = self._layer(*args)
                    if i == 0 and not self.warm and len(self._entries.graphs) == seen + 1:
                        direct = _direct_entry(*self._entries.graphs[-1], args)
                    args[3], args[4], k, v = outputs
                    keys.append(k)
                    values.append(v)
        except RuntimeError as error:
            if self.warm and str(error).startswith("Detected recompile"):
                self.fallbacks += 1
                raise NotCompiled(str(error)) from None
            raise
        return keys, values

    def _check_direct(
        self, key: tuple[object, ...], direct: Callable[[Sequence[Any]], Any] | None, args: list[Any]
    ) -> None:
        """Keep `direct` for `key` if it gives torch.compile's outputs for `args`, bit for bit."""
        if direct is None:
            return
        want = self._layer(*args)
        got = direct(args)
        if len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True)):
            self._direct[key] = direct
        else:
            log.warning("compiled decode: a direct graph entry disagrees with torch.compile's; not used")

    def _write_kv(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        """Every layer's new keys and values [B, L, kv_heads, D] into the rows' slots, one scatter.
        Padding rows all write the same values to the padding page's one slot."""
        memory = self.memory
        _, layers, _, kv_heads, page_size, dim = memory.shape
        pages, offsets = slots // page_size, slots % page_size
        # memory as rows of head_dim: row ((((page * L + l) * 2 + part) * H + h) * P + offset)
        layer = torch.arange(layers)[None, :, None, None]
        part = torch.arange(2)[None, None, :, None]
        head = torch.arange(kv_heads)[None, None, None, :]
        rows = (((pages[:, None, None, None] * layers + layer) * 2 + part) * kv_heads + head) * page_size
        rows = rows + offsets[:, None, None, None]  # [B, L, 2, H]
        new = torch.stack((keys, values), dim=2)  # [B, L, 2, H, D]
        memory.view(-1, dim).index_copy_(0, rows.flatten(), new.reshape(-1, dim))

    def warm_up(
        self,
        sizes: Sequence[int],
        padding_page: int,
        lora_widths: dict[str, tuple[int, int]],
        lora_dtype: torch.dtype,
    ) -> int:
        """Compile (or load from Inductor's disk cache) every graph the decode steps of these batch sizes
        can need, with and without LoRA, on rows that read and write only the padding page; afterwards a
        step that needs another graph raises NotCompiled. Returns the batch sizes driven."""
        began = time.perf_counter()
        driven = 0
        layers = self.model.config.num_layers
        kinds_seen: set[tuple[object, ...]] = set()
        with torch.inference_mode():  # as the runner's steps run (their tensors are inference tensors)
            stacks = make_stacks({}, 1, lora_widths, layers, lora_dtype)
            for size in sizes:
                # Sizes whose graphs are already compiled (same weight kernels, both sides of 1) add nothing.
                key = (size == 1, tuple(w.kinds for w in self.weights(size)))
                if key in kinds_seen:
                    continue
                kinds_seen.add(key)
                driven += 1
                slots = torch.full((size,), padding_page * self.page_size, dtype=torch.int64)
                tables = torch.full((size, _MIN_STACK), padding_page, dtype=torch.int64)
                lens = torch.ones(size, dtype=torch.int64)
                ids = torch.zeros(size, dtype=torch.int64)
                rows = torch.arange(size, dtype=torch.int64)
                decode_slots = torch.zeros(size, dtype=torch.int32)
                for lora in (None, stacks.rows(decode_slots)):
                    self.forward(ids, ids, slots, tables, lens, rows, lora)
        self.warm = True
        log.info(
            "compiled decode: %d graph sets for batch sizes %s compiled or loaded in %.1f s",
            driven, list(sizes), time.perf_counter() - began,
        )  # fmt: skip
        return driven


def _own_copy(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with a code object of its own. torch.compile keeps its graphs (and counts them against its
    recompile limit) per code object: each CompiledDecode has its own, so engines of other models or
    settings in one process neither share nor crowd each other's graphs, and a step one engine's
    warm-up did not compile is not served by another's."""
    code = fn.__code__.replace()
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _mark_dynamic(*tensors: torch.Tensor, lora: tuple[tuple[torch.Tensor, ...] | None, ...] | None) -> None:
    """The batch (dim 0 of every step tensor), the context width (block tables' dim 1) and the LoRA
    stacks' adapter count and rank are dynamic: one graph serves every bucket, context and set."""
    mark: Callable[..., None] = torch._dynamo.maybe_mark_dynamic
    for t in tensors:
        mark(t, 0)
    mark(tensors[4], 1)  # block tables' width
    if lora is not None:
        for group in lora:
            if group is None:
                continue
            a, b, rows = group
            for tensor, dim in ((a, 1), (a, 3), (b, 1), (b, 2), (rows, 0)):
                mark(tensor, dim)


# Inductor's options for the layer: no size and stride asserts on the inputs in the graph's wrapper (26
# a call; the direct entry passes the tensors of the call that compiled it, their layout checked there).
_INDUCTOR: dict[str, object] = {"size_asserts": False}


class _Entries:
    """torch.compile's backend for the layer: Inductor, recording each graph it compiles with the example
    inputs dynamo passed (the call's own tensors and its dynamic sizes)."""

    def __init__(self) -> None:
        self.graphs: list[tuple[GraphModule, list[Any], Callable[..., Any]]] = []

    def __call__(self, gm: GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx

        compiled: Callable[..., Any] = compile_fx(gm, example_inputs, config_patches=_INDUCTOR)  # type: ignore[assignment]
        self.graphs.append((gm, list(example_inputs), compiled))
        return compiled


def _tensor_paths(value: Any, path: tuple[int, ...] = ()) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        return [(path, value)]
    if isinstance(value, (tuple, list)):
        return [leaf for i, item in enumerate(value) for leaf in _tensor_paths(item, (*path, i))]
    return []


def _direct_entry(
    gm: GraphModule, example_inputs: list[Any], compiled: Callable[..., Any], args: Sequence[Any]
) -> Callable[[Sequence[Any]], Any] | None:
    """A function of decode_layer's argument list that calls the graph compiled from `gm` as dynamo's
    bytecode would: its inputs in order, each tensor found by identity among the arguments (the call
    that compiled it) and each dynamic size as the size of a tensor input it belongs to. None where an
    input is not found (or found twice), or the graph's outputs are not the layer's four."""
    leaves = _tensor_paths(list(args))
    where = {}
    for path, tensor in leaves:
        if id(tensor) in where:
            return None  # one tensor twice: dynamo passes it once, a step might not
        where[id(tensor)] = path
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    outputs = next(iter(gm.graph.find_nodes(op="output"))).args[0]
    if len(placeholders) != len(example_inputs) or len(outputs) != 4:
        return None

    def index(path: tuple[int, ...]) -> str:
        return "a" + "".join(f"[{i}]" for i in path)

    sizes: dict[str, str] = {}  # a dynamic size's symbol -> "a[..].size(d)"
    dynamic: set[tuple[tuple[int, ...], int]] = set()  # (argument path, dim) of the graph's dynamic sizes
    for node, example in zip(placeholders, example_inputs, strict=True):
        fake = node.meta.get("example_value")
        if isinstance(example, torch.Tensor) and id(example) in where and isinstance(fake, torch.Tensor):
            for dim, size in enumerate(fake.shape):
                if isinstance(size, torch.SymInt):
                    sizes.setdefault(str(size.node.expr), f"{index(where[id(example)])}.size({dim})")
                    dynamic.add((where[id(example)], dim))
    # The entry serves other batch sizes (past one) and context widths only where those stayed dynamic.
    if (((3,), 0) not in dynamic and args[3].shape[0] > 1) or ((9,), 1) not in dynamic:
        return None
    parts = []
    for node, example in zip(placeholders, example_inputs, strict=True):
        if isinstance(example, torch.Tensor):
            if id(example) not in where:
                return None
            parts.append(index(where[id(example)]))
        elif (
            isinstance(fake := node.meta.get("example_value"), torch.SymInt) and str(fake.node.expr) in sizes
        ):
            parts.append(sizes[str(fake.node.expr)])
        else:
            return None
    inputs = eval(f"lambda a: ({', '.join(parts)},)")  # text made above from indices
    return lambda a: compiled(*inputs(a))
