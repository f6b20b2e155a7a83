"""A rollout batch as the update reads it (`training.batch`): a micro-batch's rows cut to its forward's width, and
an optimizer step's normalisers (N_S sequences, T_S loss tokens, B prompts, M rollouts in mixed groups) counted on
hand-checkable tensors and summed over ranks."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from rlvr_lightning.context import Collectives
from rlvr_lightning.training.batch import UpdateInputs, optimizer_step_norms, select_loss_batch

G = 2
LOSS_MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
CORRECT = torch.tensor([1.0, 0.0, 1.0, 1.0])  # group 0 mixed, group 1 all correct


def inputs() -> UpdateInputs:
    values = torch.arange(16.0).view(4, 4)
    return UpdateInputs(None, values, values + 100, LOSS_MASK, None, CORRECT, G, 1.0, None)


def test_a_micro_batch_takes_its_rows_cut_to_its_forwards_width():
    tensors = SimpleNamespace(response_mask=torch.ones(2, 3))  # the forward over rows 2 and 3 is 3 tokens wide
    old = torch.full((2, 4), -1.0)
    mb = select_loss_batch(inputs(), torch.tensor([2, 3]), tensors, old)
    assert mb.advantages.tolist() == [[8.0, 9.0, 10.0], [12.0, 13.0, 14.0]] and mb.ref_logp[0, 0] == 108.0
    assert mb.loss_mask.tolist() == [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]] and mb.old_logp.shape == (2, 3)
    assert mb.is_weight is None and mb.correct.tolist() == [1.0, 1.0] and mb.group_size == G
    reshaped = select_loss_batch(inputs(), torch.tensor([2, 3]), tensors, old, advantages=torch.ones(2, 4))
    assert reshaped.advantages.tolist() == [[1.0] * 3] * 2  # the update's reshaped advantages, cut the same way


def test_an_optimizer_steps_normalisers_are_counted_and_summed_over_ranks():
    norms = optimizer_step_norms(inputs(), torch.arange(4), Collectives(), norm_const=4.0)
    assert (norms.num_seqs, norms.num_tokens, norms.num_groups, norms.num_mixed_seqs) == (4, 10, 2, 2)
    assert norms.world_size == 1 and norms.norm_const == 4.0

    def reduce(tensor, reduce_op):  # another rank holding the same counts
        return tensor * 2

    two = optimizer_step_norms(inputs(), torch.arange(2), Collectives(2, 0, reduce), norm_const=4.0)  # group 0 only
    assert (two.num_seqs, two.num_tokens, two.num_groups, two.num_mixed_seqs, two.world_size) == (4, 8, 2, 4, 2)
