"""A step's batch (engine/batch.py): the layout both attention backends and both LoRA stackers read,
built into one host buffer and copied to the device once per step."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from loraplex.engine import EngineConfig, LLMEngine, SamplingParams
from loraplex.engine.batch import BatchBuilder, DecodeBuckets, StepBatch, order_chunks
from loraplex.engine.lora.synthetic import SyntheticAdapter
from loraplex.engine.model.loader import load_model

ENGINE_SOURCE = Path(__file__).resolve().parents[2] / "engine"


@dataclass
class FakeRequest:
    token_ids: list[int]
    pages: list[int]
    adapter: str | None = None

    def tokens(self, start: int, end: int) -> list[int]:
        return self.token_ids[start:end]


@dataclass(frozen=True)
class FakeChunk:
    request: FakeRequest
    start: int
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        return self.end == len(self.request.token_ids)


@dataclass(frozen=True)
class Snapshot:
    request: Any
    start: int
    num_tokens: int
    end: int
    samples: bool


def request(length: int, pages: list[int], adapter: str | None = None) -> FakeRequest:
    return FakeRequest(list(range(100, 100 + length)), pages, adapter)


def mixed_chunks() -> list[FakeChunk]:
    """Three decodes (two with adapters), a fresh prefill chunk with an adapter that does not sample
    yet, and a chunk after a cached prefix without one; page size 4."""
    return [
        FakeChunk(request(3, [7]), 2, 1),
        FakeChunk(request(10, [12, 13, 14]), 0, 6),  # the first 6 of 10 prompt tokens
        FakeChunk(request(9, [5, 9, 2], "b"), 8, 1),
        FakeChunk(request(9, [6, 8, 10]), 4, 5),  # 4 tokens cached
        FakeChunk(request(6, [3, 11], "a"), 5, 1),
    ]


def with_adapter(chunks: list[FakeChunk], index: int, adapter: str) -> list[FakeChunk]:
    chunk = chunks[index]
    chunks[index] = dataclasses.replace(chunk, request=dataclasses.replace(chunk.request, adapter=adapter))
    return chunks


def test_mixed_batch_layout() -> None:
    chunks = with_adapter(mixed_chunks(), 1, "a")
    ordered = order_chunks(chunks)
    assert [c.end for c in ordered] == [9, 6, 3, 6, 9]  # decodes longest first, then the prefills
    batch = BatchBuilder(4, "cpu").build(ordered)

    assert batch.input_ids.tolist() == [108, 105, 102, *range(100, 106), *range(104, 109)]
    assert batch.positions.tolist() == [8, 5, 2, 0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 8]
    # page * 4 + offset: position 8 of [5, 9, 2] is page 2 offset 0; 5 of [3, 11] is page 11 offset 1
    assert batch.slots.tolist() == [8, 45, 30, 48, 49, 50, 51, 52, 53, 32, 33, 34, 35, 40]
    assert batch.logits_indices.tolist() == [0, 1, 2, 13]  # the 6-token chunk does not sample yet
    assert all(t.dtype == torch.int64 for t in (batch.input_ids, batch.positions, batch.slots))

    decode = batch.decode
    assert decode is not None and batch.num_decodes == 3
    assert decode.block_tables.tolist() == [[5, 9, 2], [3, 11, 0], [7, 0, 0]]  # the zero page pads
    assert decode.context_lens.tolist() == [9, 6, 3]
    assert [(g.start, g.end, g.block_tables.tolist()) for g in decode.groups()] == [
        (0, 3, [[5, 9, 2], [3, 11, 0], [7, 0, 0]])
    ]

    prefill = batch.prefill
    assert prefill is not None and prefill.start == 3
    assert prefill.block_tables.tolist() == [[12, 13, 0], [6, 8, 10]]  # only the pages a chunk reaches
    assert prefill.q_starts.tolist() == [0, 6, 11]
    assert prefill.context_lens.tolist() == [6, 9]
    assert prefill.max_chunk_len == 6
    first, second = prefill.segments
    assert (first.start, first.end, first.context_len, first.fresh) == (3, 9, 6, True)
    assert (second.start, second.end, second.context_len, second.fresh) == (9, 14, 9, False)
    assert first.block_table.tolist() == [12, 13] and second.block_table.tolist() == [6, 8, 10]

    lora = batch.lora
    assert lora is not None and lora.adapters == ("a", "b")
    assert lora.decode_slots is not None and lora.decode_slots.tolist() == [1, 0, -1]
    assert lora.segments is not None
    assert lora.segments.starts.tolist() == [0, 6, 11] and lora.segments.slots.tolist() == [0, -1]
    assert lora.segments.longest == 6
    assert lora.decode_slots.dtype == lora.segments.starts.dtype == torch.int32
    # Rows with an adapter, grouped by slot: "a" (the 6-context decode and the prefill chunk), then "b".
    assert lora.order.tolist() == [1, 3, 4, 5, 6, 7, 8, 0] and not lora.in_row_order
    assert lora.slot_counts == lora.slot_counts_device.tolist() == [7, 1]
    assert lora.slot_ends.tolist() == [7, 8]
    assert batch.token_adapters == ["b", "a", None, *["a"] * 6, *[None] * 5]


def test_without_adapters_there_is_no_lora_metadata() -> None:
    batch = BatchBuilder(4, "cpu").build(order_chunks(mixed_chunks()[:2]))
    assert batch.lora is None and batch.token_adapters == [None] * 7


def test_rows_already_grouped_by_adapter_need_no_gather() -> None:
    chunks = [FakeChunk(request(5, [3, 4], "a"), 4, 1), FakeChunk(request(5, [5, 6], "b"), 0, 5)]
    lora = BatchBuilder(4, "cpu").build(chunks).lora
    assert lora is not None and lora.in_row_order and lora.order.tolist() == [0, 1, 2, 3, 4, 5]
    assert lora.decode_slots is not None and lora.decode_slots.tolist() == [0]
    # Only base-model prefill chunks: the kernels skip segments altogether.
    lora = BatchBuilder(4, "cpu").build([chunks[0], FakeChunk(request(5, [5, 6]), 0, 5)]).lora
    assert lora is not None and lora.segments is None and not lora.in_row_order


def test_decode_groups_are_cut_from_the_one_table_to_their_widest() -> None:
    """The reference path's groups come from the same table the kernels read: no second layout."""
    widths = [10, 10, 9, 9, 3, 3, 2, 2]  # pages of each decode's context
    chunks = [
        FakeChunk(request(4 * w, list(range(1 + 10 * i, 1 + 10 * i + w))), 4 * w - 1, 1)
        for i, w in enumerate(widths)
    ]
    decode = BatchBuilder(4, "cpu").build(chunks).decode
    assert decode is not None and decode.block_tables.shape == (8, 10)
    groups = decode.groups()
    assert [(g.start, g.end) for g in groups] == [(0, 4), (4, 8)]
    assert groups[1].block_tables.shape == (4, 3)  # padded to its own widest, not the step's
    assert groups[1].block_tables.tolist() == [
        [41, 42, 43],
        [51, 52, 53],
        [61, 62, 0],
        [71, 72, 0],
    ]
    assert groups[1].context_lens.tolist() == [12, 12, 8, 8]
    assert groups[1].block_tables.is_contiguous()  # the reference ops flatten it in every layer
    assert groups[0].block_tables.data_ptr() == decode.block_tables.data_ptr()  # full width: a view


