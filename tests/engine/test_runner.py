"""How the batch groups decodes of similar context length into one attention call each."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from loraplex.engine.batch import group_decodes


@given(st.lists(st.integers(1, 200), max_size=64))
def test_groups_cover_every_decode_once_in_order(widths: list[int]) -> None:
    widths = sorted(widths, reverse=True)
    groups = group_decodes(widths)
    covered = [i for start, end in groups for i in range(start, end)]
    assert covered == list(range(len(widths)))
    assert all(end > start for start, end in groups)


def test_similar_widths_share_one_call_and_distant_ones_split() -> None:
    assert group_decodes([10, 10, 9, 9, 8, 8, 8, 8]) == [(0, 8)]
    assert group_decodes([40, 40, 39, 38, 10, 9, 9, 8]) == [(0, 4), (4, 8)]
    # Groups never shrink below four decodes: a lone short context rides with the others.
    assert group_decodes([40, 40, 40, 40, 2]) == [(0, 5)]
    assert group_decodes([]) == []
