"""A GRPO-family module on the tiny real model, wired to a bare Trainer without fitting, and what its update step's
tests build on it: a sampled rollout of random tokens (three answers cut at `MAX_LEN`), the module's own update
inputs, one optimizer step's loss and gradient under a chosen micro-batch layout, θ_old's log-probs from the
trainer's separate pass, and every sequence's log-probs from an independent forward. `PRESETS`: the algorithms
and pieces these tests run on GRPO's step."""

from __future__ import annotations

import torch

from rlvr_lightning.algos import DAPO, GRPO, GSPO, DrGRPO
from rlvr_lightning.data.datamodule import RolloutDataModule
from rlvr_lightning.rollout.settings import RolloutSettings
from rlvr_lightning.rollout.types import Completion, PromptBatch, Rollout, SamplingConfig
from rlvr_lightning.standalone import standalone
from rlvr_lightning.training.behaviour import Precomputed, separate_pass
from tests.support.settings import resettle

G, MAX_LEN = 4, 8


PRESETS = {
    "grpo": (GRPO, {}),
    "dr-grpo": (DrGRPO, {}),
    "dapo": (DAPO, {}),
    "gspo": (GSPO, {}),
    "gspo-token": (GSPO, {"policy_loss": {"name": "gspo-token", "knobs": {"clip_eps_low": 3e-4, "clip_eps_high": 4e-4}}}),
    # The newer pieces on GRPO's step, with their presets' knobs (configs/algo/<name>.yaml).
    "cispo": (GRPO, {"policy_loss": {"name": "cispo", "knobs": {"clip_eps_low": 1.0, "clip_eps_high": 0.28}},
                     "loss_agg": "token-mean"}),
    "gmpo": (GRPO, {"policy_loss": {"name": "gmpo", "knobs": {"clip_eps_low": 0.4, "clip_eps_high": 0.4}}}),
    "sapo": (GRPO, {"policy_loss": "sapo"}),
    # An estimator that reads more than the rewards (the lengths, a reduction); RLOO's and pass@k's are
    # functions of the rewards alone, tested in tests/pieces/test_advantages.py.
    "reinforce-pp": (GRPO, {"advantage_estimator": "reinforce-pp", "loss_agg": "token-mean"}),
    # Token selections over the whole step, at shares large enough that many of the 40 tokens are taken.
    "clip-cov": (GRPO, {"policy_loss": {"name": "clip-cov", "knobs": {"clip_cov_ratio": 0.3, "clip_cov_lb": 0.0,
                                                                     "clip_cov_ub": 100.0}},
                        "loss_agg": "token-mean"}),
    "kl-cov": (GRPO, {"policy_loss": {"name": "kl-cov", "knobs": {"kl_cov_ratio": 0.3}}, "loss_agg": "token-mean"}),
    "dppo-tv": (GRPO, {"policy_loss": {"name": "dppo-tv", "knobs": {"clip_eps_low": 0.15, "clip_eps_high": 0.15}},
                       "loss_agg": "token-mean"}),
    "maxrl": (GRPO, {"advantage_estimator": "maxrl"}),
    "dro": (GRPO, {"policy_loss": "dro", "loss_agg": "token-mean"}),
    # This year's knobs together: the dual clip, the sum aggregation and Kimi's regulariser to θ_old.
    "composed": (GRPO, {"loss_agg": "seq-mean-token-sum", "kl_estimator": "kimi", "kl_coef": 0.01,
                        "policy_loss": {"name": "ppo-clip", "knobs": {"dual_clip_c": 3.0}}}),
}


def attach(cls, tiny_policy_dir, rollout_kwargs=None, **model_kwargs):
    """A module wired to a bare Trainer and a RolloutDataModule (tokenizer, lengths), without fitting."""
    rollout = RolloutSettings(**{"max_response_length": MAX_LEN, "group_size": G, **(rollout_kwargs or {})})
    dm = RolloutDataModule(model_name_or_path=str(tiny_policy_dir), batch_size=2, rollout=rollout)
    return standalone(cls(**model_kwargs), dm)


