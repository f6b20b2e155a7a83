"""Tokens an environment inserts into a response (a tool's output, tokenized by the library) are context
only: the trained ids are exactly the sampled ids with the inserted ids between them, and the inserted tokens
get exactly zero gradient, no KL and no normaliser count, through the real loss path of each kind of loss."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from rlvr_lightning.algos import GRPO, REAL
from rlvr_lightning.training.batch import optimizer_step_norms
from tests.algos.test_base import G, attach, gradient, prepared, sample_rollout

# Per completion of `sample_rollout` (lengths 2, 8, 5, 8, 3, 6, 8, 4): which response tokens an environment
# inserted (0), the rest sampled (1). Rows 2 and 7 are untouched.
SAMPLED = {1: [1, 1, 0, 0, 0, 1, 1, 1], 3: [1, 0, 1, 1, 0, 0, 1, 1], 4: [1, 0, 1], 5: [0, 1, 1, 1, 0, 1], 6: [1, 1, 1, 1, 1, 1, 0, 0]}


def with_inserted_tokens(rollout):
    completions = list(rollout.completions)
    for n, sampled in SAMPLED.items():
        c = completions[n]
        assert len(sampled) == len(c.token_ids)
        logprobs = [lp if s else 0.0 for lp, s in zip(c.logprobs, sampled)]  # an inserted token has no engine log-prob
        completions[n] = replace(c, logprobs=logprobs, sampled=sampled)
    return replace(rollout, completions=completions)


def test_the_trained_ids_are_the_sampled_and_inserted_ids_in_order_and_only_sampled_ones_are_trained(tiny_policy_dir):
    module = attach(GRPO, tiny_policy_dir)
    rollout = with_inserted_tokens(sample_rollout(module))
    t = rollout.tensors(pad_id=0)
    for n, c in enumerate(rollout.completions):
        L = len(c.token_ids)
        assert t.input_ids[n, t.prompt_width : t.prompt_width + L].tolist() == c.token_ids
        expected = torch.tensor(SAMPLED.get(n, [1] * L), dtype=torch.float32)
        assert torch.equal(t.loss_mask[n, :L], expected) and t.loss_mask[n, L:].sum() == 0
        assert torch.equal(t.response_mask[n, :L], torch.ones(L))  # present (attended to) all the same
    assert torch.equal(t.trimmed().loss_mask, t.loss_mask[:, : t.trimmed().response_mask.shape[1]])
    plain = sample_rollout(module).tensors(pad_id=0)
    assert plain.sampled_mask is None and torch.equal(plain.loss_mask, plain.response_mask)


@pytest.mark.parametrize(
    "cls, kwargs",
    [
        (GRPO, {}),  # per-token clipped loss, seq-mean-token-mean
        (GRPO, {"policy_loss": "gspo", "loss_agg": "seq-mean-token-mean"}),  # one ratio per sequence
        (GRPO, {"loss_agg": "seq-mean-token-sum", "kl_estimator": "k3", "kl_coef": 0.1,
                "policy_loss": {"name": "ppo-clip", "knobs": {"dual_clip_c": 3.0}}}),  # KL
        (REAL, {"num_mini_batches": 1}),  # group-level loss over sequence log-ratios
    ],
    ids=["grpo", "gspo", "kl", "real"],
)
def test_inserted_tokens_get_exactly_zero_gradient_through_the_real_update(tiny_policy_dir, cls, kwargs):
    """The LM head's input at the position that predicts an inserted token gets exactly zero gradient (nothing
    of the loss reads that token's log-prob), while the positions that predict sampled tokens do get one."""
    module = attach(cls, tiny_policy_dir, **kwargs)
    rollout = with_inserted_tokens(sample_rollout(module))
    inputs = prepared(module, rollout)
    for n, sampled in SAMPLED.items():  # nothing inserted enters the loss
        assert torch.equal(inputs.loss_mask[n, : len(sampled)], torch.tensor(sampled, dtype=torch.float32))
    norms = optimizer_step_norms(inputs, torch.arange(2 * G), module.step_context().collectives, 1.0)
    assert norms.num_tokens == 44 - 11  # the token normaliser counts the 33 sampled tokens of the 44
    head_inputs = []

    def keep_grad(_module, args):
        args[0].retain_grad()
        head_inputs.append(args[0])

    hook = module.policy.get_output_embeddings().register_forward_pre_hook(keep_grad)
    try:
        gradient(module, inputs, micro_batch_size=2 * G)
    finally:
        hook.remove()
    (hidden,) = [h for h in head_inputs if h.grad is not None]  # [N, T+1, d]: column j predicts response token j
    per_token = hidden.grad[:, :-1].abs().sum(-1)
    T = per_token.shape[1]
    inserted = (inputs.tensors.response_mask - inputs.tensors.loss_mask)[:, :T].bool()
    assert inserted.sum() == sum(s.count(0) for s in SAMPLED.values())
    assert torch.all(per_token[inserted] == 0)  # exactly
    trained = inputs.loss_mask[:, :T].bool()
    assert (per_token[trained] > 0).float().mean() > 0.5  # the sampled tokens are trained