def test_bad_layouts_are_refused() -> None:
    builder = BatchBuilder(4, "cpu")
    with pytest.raises(ValueError, match="at least one chunk"):
        builder.build([])
    decode, prefill = FakeChunk(request(3, [7]), 2, 1), FakeChunk(request(10, [12, 13]), 0, 6)
    with pytest.raises(ValueError, match=r"decodes \(one-token chunks\) must come first"):
        builder.build([prefill, decode])
    with pytest.raises(ValueError, match="chunk 0 has 0 tokens"):
        builder.build([FakeChunk(request(3, [7]), 2, 0)])
    short = "chunk 1 reaches token 9, which needs 3 pages of 4; its request has 2"
    with pytest.raises(ValueError, match=short):
        builder.build([decode, FakeChunk(request(9, [6, 8]), 4, 5)])
    with pytest.raises(ValueError, match="page_size"):
        BatchBuilder(0, "cpu")


def decodes(count: int, first_page: int = 20) -> list[FakeChunk]:
    """`count` decodes of other lengths and pages (page size 4), adapters on every other one."""
    chunks = []
    for i in range(count):
        length = 5 + 3 * i
        pages = list(range(first_page + 4 * i, first_page + 4 * i + -(-length // 4)))
        chunks.append(FakeChunk(request(length, pages, "a" if i % 2 else None), length - 1, 1))
    return order_chunks(chunks)


def test_graph_ready_decode_steps_have_one_layout_per_bucket() -> None:
    """3 and 4 decodes (other requests, pages and adapters) are both bucket 4: the same shapes and the
    same copy size; the padding row decodes token 0 at position 0 on the padding page, its logits last."""
    buckets = DecodeBuckets((1, 2, 4, 8), max_blocks=6, padding_page=1)
    builder = BatchBuilder(4, "cpu", buckets)
    three = builder.build(decodes(3))

    def shapes(batch: StepBatch) -> list[tuple[int, ...]]:
        """What the decode kernels read (the grouped-GEMM order is the torch path's, sized per step)."""
        assert batch.decode is not None and batch.lora is not None and batch.lora.decode_slots is not None
        kernel_inputs = (batch.input_ids, batch.positions, batch.slots, batch.logits_indices)
        tables = (batch.decode.block_tables, batch.decode.context_lens, batch.lora.decode_slots)
        return [tuple(t.shape) for t in (*kernel_inputs, *tables)]

    three_shapes = shapes(three)
    assert three.num_tokens == 4 and three.logits_indices.tolist() == [0, 1, 2, 3]
    assert three.input_ids[3] == 0 and three.positions[3] == 0 and three.slots[3] == 1 * 4
    decode = three.decode
    assert decode is not None and decode.block_tables.shape == (4, 6)
    assert decode.block_tables[3].tolist() == [1, 0, 0, 0, 0, 0] and decode.context_lens[3] == 1
    assert decode.block_tables[0].tolist() == [28, 29, 30, 0, 0, 0]  # the longest, padded to 6
    assert three.lora is not None and three.lora.decode_slots is not None
    assert three.lora.decode_slots.tolist() == [-1, 0, -1, -1]  # padding uses no adapter
    assert three.token_adapters == [None, "a", None, None]
    assert three.num_padding == 1
    # Built after `three` was read: a graph-ready batch lives until the next step of its bucket.
    four = builder.build(decodes(4, first_page=40))
    assert four.num_padding == 0 and shapes(four) == three_shapes


def test_graph_ready_steps_of_a_bucket_reuse_one_device_buffer() -> None:
    """Static inputs: each step of a bucket copies its metadata into the bucket's one buffer (the
    addresses a captured graph reads); another bucket has its own."""
    builder = BatchBuilder(4, "cpu", DecodeBuckets((1, 2, 4, 8), max_blocks=6, padding_page=1))
    three = builder.build(decodes(3))
    four = builder.build(decodes(4, first_page=40))
    assert four.input_ids.data_ptr() == three.input_ids.data_ptr()
    assert four.decode is not None and three.decode is not None
    assert four.decode.block_tables.data_ptr() == three.decode.block_tables.data_ptr()
    assert three.decode.block_tables[0].tolist() == [52, 53, 54, 55, 0, 0]  # now the second step's
    two = builder.build(decodes(2))
    assert two.input_ids.data_ptr() != four.input_ids.data_ptr()
    assert builder.stats.uploads == 3


def test_graph_ready_leaves_other_steps_exact() -> None:
    builder = BatchBuilder(4, "cpu", DecodeBuckets((1, 2, 4, 8), max_blocks=6, padding_page=1))
    mixed = builder.build(order_chunks(mixed_chunks()))  # prefill chunks: not padded
    assert mixed.num_padding == 0 and mixed.num_tokens == 14
    assert builder.build(decodes(9)).num_padding == 0  # beyond the largest bucket
    with pytest.raises(ValueError, match="spans 7 pages, more than the buckets' 6"):
        builder.build([FakeChunk(request(27, list(range(2, 9))), 26, 1)])


def test_decode_buckets_are_checked() -> None:
    assert DecodeBuckets.up_to(48, 8, 1).sizes == (1, 2, 4, 8, 16, 32, 48)
    assert DecodeBuckets.up_to(1, 8, 1).sizes == (1,)
    assert DecodeBuckets((1, 4), 8, 1).bucket(3) == 4 and DecodeBuckets((1, 4), 8, 1).bucket(5) is None
    with pytest.raises(ValueError, match="ascending"):
        DecodeBuckets((4, 2), 8, 1)
    with pytest.raises(ValueError, match="page 0"):
        DecodeBuckets((1, 2), 8, 0)
    with pytest.raises(ValueError, match="max_blocks"):
        DecodeBuckets((1, 2), 0, 1)


def tensors_of(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor a batch holds, through its dataclasses and lists."""
    if isinstance(value, torch.Tensor):
        yield value
    elif dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            yield from tensors_of(getattr(value, f.name))
    elif isinstance(value, list | tuple):
        for item in value:
            yield from tensors_of(item)


class CountTransfers(TorchDispatchMode):
    """Counts copies from host memory to another device, as the dispatcher sees them."""

    def __init__(self) -> None:
        super().__init__()
        self.transfers = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default:
            target = kwargs.get("device") or args[0].device
            self.transfers += args[0].device.type == "cpu" and torch.device(target).type != "cpu"
        elif func is torch.ops.aten.copy_.default:
            self.transfers += args[1].device.type == "cpu" and args[0].device.type != "cpu"
        return func(*args, **kwargs)


class CountHostData(TorchFunctionMode):
    """Records tensors made from Python data (torch.tensor and friends) by the engine's own code."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.tensor, torch.as_tensor, torch.asarray):
            import traceback

            caller = traceback.extract_stack(limit=2)[0]
            if Path(caller.filename).resolve().is_relative_to(ENGINE_SOURCE):
                self.calls.append(f"{caller.filename}:{caller.lineno}")
        return func(*args, **(kwargs or {}))


def test_one_transfer_per_build_and_no_tensor_from_python_data() -> None:
    """On a device other than the host's ("meta" stands in for a GPU), the whole step's metadata goes
    over in one copy, and every tensor of the batch is a view of it."""
    builder = BatchBuilder(4, "meta")
    chunks = order_chunks(with_adapter(mixed_chunks(), 1, "a"))
    with CountTransfers() as counted, CountHostData() as made:
        batch = builder.build(chunks)
    assert counted.transfers == 1 and made.calls == []
    tensors = list(tensors_of(batch))
    assert len(tensors) > 15
    assert all(t.device.type == "meta" for t in tensors)
    assert len({t.untyped_storage()._cdata for t in tensors}) == 1  # views of the one copy
    assert builder.stats.uploads == builder.stats.builds == 1


def test_the_host_buffer_is_reused_and_a_batch_outlives_the_next_build() -> None:
    builder = BatchBuilder(4, "cpu")
    assert not builder._host.is_pinned()  # pinned only for a CUDA device
    chunks = order_chunks(with_adapter(mixed_chunks(), 1, "a"))
    first = builder.build(chunks)
    want = [t.tolist() for t in tensors_of(first)]
    for _ in range(5):
        builder.build(order_chunks(mixed_chunks()[:3]))
        builder.build(chunks)
    assert [t.tolist() for t in tensors_of(first)] == want
    assert builder.stats.allocations == 1 and builder.stats.builds == 11
    # A step bigger than the buffer grows it once.
    builder.build([FakeChunk(request(20_000, list(range(1, 5001))), 0, 20_000)])
    assert builder.stats.allocations == 2


def test_pinned_host_buffer_on_cuda() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    builder = BatchBuilder(4, device)
    batch = builder.build(order_chunks(mixed_chunks()))
    assert builder._host.is_pinned() == (device.type == "cuda")
    assert batch.input_ids.device.type == device.type


ADAPTERS = {"r2-qv": (2, ("q", "v")), "r8-all": (8, ("q", "k", "v", "o", "gate", "up", "down"))}


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_an_engine_step_copies_its_metadata_once(kernels: str) -> None:
    """A real mixed step (decodes and prefill chunks, two adapters and the base model, one adapter
    adapting only some projection groups) built and run again once its adapters' tables exist:
    one metadata upload, no tensor made from Python data, one host-to-device copy on a GPU, and the
    same logits."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    loaded = load_model("random:tiny", torch.float32, device, seed=3)
    engine = LLMEngine(
        EngineConfig(
            model="random:tiny", device=str(device), dtype="float32", num_pages=64, page_size=16,
            max_num_seqs=8, max_batch_tokens=64, kernels=kernels,
        ),
        loaded=loaded,
    )  # fmt: skip
    base = loaded.config.lora_shape()
    for seed, (name, (rank, targets)) in enumerate(ADAPTERS.items()):
        engine.register_adapter(name, SyntheticAdapter(base, seed=seed, rank=rank, targets=targets))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request(list(range(1, 6)), params, adapter="r2-qv")
    engine.add_request(list(range(7, 15)), params)
    engine.step()  # their prefills
    engine.add_request(list(range(20, 31)), params, adapter="r8-all")
    engine.add_request(list(range(40, 44)), params, adapter="r2-qv")

    runner, seen = engine.runner, dict[str, Any]()
    build, execute = runner.build, runner.execute

    def recording_build(chunks: Any) -> StepBatch:
        # As they were: a chunk samples when it reaches its request's end, which moves once sampled.
        seen["chunks"] = [Snapshot(c.request, c.start, c.num_tokens, c.end, c.samples) for c in chunks]
        seen["batch"] = build(chunks)
        return seen["batch"]

    def recording_execute(batch: StepBatch) -> torch.Tensor:
        seen["logits"] = execute(batch)
        return seen["logits"]

    setattr(runner, "build", recording_build)  # noqa: B010 (an instance attribute shadows the method)
    setattr(runner, "execute", recording_execute)  # noqa: B010
    with CountHostData() as first:
        engine.step()
    # The counter sees the engine's own tensors: this new set of adapters had its tables derived.
    assert first.calls
    batch = seen["batch"]
    assert batch.decode is not None and batch.prefill is not None and batch.lora is not None
    assert batch.lora.decode_slots is not None and batch.lora.segments is not None
    assert batch.lora.adapters == ("r2-qv", "r8-all") and None in batch.token_adapters

    uploads = runner.builder.stats.uploads
    with CountTransfers() as counted, CountHostData() as made:
        logits = execute(build(seen["chunks"]))  # the same KV values again, into the same slots
    assert made.calls == []
    assert runner.builder.stats.uploads == uploads + 1
    assert counted.transfers == (1 if device.type != "cpu" else 0)
    torch.testing.assert_close(logits, seen["logits"], rtol=0, atol=0)
