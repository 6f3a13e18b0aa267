"""`scripts/schedule_model.py`: the model behind the Hopper forward's causal claims and its
longest-first order (docs/decisions.md). Its pieces are checked by hand-counted cases, and
the conclusion the change rests on is checked on every row it lists: claims in the
longest-first order end no later than one program an item, in either order."""

import pytest

from inputs import script

model = script("schedule_model")


def test_a_causal_heads_items_see_their_key_tiles():
    assert model.item_work(512, 128, 128) == [1.0, 2.0, 3.0, 4.0]
    assert model.item_work(1000, 128, 128)[-1] == 8.0  # the last tile: rows 896-999
    assert model.item_work(384, 192, 128) == [2.0, 3.0]  # 192-row items, 128-key tiles


def test_the_orders_keep_every_item_and_put_the_longest_first():
    work = [1.0, 2.0, 3.0]
    assert model.order(2, work, 1) == [3.0, 2.0, 1.0, 3.0, 2.0, 1.0]  # a head at a time
    assert model.order(2, work, 2) == [3.0, 3.0, 2.0, 2.0, 1.0, 1.0]  # across both
    # a last section of fewer heads (3 heads in sections of 2)
    assert model.order(3, work, 2) == [3.0, 3.0, 2.0, 2.0, 1.0, 1.0, 3.0, 2.0, 1.0]
    assert sorted(model.order(5, work, 4)) == sorted(work * 5)


def test_the_grids_count_what_one_program_would_do_alone():
    items = [3.0, 1.0, 2.0]
    assert model.greedy(items, 1, 0.5) == 7.5  # everything, with an overhead an item
    assert model.fixed_shares(items, 1, 0.5) == 7.5
    assert model.greedy(items, 2, 0.0) == 3.0  # 3 | 1 then 2
    assert model.fixed_shares(items, 2, 0.0) == 5.0  # items 0 and 2 on program 0


@pytest.mark.parametrize("row", sorted(model.ROWS))
def test_claims_in_the_longest_first_order_end_no_later_than_one_program_an_item(row):
    result = model.makespans(*model.ROWS[row], overhead=1.0, hidden=0.15, section=16)
    assert all(ratio >= 1.0 - 1e-9 for ratio in result.values()), result  # the ideal bounds
    claims = result["claims, longest first in sections"]
    assert claims <= result["one program an item, head's tiles together"], result
    assert claims <= result["one program an item, longest first in sections"], result


def test_the_kernels_causal_item_map_gives_every_tile_once_the_longest_first():
    # `forward_kernel._item`'s dense causal map, transcribed: sections of every size against
    # the heads (one, a divisor, not a divisor: a last section of fewer pairs, more than all)
    for pairs, tiles in ((1, 1), (1, 32), (7, 5), (128, 32), (12, 3)):
        for section in (1, 2, 3, 4, 16, 1 << 20):
            assert model.check_causal_items(pairs, tiles, section) == "ok", (pairs, tiles,
                                                                             section)
    # section 1 is the order before: a head's tiles together, the longest first
    assert [model.causal_item(t, 6, 3, 1) for t in range(6)] == [
        (0, 2), (0, 1), (0, 0), (1, 2), (1, 1), (1, 0)]
    # it sees a wrong map: the last section's pairs counted as a full section's
    right = model.causal_item

    def full_sections(t, n_items, n_tiles_m, section):
        first = t // (section * n_tiles_m) * section
        rank, pair = divmod(t - first * n_tiles_m, section)
        return first + pair, n_tiles_m - 1 - rank
    model.causal_item = full_sections
    try:
        assert model.check_causal_items(7, 5, 4) != "ok"
    finally:
        model.causal_item = right


def test_a_section_is_a_power_of_two_of_kv_heads_that_fit_times_their_group():
    from fusedattn.hopper import forward as knobs

    mib = 1 << 20
    # K and V of 4096 keys at D128 + Dv128 in bf16: 2 MiB a kv head
    assert knobs.lpt_section(4096, 256, 2, 1, 8 * mib) == 4
    assert knobs.lpt_section(4096, 256, 2, 1, 7 * mib) == 2  # 3 fit: the power of two below
    assert knobs.lpt_section(4096, 256, 2, 4, 8 * mib) == 16  # GQA: 4 query heads each
    assert knobs.lpt_section(1 << 20, 256, 2, 1, 8 * mib) == 1  # none fits: one
    assert knobs.lpt_section(0, 256, 2, 1, 8 * mib) >= 1  # (no keys: no division by zero)
