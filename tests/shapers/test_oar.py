"""OAR as an advantage shaper (`shapers.oar`, docs/algorithms.md#oar-in-the-training-step): inside a real module's
step it weighs reasoning tokens only, with mean 1; its weights and THR's multiply; a zero floor is refused; OAR-G's
noise belongs to the rollout and the rank; in an environment it weighs the model's own reasoning only."""

from __future__ import annotations

import pytest
import torch

from tests.attribution.test_oar import ids


def boxed_rollout(module):
    from rlvr_lightning.rollout.types import Completion, PromptBatch, Rollout, SamplingConfig

    tok = module.trainer.datamodule.tokenizer
    prompts = ["What is 3+4-2?\n", "What is 10+1+5?\n"]
    texts = ["3+4=7,7-2=5.\\boxed{5}", "3+4=7,7-2=6.\\boxed{6}", "3+4=8.\\boxed{8}", "3+4=7,7-2=5. Answer:5",
             "10+1=11,11+5=16.\\boxed{16}", "10+1=11.\\boxed{11}", "\\boxed{3}", "10+1=12,12+5=17.\\boxed{17}"]  # fmt: skip
    completions = [Completion(ids(tok, t) + [tok.eos_token_id], [0.0] * (len(ids(tok, t)) + 1), "stop") for t in texts]
    correct = torch.tensor([1.0, 0, 0, 0, 1, 0, 0, 1])
    return Rollout(
        batch=PromptBatch(["a", "b"], prompts, ["5", "16"]), group_size=4, prompt_ids=[ids(tok, p) for p in prompts],
        completions=completions, sampling=SamplingConfig(group_size=4, max_tokens=40), policy_version=0, texts=texts,
        correct=correct,
    )  # fmt: skip


@pytest.mark.parametrize("method", ["gradient", "perturbation"])
def test_oar_weights_reasoning_tokens_only_with_mean_one(tiny_policy_dir, method):
    from rlvr_lightning.algos import GRPO
    from tests.support.update_harness import attach

    module = attach(GRPO, tiny_policy_dir, shapers={"oar": {"method": method}})
    rollout = boxed_rollout(module)
    scored, inputs, metrics = module.rlvr_step.prepare(module.step_context(), rollout)
    w = inputs.token_weights()
    tok = module.trainer.datamodule.tokenizer
    for n, text in enumerate(rollout.texts):
        R = len(ids(tok, text[: text.rfind("\\boxed{")])) if "\\boxed{" in text else 0
        L_n = len(rollout.completions[n].token_ids)
        if R > 1:  # scored: mean 1 over the reasoning tokens, 1 on conclusion, answer and EOS
            assert w[n, :R].mean().item() == pytest.approx(1.0, abs=1e-5), text
            assert (w[n, R:L_n] == 1).all()
        else:  # no box ("Answer:5"), or nothing before the box
            assert (w[n] == 1).all(), text
    assert (w > 0).all()
    adv = inputs.advantages
    assert (torch.sign(adv) == torch.sign(scored.advantages[:, None] * inputs.tensors.response_mask)).all()
    (oar,) = module.rlvr_step.shapers
    assert oar.batch_metrics()["oar/no_answer_span_frac"] == pytest.approx(2 / 8)  # "Answer:5" and "\boxed{3}"


def test_thr_and_oar_compose_multiplicatively(tiny_policy_dir):
    from rlvr_lightning.algos import GRPO
    from tests.support.update_harness import attach

    def weights(**shapers):
        module = attach(GRPO, tiny_policy_dir, shapers=shapers)
        step = module.step_context()
        _, inputs, _ = module.rlvr_step.prepare(step, boxed_rollout(module))
        module.rlvr_step.update.accumulate_gradients(step, inputs, torch.arange(8), module.manual_backward)  # THR scores in the update's forward
        return inputs.token_weights()

    thr, oar = {"p": 0.3, "threshold": "all"}, {"method": "perturbation"}
    torch.testing.assert_close(weights(thr=thr, oar=oar), weights(thr=thr) * weights(oar=oar))


