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
