"""Per-step metadata (model/step.py): each packed token's row, position, rank and cache slot."""

import pytest
import torch

from dsv41.model.step import CacheError, Step


def test_mixed_step_lists_each_token_of_each_row():
    # a decode row, a chunk of 3 and a restart, in an order that is not the slot order
    step = Step((3, 0, 5), (10, 7, 0), (1, 3, 2))
    assert step.offsets == (0, 1, 4)
    assert step.row.tolist() == [0, 1, 1, 1, 2, 2]
    assert step.positions.tolist() == [10, 7, 8, 9, 0, 1]
    assert step.token_rank.tolist() == [0, 0, 1, 2, 0, 1]
    assert step.token_slot.tolist() == [3, 0, 0, 0, 5, 5]
    assert step.slot_index.tolist() == [3, 0, 5]
    for t in (step.row, step.positions, step.token_rank, step.token_slot, step.slot_index):
        assert t.dtype == torch.int64
    assert step.ends == (11, 10, 2) and step.n_tokens == 6
    assert step.visible(4).tolist() == [2, 2, 2, 2, 0, 0]
    assert step.tokens_of(1) == slice(1, 4)


@pytest.mark.parametrize("slots, starts, counts", [((0, 0), (1, 2), (1, 1)), ((0,), (0,), (0,)),
                                                   ((0, 1), (0,), (1, 1)), ((), (), ())])
def test_malformed_steps_are_refused(slots, starts, counts):
    with pytest.raises(CacheError):
        Step(slots, starts, counts)