def test_oar_refuses_a_zero_floor():
    """floor = 0 would give the least important reasoning token weight exactly 0 (weights must stay > 0)."""
    from rlvr_lightning.errors import ConfigError
    from rlvr_lightning.shapers.settings import OARSettings

    with pytest.raises(ConfigError, match="^model.shapers.oar needs 0 < q < 1, beta ≥ 0, 0 < floor ≤ 1"):
        OARSettings(method="gradient", floor=0.0).check()
    OARSettings(method="gradient", floor=1e-3).check()


def test_oar_g_noise_belongs_to_the_rollout_and_the_rank():
    """A rollout's noise does not depend on which other rollouts are scored, and ranks draw different noise."""
    from rlvr_lightning.shapers.oar import oar_noise_generators

    def first_draw(rows, rank=0, row=5):
        gens = oar_noise_generators(data_seed=0, step=3, rank=rank, rows=rows)
        return torch.randn(4, generator=gens[rows.index(row)])

    alone = first_draw([5])
    assert torch.equal(first_draw([1, 2, 5]), alone)  # two more rollouts scored before it
    assert not torch.equal(first_draw([5], rank=1), alone)
    assert not torch.equal(first_draw([1, 5], row=1), alone)  # different rollouts, different noise


@pytest.mark.parametrize("method", ["gradient", "perturbation"])
def test_in_an_environment_oar_weighs_the_models_own_reasoning_and_reads_its_own_box(tiny_policy_dir, method):
    """Tokens an environment inserted into the reasoning are context: they weigh exactly 1, and the sampled reasoning
    tokens alone are reshaped to mean 1. A box only a tool printed is not the model's answer: nothing is reshaped.
    Other rollouts' weights are those of the batch without inserted tokens."""
    from dataclasses import replace

    from rlvr_lightning.algos import GRPO
    from tests.support.update_harness import attach

    def weights(rollout):
        module = attach(GRPO, tiny_policy_dir, shapers={"oar": {"method": method}})
        return module.rlvr_step.prepare(module.step_context(), rollout)[1].token_weights()

    module = attach(GRPO, tiny_policy_dir)
    plain = boxed_rollout(module)
    completions = list(plain.completions)
    first, second = completions[0], completions[1]  # "3+4=7,7-2=5.\boxed{5}", "3+4=7,7-2=6.\boxed{6}"
    first_sampled = [not 4 <= i < 7 for i in range(len(first.token_ids))]  # "7,7" inserted
    box = len(plain.texts[1].split("\\boxed{")[0])
    second_sampled = [i < box for i in range(len(second.token_ids))]  # its box printed by a tool
    completions[0] = replace(first, sampled_mask=first_sampled)
    completions[1] = replace(second, sampled_mask=second_sampled)
    w, w_plain = weights(replace(plain, completions=completions)), weights(plain)
    reasoning = 12  # "3+4=7,7-2=5."
    own = [i for i in range(reasoning) if first_sampled[i]]
    assert (w[0, 4:7] == 1).all() and w[0, own].mean().item() == pytest.approx(1.0, abs=1e-5)
    assert (w[0, own] != 1).any() and (w[0, reasoning:] == 1).all()
    assert (w[1] == 1).all()
    if method == "gradient":  # rollouts in a batch are independent: exactly
        assert torch.equal(w[2:], w_plain[2:])
    else:  # the perturbed copies of all rollouts share batches (ordered by column, each batch recomputing from its
        # first perturbed column): other rows' masks change the batches, hence the rounding, which the divergences'
        # differences amplify and near-tied tokens' weights follow (up to 0.013 on a Sapphire Rapids Xeon with the
        # pinned AVX2 kernels; exact on others): the same weights, to rounding
        torch.testing.assert_close(w[2:], w_plain[2:], rtol=0, atol=3e-2)
