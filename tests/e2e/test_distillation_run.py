"""On-policy distillation for real: a teacher on a `vllm serve` replica scores the student's token ids as a direct
forward of the teacher does, and `grpo-opd` runs through the CLI with the teacher in the trainer and on a replica
(a LoRA student generating a version ahead)."""

from __future__ import annotations

import pytest
import torch

from rlvr_lightning.rollout.types import Completion, PromptBatch, Rollout, SamplingConfig
from rlvr_lightning.training.teacher import ServerSite, TeacherSettings, served_teacher
from tests.e2e.test_presets import finished_run, preset_args, values
from tests.support.cli import run_cli

pytestmark = pytest.mark.e2e


def test_a_served_teachers_log_probs_are_a_direct_forward_of_the_teacher(tiny_policy_dir, monkeypatch):
    """Prompt and response sent as token ids: vLLM's prompt log-probs of the response tokens equal the teacher's
    own forward of the sequence (fp32 on both sides), however unlikely the token (random weights: none is likely),
    with the longer sequences prefilled in chunks of 4 tokens."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr("rlvr_lightning.training.teacher.TEACHER_PREFILL_TOKENS", 4)

    model = AutoModelForCausalLM.from_pretrained(tiny_policy_dir, dtype=torch.float32).eval()
    prompts = [[5, 6, 7], [8, 9]]
    responses = [[20, 21, 22, 23], [24], [25, 26, 27, 28, 29, 30], [31, 32]]
    comps = [Completion(r, [0.0] * len(r), "stop") for r in responses]
    rollout = Rollout(PromptBatch(["a", "b"], ["", ""], ["", ""]), 2, prompts, comps, SamplingConfig(group_size=2), 0)
    settings = TeacherSettings(str(tiny_policy_dir), servers=2, sequences_per_request=1)  # 4 requests over 2 replicas
    teacher = served_teacher(settings, str(tiny_policy_dir), ServerSite(64, 0, 1.0, (0, 1), "float32"))
    teacher.start()
    try:
        got = teacher.logprobs(rollout, rollout.tensors(0))
    finally:
        teacher.close()
    for n, response in enumerate(responses):
        prompt = prompts[n // 2]
        with torch.no_grad():
            logp = model(torch.tensor([prompt + response])).logits.float().log_softmax(-1)[0, len(prompt) - 1 : -1]
        direct = logp.gather(-1, torch.tensor(response)[:, None])[:, 0]
        assert got[n, : len(response)].tolist() == pytest.approx(direct.tolist(), abs=1e-4)
        assert (got[n, len(response) :] == 0).all()


def test_a_teacher_equal_to_the_student_finds_no_reverse_kl_before_the_first_update(tmp_path, quick_warm_start):
    """The student's own weights as its teacher, in the trainer: before any update the engine's and the teacher's
    log-probs of every sampled token agree (to the engine-trainer rounding), so the reverse KL is ~0; a teacher
    scoring the wrong positions, or other tokens, would find it far from 0."""
    _, student = quick_warm_start
    args = [*preset_args(tmp_path, "grpo-opd", student, max_response_length=24), "--rollout_batches", "1",
            "--model.init_args.teacher.model_name_or_path", str(student)]  # fmt: skip
    proc = run_cli(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _, history = finished_run(tmp_path, "grpo-opd")
    assert abs(values(history, "train/opd_reverse_kl")[0]) < 1e-4
    assert values(history, "time/teacher")[0] > 0


def test_a_served_teacher_teaches_a_lora_student_generating_ahead(tmp_path, quick_warm_start, tiny_policy_dir):
    """An untrained teacher on a `vllm serve` replica, a LoRA student on replicas of its own one version ahead: the
    run trains both rollout batches on the teacher's signal, far from 0 (the teacher is random)."""
    _, student = quick_warm_start
    args = [*preset_args(tmp_path, "grpo-opd", student, max_response_length=16), "--rollout_batches", "2",
            "--model.init_args.teacher.model_name_or_path", str(tiny_policy_dir),
            "--model.init_args.teacher.servers", "1", "--model.init_args.lora.rank", "8",
            "--rollout.engine", "vllm-server", "--rollout.stream.max_staleness", "1"]  # fmt: skip
    proc = run_cli(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run, history = finished_run(tmp_path, "grpo-opd")
    assert run.data.params["model.init_args.teacher.servers"] == "1"
    kl = values(history, "train/opd_reverse_kl")
    assert len(kl) == 2 and min(kl) > 0.5, kl  # a random teacher finds the student's tokens unlikely
    assert [m.step for m in history["train/grad_norm"]] == [0, 1]
