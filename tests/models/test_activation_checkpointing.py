"""`model.compute.activation_checkpointing` recomputes each decoder layer in the backward pass, with the policy
in eval mode (as it trains), and leaves the gradient unchanged."""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlvr_lightning.models.policy import load_policies


def test_checkpointed_layers_recompute_in_eval_mode_and_keep_the_gradient(tmp_path):
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, use_cache=False)  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    ids = torch.randint(0, 64, (2, 8))
    grads, forwards = {}, {}
    for checkpointing in (False, True):
        policy, _ = load_policies(str(tmp_path), with_reference=False, activation_checkpointing=checkpointing)
        assert not policy.training  # the policy trains in eval mode (no dropout)
        calls, mlp = [], policy.model.layers[0].mlp
        run = mlp.forward  # (forward hooks do not fire when the checkpoint recomputes)
        mlp.forward = lambda h, run=run, calls=calls: (calls.append(1), run(h))[1]
        policy(input_ids=ids).logits.float().logsumexp(-1).sum().backward()
        grads[checkpointing] = [p.grad for p in policy.parameters()]
        forwards[checkpointing] = len(calls)
    assert forwards == {False: 1, True: 2}  # the layer ran again in the backward pass
    assert all(torch.equal(a, b) for a, b in zip(grads[False], grads[True], strict=True))
