"""Composing the advantage shapers' token weights (`training.shaping`): products, the narrower weights padded with 1,
the hidden-state readers' rows as a union of whole groups, and each reader's weights put back at its rows."""

from __future__ import annotations

import torch

from rlvr_lightning.context import AdvantageShaper
from rlvr_lightning.training.shaping import compose_token_weights, hidden_weigher, rollout_token_weights, shaper_metrics


class FixedWeights(AdvantageShaper):
    """Weighs every rollout batch with `weights`; asks for the hidden states of `rows` and weighs sequence n of
    those with `n + 2` on each of its positions."""

    def __init__(self, weights=None, rows=None, metrics=None) -> None:
        self.weights, self.rows, self.metrics = weights, rows, metrics or {}

    def token_weights(self, step, batch):
        return self.weights

    def hidden_rows(self, batch):
        return self.rows

    def weights_from_hidden(self, step, batch, hidden):
        return {n: torch.full((h.shape[0],), float(n + 2)) for n, h in hidden.items() if self.rows[n]}

    def batch_metrics(self):
        return self.metrics


def test_weights_compose_by_product_and_the_narrower_is_padded_with_one():
    a = torch.tensor([[2.0, 0.5], [1.0, 3.0]])
    b = torch.tensor([[0.5, 2.0, 4.0], [2.0, 1.0, 0.25]])
    assert torch.equal(compose_token_weights(a, b), torch.tensor([[1.0, 1.0, 4.0], [2.0, 3.0, 0.25]]))
    assert compose_token_weights(None, b) is b and compose_token_weights(a, None) is a
    assert compose_token_weights(None, None) is None


def test_every_shapers_weights_of_a_rollout_batch_multiply():
    shapers = [FixedWeights(torch.tensor([[2.0]])), FixedWeights(None), FixedWeights(torch.tensor([[3.0, 0.5]]))]
    assert torch.equal(rollout_token_weights(None, None, shapers), torch.tensor([[6.0, 0.5]]))
    assert rollout_token_weights(None, None, [FixedWeights(None)]) is None


def test_the_hidden_readers_rows_are_their_union_and_each_readers_weights_land_on_its_rows():
    first = FixedWeights(rows=torch.tensor([True, True, False, False]))
    second = FixedWeights(rows=torch.tensor([False, False, True, True]))
    assert hidden_weigher(None, None, [FixedWeights()]) is None  # nobody reads hidden states
    weigher = hidden_weigher(None, None, [first, FixedWeights(), second])
    assert weigher.readers == [first, second] and weigher.needed.tolist() == [True] * 4
    assert weigher.needs_any(torch.tensor([2])) and not hidden_weigher(None, None, [first]).needs_any(torch.tensor([3]))
    hidden = {0: torch.zeros(2, 4), 3: torch.zeros(3, 4)}  # rows 0 and 3 of a forward over rows [3, 0]
    weights = weigher.weights(hidden, [3, 0], width=4)
    # row 3 (asked for by `second`) weighs 5 on its 3 positions, row 0 (by `first`) 2 on its 2; 1 elsewhere
    assert weights.tolist() == [[5.0, 5.0, 5.0, 1.0], [2.0, 2.0, 1.0, 1.0]]


def test_the_shapers_metrics_are_merged():
    assert shaper_metrics([FixedWeights(metrics={"thr/a": 1.0}), FixedWeights(metrics={"oar/b": 2.0})]) == {"thr/a": 1.0, "oar/b": 2.0}
