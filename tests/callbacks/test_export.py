"""HF export: a trained policy exported by `HFExport` loads in plain transformers and in
vLLM and reproduces the greedy outputs of the policy that was exported."""

from __future__ import annotations

import json

import pytest
import torch

from rlvr_lightning.algos import GRPO
from rlvr_lightning.callbacks.export import HFExport
from rlvr_lightning.data.datamodule import RolloutDataModule
from rlvr_lightning.rollout.settings import RolloutSettings
from rlvr_lightning.standalone import standalone
from rlvr_lightning.training.settings import ComputeSettings, OptimSettings
from rlvr_lightning.training.step_metrics import StepResult


@pytest.mark.e2e
def test_export_reproduces_greedy_outputs_in_transformers_and_vllm(tmp_path, quick_warm_start):
    from transformers import AutoModelForCausalLM

    from rlvr_lightning.rollout.vllm_engine import VLLMEngine

    _, model_dir = quick_warm_start
    # Trained on the HF engine, which samples from the policy being trained: the one vLLM engine here is the
    # export's. A vLLM training engine (its start-up, weight syncs and sampling) cost most of this test's time,
    # and weight sync into vLLM is tests/rollout/test_vllm_engine.py's.
    dm = RolloutDataModule(model_name_or_path=str(model_dir), batch_size=8, val_data=None, rollout=RolloutSettings(group_size=8, max_response_length=24, engine="hf"))  # fmt: skip
    module = standalone(GRPO(optim=OptimSettings(lr=1e-3), compute=ComputeSettings(micro_batch_size=16)), dm, callbacks=[])
    before = {name: p.detach().clone() for name, p in module.policy.named_parameters()}
    for batch in dm.train_dataloader():  # until a batch with a mixed group has moved the weights
        assert isinstance(module.train_on_batch(batch), StepResult)  # an update, then the weights go to the engine
        module.rollout_batches += 1
        if moved(before, module.policy.named_parameters()):
            break
    else:  # exporting the initial weights would reproduce their outputs too and prove nothing
        pytest.fail("no rollout batch moved the weights: there is no trained policy to export")
    trained_weights = {name: p.detach().clone() for name, p in module.policy.named_parameters()}
    greedy = dm.rollout.sampling(group_size=1, temperature=0.0, max_tokens=24)
    trained = [c.token_ids for c in module.generate(batch, greedy).completions]
    out = HFExport(dirpath=str(tmp_path)).export(module.trainer, module, "final")
    for cb in module.trainer.callbacks:
        cb.teardown(module.trainer, module, "fit")
    module.teardown("fit")
    assert json.loads((out / "rlvr_export.json").read_text())["policy_version"] == module.session.policy_version

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    exported = model.state_dict()
    assert set(trained_weights) <= set(exported), set(trained_weights) - set(exported)
    for name, weight in trained_weights.items():  # the trained weights, not the initial ones
        torch.testing.assert_close(exported[name], weight, rtol=0, atol=0, msg=name)
    assert moved(before, exported.items())
    tok = dm.tokenizer
    prompts = [tok(p, add_special_tokens=False).input_ids for p in batch.prompts]
    for ids, expected in zip(prompts, trained):
        gen = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)  # fmt: skip
        assert gen[0, len(ids) :].tolist() == expected

    engine = VLLMEngine(str(out), max_model_len=dm.hparams.max_prompt_length + 24, dtype="float32", seed=0)
    try:
        assert [g[0].token_ids for g in engine.generate(prompts, greedy)] == trained
    finally:
        engine.close()


def moved(before: dict[str, torch.Tensor], weights) -> bool:
    """Whether any of the named `weights` differs from its value in `before`."""
    return any(not torch.equal(before[name], w) for name, w in weights if name in before)
