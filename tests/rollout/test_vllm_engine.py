"""The vLLM rollout engine on CPU: sampling, log-prob alignment with the trainer, and weight sync."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlvr_lightning.models.forward import policy_forward, sequence_logprobs
from rlvr_lightning.rollout.engine import WeightSyncError
from rlvr_lightning.rollout.hf_engine import HFGenerateEngine
from rlvr_lightning.rollout.settings import vllm_auto_dtype
from rlvr_lightning.rollout.sync import WeightSyncProbe, default_sync_tol
from rlvr_lightning.rollout.types import PromptBatch, Rollout, SamplingConfig
from rlvr_lightning.rollout.vllm_engine import VLLMEngine
from rlvr_lightning.training.settings import ComputeSettings

PROMPTS = ["What is 1+2-3?\n", "What is 17+20+9?\n", "Hi\n"]  # different lengths: exercises left padding


@pytest.fixture(scope="module")
def setup(tiny_policy_dir):
    tok = AutoTokenizer.from_pretrained(tiny_policy_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_policy_dir, dtype=torch.float32).eval()
    engine = VLLMEngine(str(tiny_policy_dir), max_model_len=128, dtype="float32")
    yield tok, model, engine
    engine.close()


def _trainer_logprobs(model, rollout: Rollout, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t = rollout.tensors(pad_id)
    logp = policy_forward(model, t, rollout.sampling.temperature).logp
    return logp, t.rollout_logp, t.response_mask


def _rollout(engine, tok, sampling: SamplingConfig) -> Rollout:
    prompt_ids = [tok(p).input_ids for p in PROMPTS]
    groups = engine.generate(prompt_ids, sampling)
    batch = PromptBatch(ids=["a", "b", "c"], prompts=PROMPTS, answers=["0", "46", "x"])
    return Rollout(batch, sampling.group_size, prompt_ids, [c for g in groups for c in g], sampling, 0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vllm_rollout_logprobs_match_trainer(setup, temperature):
    tok, model, engine = setup
    rollout = _rollout(engine, tok, SamplingConfig(group_size=4, temperature=temperature, max_tokens=12))
    assert len(rollout.completions) == 12
    assert {c.finish_reason for c in rollout.completions} <= {"stop", "length"}
    for c in rollout.completions:
        assert len(c.token_ids) == len(c.logprobs) <= 12
    logp, rollout_logp, mask = _trainer_logprobs(model, rollout, tok.pad_token_id)
    # Trainer positions must be the engine's (left-padded prompts, explicit position ids).
    assert ((logp - rollout_logp).abs() * mask).max() < 1e-3


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_hf_engine_logprobs_match_trainer(setup, temperature):
    """At 0.7 the log-probs are of the tempered distribution the tokens are drawn from, as the trainer's."""
    tok, model, _ = setup
    engine = HFGenerateEngine(model, tok.pad_token_id, tok.eos_token_id, partial(sequence_logprobs, model))
    rollout = _rollout(engine, tok, SamplingConfig(group_size=3, temperature=temperature, max_tokens=10, seed=0))
    logp, rollout_logp, mask = _trainer_logprobs(model, rollout, tok.pad_token_id)
    assert ((logp - rollout_logp).abs() * mask).max() < 1e-3


def test_weight_sync_moves_engine_to_trainer_weights(setup, tiny_policy_dir):
    tok, _, engine = setup
    trainer = AutoModelForCausalLM.from_pretrained(tiny_policy_dir, dtype=torch.float32).eval()
    prompt, completion = tok("What is 3+4+5?\n").input_ids, tok("3+4=7,7+5=12.\\boxed{12}").input_ids

    def trainer_logprobs():
        return sequence_logprobs(trainer, prompt, completion)

    before = engine.logprobs(prompt, completion)
    assert max(abs(a - b) for a, b in zip(before, trainer_logprobs())) < 1e-3
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.05 * torch.randn_like(p))
    changed = trainer_logprobs()
    assert max(abs(a - b) for a, b in zip(before, changed)) > 1e-2  # the update is visible...
    engine.load_weights(trainer.state_dict().items())
    after = engine.logprobs(prompt, completion)
    assert max(abs(a - b) for a, b in zip(after, changed)) < 1e-3  # ...and the engine now has it
    assert max(abs(a - b) for a, b in zip(after, before)) > 1e-2


class _FrozenEngine:
    """An engine whose sync silently does nothing: the probe must catch it."""

    def __init__(self, scores):
        self.scores = scores

    def logprobs(self, prompt_ids, completion_ids, agreement_tol=1e-3):
        return list(self.scores)


