"""The kernels' index tables built from real PEFT adapters packed into pages by layout.py: they must
describe exactly the matrices the row-index gathers read, and drive the ops to the same deltas. The
persistent tables (metadata written once per load, a column range per resident adapter) must give a
step exactly what the former per-step concatenation built (kept in bench/lora_tables.py as the
baseline and the oracle)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from loraplex.adapters import inspect_adapter
from loraplex.adapters.weights import load_lora_weights
from loraplex.bench.lora_tables import old_group_tables  # the former per-step builder: the oracle
from loraplex.engine.kernels import lora_expand, lora_shrink, reference
from loraplex.engine.kernels.lora_meta import LoRAKernelMeta
from loraplex.engine.lora.layout import GROUPS, group_width, pack_adapter, physical_rows
from loraplex.engine.lora.tables import LoraTables, ResidentTables, adapter_meta

from ...adapters.conftest import TINY_SHAPE, VARIANTS, make_peft_adapter

HEAD_DIM = 16  # divides every TINY projection width (64, 32, 96)
ROWS_PER_PAGE = 8  # a 96-wide row takes 6 of a page's rows: rows are pushed to the next page at times


@dataclass
class Placed:
    """An adapter resident in the pool: its pool rows per group (like residency.Resident)."""

    a_rows: dict[str, torch.Tensor]
    b_rows: dict[str, torch.Tensor]


PoolAndAdapters = tuple[torch.Tensor, dict[str, Placed]]


@pytest.fixture(scope="module")
def pool_and_adapters(tmp_path_factory: pytest.TempPathFactory) -> PoolAndAdapters:
    """Every PEFT variant packed and loaded into randomly chosen, shuffled pages of one pool."""
    root: Path = tmp_path_factory.mktemp("lora-tables")
    packed = {}
    for i, (name, args) in enumerate(VARIANTS.items()):
        make_peft_adapter(root / name, seed=i, **args)
        manifest = inspect_adapter(root / name, TINY_SHAPE)
        weights = load_lora_weights(root / name, manifest)
        packed[name] = pack_adapter(manifest, weights, TINY_SHAPE, HEAD_DIM, ROWS_PER_PAGE)
    needed = [p.pages_needed(ROWS_PER_PAGE) for p in packed.values()]
    free_pages = list(range(1, sum(needed) + 9))  # page 0 is the null page; some pages stay unused
    random.Random(0).shuffle(free_pages)
    pool_rows = torch.randn(len(free_pages) + 1, ROWS_PER_PAGE, HEAD_DIM).flatten(
        0, 1
    )  # garbage in free pages
    pool_rows[:ROWS_PER_PAGE] = 0
    placed = {}
    for (name, adapter), count in zip(packed.items(), needed, strict=True):
        pages, free_pages = free_pages[:count], free_pages[count:]
        pool_rows.index_copy_(0, physical_rows(adapter.data_rows, pages, ROWS_PER_PAGE), adapter.data)

        def place(index: dict[str, torch.Tensor], pages: list[int] = pages) -> dict[str, torch.Tensor]:
            return {g: physical_rows(v, pages, ROWS_PER_PAGE) for g, v in index.items()}

        placed[name] = Placed(place(adapter.a_rows), place(adapter.b_rows))
    return pool_rows, placed


def old_step_tables(adapters: Sequence[Placed]) -> dict[str, LoraTables]:
    tables = {group: old_group_tables(adapters, group, TINY_SHAPE, HEAD_DIM) for group in GROUPS}
    return {group: table for group, table in tables.items() if table is not None}


def resident(placed: dict[str, Placed], names: Sequence[str], capacity: int = 4) -> ResidentTables:
    """Persistent tables holding `names` (a small capacity: the tables grow while loading)."""
    tables = ResidentTables(TINY_SHAPE.num_layers, torch.device("cpu"), capacity)
    for name in names:
        tables.add(name, adapter_meta(placed[name], TINY_SHAPE, HEAD_DIM))
    return tables


def compacted(table: LoraTables) -> LoraTables:
    """The step's columns only, in slot order: what the old builder laid out."""
    columns = torch.cat(
        [
            torch.arange(s, s + r)
            for s, r in zip(table.slot_start.tolist(), table.slot_rank.tolist(), strict=True)
        ]
    )
    ranks = table.slot_rank.tolist()
    starts = [sum(ranks[:u]) for u in range(len(ranks))]
    return LoraTables(
        table.a_starts[:, columns],
        table.b_starts[:, columns],
        table.b_cols[:, columns],
        table.b_widths[:, columns],
        torch.tensor(starts, dtype=torch.int32),
        table.slot_rank,
        table.max_rank,
    )