def sample_rollout(module, seed=0) -> Rollout:
    """Two prompts × G completions of random tokens (any token sequence has a log-prob under the policy)."""
    tok = module.trainer.datamodule.tokenizer
    prompts = ["What is 3+4-2?\n", "What is 10+1+5?\n"]
    prompt_ids = [tok(p, add_special_tokens=False).input_ids for p in prompts]
    g = torch.Generator().manual_seed(seed)
    completions = []
    for L_n in (2, 8, 5, 8, 3, 6, 8, 4):  # three hit MAX_LEN: truncated
        ids = torch.randint(3, 60, (L_n,), generator=g).tolist()
        completions.append(Completion(ids, [0.0] * L_n, "length" if L_n == MAX_LEN else "stop"))
    correct = torch.tensor([1.0, 0, 0, 1, 0, 0, 1, 0])
    return Rollout(
        batch=PromptBatch(["a", "b"], prompts, ["5", "16"]), group_size=G, prompt_ids=prompt_ids,
        completions=completions, sampling=SamplingConfig(group_size=G, max_tokens=MAX_LEN), policy_version=0,
        texts=[""] * 8, correct=correct,
    )  # fmt: skip


def set_engine_logprobs(rollout: Rollout, per_token: torch.Tensor) -> None:
    for n, comp in enumerate(rollout.completions):
        comp.logprobs = per_token[n, : len(comp.token_ids)].tolist()


def prepared(module, rollout):
    """The module's own rewards, advantages and update inputs of a scored rollout."""
    return module.rlvr_step.prepare(module.step_context(), rollout)[1]


def gradient(module, inputs, micro_batch_size, acc=None, max_tokens=None, tweak=None):
    """One optimizer step's loss and accumulated gradient over every sequence of `inputs`, with
    micro-batches of `micro_batch_size` rows, or by token budget `max_tokens`; `tweak(update)` may
    adjust or instrument the module's update before it runs."""
    resettle(module, micro_batch_size=micro_batch_size, max_tokens_per_micro_batch=max_tokens)
    module.policy.zero_grad(set_to_none=True)
    rows = torch.arange(inputs.correct.shape[0])
    update = module.rlvr_step.update
    if tweak is not None:
        tweak(update)
    loss = update.accumulate_gradients(module.step_context(), inputs, rows, module.manual_backward, acc)
    return loss, torch.cat([p.grad.flatten() for p in module.policy.parameters() if p.grad is not None])


def trainer_old_logp(module, inputs, micro_batch_size=8):
    """θ_old's log-probs from the trainer's separate no-grad pass."""
    layout = lambda rows, _whole_groups: list(rows.split(micro_batch_size))  # noqa: E731
    return separate_pass(
        module.policy, None, inputs.tensors, inputs.temperature, layout, module.settings.compute.logprob_chunk_tokens,
        with_old=True,
    )[0]


def with_old_logp(inputs, old_logp):
    """`inputs` with θ_old's log-probs given before the update (e.g. off-policy ones)."""
    return inputs.with_behaviour(Precomputed(old_logp, "trainer"))


def independent_logprobs(policy, rollout: Rollout, grad: bool = False) -> torch.Tensor:
    """[N, MAX_LEN] log π(y_t | prompt, y_<t) at the rollout's temperature, 0 on padding: every sequence
    alone, unpadded, from the model's full logits (no `policy_forward`, layout, chunked head or θ_old strategy)."""
    out = torch.zeros(rollout.num_sequences, MAX_LEN)
    with torch.set_grad_enabled(grad):
        for n, comp in enumerate(rollout.completions):
            prompt, L = rollout.prompt_ids[n // rollout.group_size], len(comp.token_ids)
            logits = policy(input_ids=torch.tensor([prompt + comp.token_ids])).logits[0, len(prompt) - 1 : -1]
            logp = (logits.double() / rollout.sampling.temperature).log_softmax(-1)
            out[n, :L] = logp.gather(-1, torch.tensor(comp.token_ids)[:, None]).squeeze(1).float()
    return out
