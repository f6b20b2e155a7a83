"""How one rollout batch's update is laid out (`training.layout`): micro-batches of rows or by token budget, whole
groups where asked, and as many on this rank as the rank that needs the most (every rank runs the same forwards)."""

from __future__ import annotations

import torch

from rlvr_lightning.context import Collectives
from rlvr_lightning.training.layout import UpdateLayout

# Eight sequences in groups of 2: [prompt, response] real tokens.
COUNTS = torch.tensor([[4, 6], [4, 2], [3, 8], [3, 8], [5, 1], [5, 3], [2, 2], [2, 4]])


def layout(micro_batch_size: int = 2, max_tokens: int | None = None) -> UpdateLayout:
    return UpdateLayout(1, 1, micro_batch_size, max_tokens, 64, 1.0, 8.0)


def covered(batches: list[torch.Tensor]) -> list[int]:
    return sorted(int(r) for b in batches for r in b)


def test_rows_split_by_the_micro_batch_size_in_order():
    batches = layout(3).micro_batches(torch.arange(8), COUNTS, Collectives())
    assert [b.tolist() for b in batches] == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_a_token_budget_keeps_groups_whole_fits_every_forward_and_covers_each_row_once():
    budget = 2 * (3 + 8)  # one group of the longest sequences
    batches = layout(max_tokens=budget).micro_batches(torch.arange(8), COUNTS, Collectives(), unit=2)
    assert covered(batches) == list(range(8))
    for b in batches:
        assert all(int(r) // 2 * 2 in b.tolist() and int(r) // 2 * 2 + 1 in b.tolist() for r in b)  # whole groups
        prompt, response = COUNTS[b].amax(0).tolist()
        assert len(b) * (prompt + response) <= budget


def test_every_rank_runs_as_many_micro_batches_as_the_rank_that_needs_the_most():
    other_rank_needs = 4  # one micro-batch per group: at most as many as this rank has groups

    def reduce(tensor, reduce_op):  # the other rank's count arrives in the all-reduce
        assert reduce_op == "max"
        return torch.maximum(tensor, torch.tensor(other_rank_needs))

    alone = layout(max_tokens=64).micro_batches(torch.arange(8), COUNTS, Collectives(), unit=2)
    agreed = layout(max_tokens=64).micro_batches(torch.arange(8), COUNTS, Collectives(2, 0, reduce), unit=2)
    assert len(alone) < other_rank_needs == len(agreed) and covered(agreed) == list(range(8))


def test_groups_stay_whole_with_a_token_budget_or_rows_a_multiple_of_the_group():
    assert layout(max_tokens=100).keeps_groups_whole(4) and layout(8).keeps_groups_whole(4)
    assert not layout(6).keeps_groups_whole(4)