def assert_same_tables(got: dict[str, LoraTables], want: dict[str, LoraTables]) -> None:
    assert set(got) == set(want)
    for group, table in got.items():
        flat, old = compacted(table), want[group]
        for field in ("a_starts", "b_starts", "b_cols", "b_widths", "slot_start", "slot_rank"):
            assert torch.equal(getattr(flat, field), getattr(old, field)), (group, field)
        assert table.max_rank == old.max_rank, group
        # The kernels index the persistent tables directly: the slot ranges must hold the same rows.
        for u, (start, rank) in enumerate(
            zip(table.slot_start.tolist(), table.slot_rank.tolist(), strict=True)
        ):
            want_start = old.slot_start[u]
            assert torch.equal(
                table.a_starts[:, start : start + rank], old.a_starts[:, want_start : want_start + rank]
            )


def dense_from_tables(pool_rows: torch.Tensor, tables: LoraTables, in_width: int, out_width: int):
    """Per layer, the stacked A [L, C, in] and B [L, C, out] the tables describe, read from the flat pool."""
    flat = pool_rows.flatten()
    a = flat[tables.a_starts[..., None] * HEAD_DIM + torch.arange(in_width)]
    offset = torch.arange(out_width) - tables.b_cols[..., None].long()  # [L, C, out]
    inside = (offset >= 0) & (offset < tables.b_widths[..., None])
    index = (tables.b_starts[..., None] * HEAD_DIM + offset.clamp(min=0)).clamp(max=flat.numel() - 1)
    b = torch.where(inside, flat[index], 0.0)
    return a, b


ORDERS = [
    list(VARIANTS),
    ["layer1-only", "regex", "qv-r8"],
    ["full-names", "all-linear-patterns", "full-names"],  # a slot may repeat an adapter
    ["regex"],
]


@pytest.mark.parametrize("order", ORDERS, ids=["all", "three", "repeat", "one"])
def test_tables_describe_the_gathered_matrices(pool_and_adapters: PoolAndAdapters, order: list[str]) -> None:
    pool_rows, placed = pool_and_adapters
    adapters = [placed[name] for name in order]
    loaded = sorted(set(order), key=lambda n: hash(n) % 7)  # loaded in another order than the slots
    persistent = resident(placed, loaded).step_tables(order)
    assert_same_tables(persistent, old_step_tables(adapters))
    tables = {group: compacted(table) for group, table in persistent.items()}
    assert set(tables) == {g for g in GROUPS if any(g in a.a_rows for a in adapters)}
    for group, table in tables.items():
        in_width, out_width = group_width(TINY_SHAPE, group)
        present = [a for a in adapters if group in a.a_rows]
        a_want = reference.gather_rows(pool_rows, torch.cat([a.a_rows[group] for a in present], dim=1))
        b_want = reference.gather_rows(pool_rows, torch.cat([a.b_rows[group] for a in present], dim=1))
        a_got, b_got = dense_from_tables(pool_rows, table, in_width, out_width)
        assert torch.equal(a_got, a_want), group
        assert torch.equal(b_got, b_want), group

        ranks = [a.a_rows[group].shape[1] if group in a.a_rows else 0 for a in adapters]
        assert table.slot_rank.tolist() == ranks and table.max_rank == max(ranks)
        assert table.slot_start.tolist() == [sum(ranks[:u]) for u in range(len(ranks))]
        assert table.a_starts.shape == table.b_starts.shape == (TINY_SHAPE.num_layers, sum(ranks))
        # A row of a module's B never has the null row; padding rows carry none of their own.
        padding = table.b_widths == 0
        assert torch.equal(padding, ~b_want.any(dim=-1))
        assert not table.a_starts[padding].any() and not table.b_starts[padding].any()


def test_group_no_adapter_adapts_is_none(pool_and_adapters: PoolAndAdapters) -> None:
    _, placed = pool_and_adapters
    assert "o" not in resident(placed, ["regex"]).step_tables(["regex"])  # regex adapts up and k
    assert "o" not in resident(placed, ["regex", "qv-r8"]).step_tables(["regex"])  # qv-r8's is not the step's
    assert resident(placed, list(VARIANTS)).step_tables([]) == {}


def test_layer_padding_rows(pool_and_adapters: PoolAndAdapters) -> None:
    """An adapter with more ranks in one layer than another pads the other: width 0 there."""
    _, placed = pool_and_adapters
    table = compacted(resident(placed, ["layer1-only"]).step_tables(["layer1-only"])["qkv"])
    # k at rank 2, in layer 1 only
    assert table.b_widths.tolist() == [[0, 0], [32, 32]]
    assert table.b_cols.tolist() == [[0, 0], [64, 64]]  # k's columns follow q's 64


