"""Does THR's sign mean what it says? A first-order check on a real policy.

For one scored rollout with advantages: split the response tokens of its mixed groups by the sign
of THR, take one small gradient step of the policy-gradient objective Σ Â·log π restricted to each
subset, and measure the change of J = Σ_{tokens of correct rollouts} log π. THR's claim: the
THR > 0 step raises J and the THR < 0 step lowers it. THR is exact to first order for a step of the
LM head alone (up to the V* restriction); for a step of every parameter it is an approximation,
which is what this measures.
"""

from __future__ import annotations

import torch

from rlvr_lightning.attribution.thr import rollout_thr
from rlvr_lightning.models.forward import policy_forward
from rlvr_lightning.models.lm_head import PolicyHead
from rlvr_lightning.rollout.types import Rollout


def thr_sign_check(
    policy: torch.nn.Module, rollout: Rollout, advantages: torch.Tensor, pad_id: int, lr: float = 1e-3,
    params: str = "all",
) -> dict[str, float]:
    """ΔJ after a step on the THR > 0 tokens (`positive`) and on the THR < 0 tokens (`negative`).

    Args:
        policy: an HF causal LM; restored to its original weights on return.
        rollout: scored (`correct`).
        advantages: its sequence advantages [N].
        pad_id: the tokenizer's pad id.
        lr: SGD step size.
        params: `all` parameters, or `head` (the output embedding only).
    """
    t = rollout.tensors(pad_id)
    T_roll = rollout.sampling.temperature
    with torch.no_grad():
        clean = policy_forward(policy, t, T_roll, capture_lm_head=True)
    logp0 = clean.logp
    lengths = t.response_mask.sum(1).long().tolist()
    hidden = {n: clean.lm_head_in[n, : lengths[n]] for n in range(len(lengths))}
    thr_tok = torch.zeros_like(t.response_mask)
    G = rollout.group_size
    for gs in rollout_thr(rollout, advantages, hidden, PolicyHead(policy)):
        group_lengths = lengths[gs.group * G : (gs.group + 1) * G]
        for j, thr_j in enumerate(gs.per_response(gs.thr, group_lengths, fill=0.0)):  # inserted tokens: no THR
            thr_tok[gs.group * G + j, : len(thr_j)] = thr_j
    correct_tok = rollout.correct.float()[:, None] * t.response_mask
    adv_tok = advantages.float()[:, None] * t.response_mask
    j0 = (logp0 * correct_tok).sum()
    # "all": what trains (a LoRA policy's adapters; autograd refuses its frozen base weights).
    weights = [policy.get_output_embeddings().weight] if params == "head" else [p for p in policy.parameters() if p.requires_grad]
    out = {}
    for name, subset in (("positive", thr_tok > 0), ("negative", thr_tok < 0)):
        logp = policy_forward(policy, t, T_roll).logp
        objective = (adv_tok * subset * logp).sum()
        grads = torch.autograd.grad(objective, weights, allow_unused=True)
        saved = [w.detach().clone() for w in weights]
        with torch.no_grad():
            for w, g in zip(weights, grads):
                if g is not None:
                    w += lr * g  # ascent on Σ Â·log π over the subset
            logp1 = policy_forward(policy, t, T_roll).logp
            out[name] = ((logp1 * correct_tok).sum() - j0).item()
            for w, s in zip(weights, saved):
                w.copy_(s)
        out[f"{name}_tokens"] = float(subset.sum())
    return out