def test_sync_probe_detects_noop_and_divergence(setup):
    tok, _, engine = setup
    rollout = _rollout(engine, tok, SamplingConfig(group_size=2, temperature=1.0, max_tokens=6))
    probe = WeightSyncProbe(tol=1e-3)
    n = len(probe_completion(rollout))
    probe.check(_FrozenEngine([-1.0] * n), lambda p, c: [-1.0] * n, rollout)  # agree: fine
    with pytest.raises(WeightSyncError, match="did nothing"):
        probe.check(_FrozenEngine([-1.0] * n), lambda p, c: [-1.0 + 1e-5] * n, rollout)
    with pytest.raises(WeightSyncError, match="differ from the trainer"):
        WeightSyncProbe(tol=1e-3).check(_FrozenEngine([-1.0] * n), lambda p, c: [-2.0] * n, rollout)


def test_the_default_probe_tolerance_follows_the_precision(setup):
    """fp32 on both sides: a sync 5e-4 off (a part of the model left behind) fails the probe, which a fixed
    1e-3 let through; bf16 on either side: rounding-sized differences (0.01) pass."""
    tok, _, engine = setup
    rollout = _rollout(engine, tok, SamplingConfig(group_size=2, temperature=1.0, max_tokens=6))
    n = len(probe_completion(rollout))
    with pytest.raises(WeightSyncError, match="differ from the trainer"):
        WeightSyncProbe(default_sync_tol("float32", "float32")).check(
            _FrozenEngine([-1.0] * n), lambda p, c: [-1.0005] * n, rollout
        )
    for engine_dtype, trainer_dtype in [("bfloat16", "float32"), ("float32", "bfloat16"), ("float16", "float16")]:
        WeightSyncProbe(default_sync_tol(engine_dtype, trainer_dtype)).check(
            _FrozenEngine([-1.0] * n), lambda p, c: [-1.01] * n, rollout
        )


def test_auto_dtype_on_a_gpu_is_what_vllm_downcasts_an_fp32_checkpoint_to():
    """vLLM runs an fp32 checkpoint in bf16 on a GPU under `dtype: auto`: the probe must get the 16-bit
    tolerance (fp32's would stop the run on rounding) and a LoRA merged sync its warning."""
    assert vllm_auto_dtype("float32", on_cuda=True) == "bfloat16"
    assert vllm_auto_dtype("float32", on_cuda=True, bf16_supported=False) == "float16"
    assert vllm_auto_dtype("float32", on_cuda=False) == "float32"
    assert vllm_auto_dtype("bfloat16", on_cuda=True) == vllm_auto_dtype("bfloat16", on_cuda=False) == "bfloat16"
    assert default_sync_tol(vllm_auto_dtype("float32", on_cuda=True), "float32") > default_sync_tol("float32", "float32")


def probe_completion(rollout: Rollout) -> list[int]:
    return next(c.token_ids for c in rollout.completions if c.token_ids)


def test_host_heap_tuning_takes_effect_on_glibc():
    """The in-process vLLM engine keeps glibc from returning the trainer's freed memory to the OS
    (page-fault churn made the update 1.5× slower; bench/colocated_update.py)."""
    import platform

    from rlvr_lightning.rollout.vllm_engine import keep_host_heap

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc only")
    assert keep_host_heap()


def test_the_hf_engine_scores_in_the_updates_lm_head_chunks(tiny_policy_dir, monkeypatch):
    """The HF engine's `logprobs` (the weight-sync probe's engine side) runs the LM head in the module's
    `logprob_chunk_tokens`, as the update does: never the whole [L × V] logits of a long completion."""
    import rlvr_lightning.models.forward as forward
    from rlvr_lightning.algos import GRPO
    from rlvr_lightning.data.datamodule import RolloutDataModule
    from rlvr_lightning.rollout.settings import RolloutSettings
    from rlvr_lightning.standalone import standalone

    dm = RolloutDataModule(model_name_or_path=str(tiny_policy_dir), batch_size=2, val_data=None, rollout=RolloutSettings(engine="hf"))
    module = standalone(GRPO(compute=ComputeSettings(logprob_chunk_tokens=3)), dm)
    chunks = []
    monkeypatch.setattr(forward, "policy_forward", lambda *a, **kw: chunks.append(kw["chunk_tokens"]) or policy_forward(*a, **kw))
    logp = module.session.engine.logprobs([1, 2, 3], [4, 5, 6, 7])
    assert chunks == [3] and len(logp) == 4
    module.teardown("fit")