@pytest.mark.parametrize("form", ["reference", "kernel"])
def test_ops_on_tables_match_dense_stacks(
    pool_and_adapters: PoolAndAdapters, form: str, device: torch.device
) -> None:
    """Shrink then expand on the tables adds the same deltas as the dense-stack oracle
    (reference.lora_shrink_expand over gather_rows stacks), for every layer and group."""
    pool_rows, placed = pool_and_adapters
    order = list(VARIANTS)
    adapters = [placed[name] for name in order]
    token_slot = torch.tensor([0, 4, -1, 1, 2, 3, 0, 2, -1, 4, 1], dtype=torch.int32)
    shrink = lora_shrink.lora_shrink_tokens if form == "kernel" else reference.lora_shrink_tokens
    expand = lora_expand.lora_expand_tokens if form == "kernel" else reference.lora_expand_tokens
    generator = torch.Generator().manual_seed(1)
    # The kernels read the persistent tables themselves: other adapters' columns and freed holes around.
    tables = ResidentTables(TINY_SHAPE.num_layers, torch.device("cpu"), capacity=4)
    for name, like in (("spare", "regex"), *((n, n) for n in order), ("spare2", "qv-r8")):
        tables.add(name, adapter_meta(placed[like], TINY_SHAPE, HEAD_DIM))
    tables.remove("spare")
    for group, table in tables.step_tables(order).items():
        in_width, out_width = group_width(TINY_SHAPE, group)
        present = [(u, a) for u, a in enumerate(adapters) if group in a.a_rows]
        a_dense = reference.gather_rows(pool_rows, torch.cat([a.a_rows[group] for _, a in present], dim=1))
        b_dense = reference.gather_rows(pool_rows, torch.cat([a.b_rows[group] for _, a in present], dim=1))
        owner = torch.cat([torch.full((a.a_rows[group].shape[1],), u) for u, a in present])
        columns = (owner[None, :] == token_slot[:, None].long()).float()  # [T, C]
        for layer in range(TINY_SHAPE.num_layers):
            x = torch.randn(len(token_slot), in_width, generator=generator)
            y = torch.randn(len(token_slot), out_width, generator=generator)
            want = y.clone()
            reference.lora_shrink_expand(x, want, a_dense[layer], b_dense[layer], columns)
            got = y.to(device)
            t = table
            meta = LoRAKernelMeta(
                *(
                    v.to(device)
                    for v in (t.a_starts, t.b_starts, t.b_cols, t.b_widths, t.slot_start, t.slot_rank)
                ),
                max_rank=t.max_rank,
                token_slot=token_slot.to(device),
            )
            pool = pool_rows.to(device)
            shrunk = shrink(x.to(device), pool, meta, layer)
            expand(got, shrunk, pool, meta, layer)
            torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5, msg=f"{group} layer {layer}")


def test_random_heterogeneous_sets_equal_the_old_builder(pool_and_adapters: PoolAndAdapters) -> None:
    _, placed = pool_and_adapters
    rng = random.Random(3)
    names = list(VARIANTS)
    tables = resident(placed, names)
    for _ in range(30):
        order = [rng.choice(names) for _ in range(rng.randint(1, 12))]  # repeats: one adapter, many slots
        assert_same_tables(tables.step_tables(order), old_step_tables([placed[n] for n in order]))


def test_residency_churn_keeps_the_tables_right(pool_and_adapters: PoolAndAdapters) -> None:
    """Loads, evictions and reloads in random order (ranges freed, reused, the tables grown): every
    step's tables stay those of the old builder, and freed columns hold nothing once cleared."""
    _, placed = pool_and_adapters
    rng = random.Random(4)
    names = list(VARIANTS)
    tables = ResidentTables(TINY_SHAPE.num_layers, torch.device("cpu"), capacity=2)
    loaded: set[str] = set()
    for _ in range(60):
        name = rng.choice(names)
        if name in loaded and rng.random() < 0.5:
            tables.remove(name)
            loaded.discard(name)
        else:  # a load, or a reload of a resident adapter (its old range is replaced)
            tables.add(name, adapter_meta(placed[name], TINY_SHAPE, HEAD_DIM))
            loaded.add(name)
        if loaded:
            order = rng.sample(sorted(loaded), rng.randint(1, len(loaded)))
            assert_same_tables(tables.step_tables(order), old_step_tables([placed[n] for n in order]))
        # A removal is bookkeeping (the scheduler's reclaim touches no device); the loader zeroes the freed
        # columns before its next load, as here.
        tables.clear_freed()
        for table in tables.groups.values():
            assert set(table.ranges) <= loaded
            owned = torch.zeros(table.capacity, dtype=torch.bool)
            for start, size in table.ranges.values():
                assert not owned[start : start + size].any()  # no column owned twice
                owned[start : start + size] = True
            assert sum(size for _, size in table.free) == int((~owned).sum())  # none leaked
            assert not table.b_widths[:, ~owned].any() and not table.a_starts[:, ~owned].any()


def test_metadata_of_the_wrong_model_is_refused(pool_and_adapters: PoolAndAdapters) -> None:
    _, placed = pool_and_adapters
    tables = ResidentTables(TINY_SHAPE.num_layers + 1, torch.device("cpu"))
    with pytest.raises(ValueError, match="layers"):
        tables.add("regex", adapter_meta(placed["regex"], TINY_SHAPE, HEAD_DIM))
