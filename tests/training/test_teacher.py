"""On-policy distillation's teacher (`training.teacher`): its vocabulary checked against the student's, its log-probs
in the trainer against a direct forward of the teacher, and a served replica's prompt log-probs read back."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from rlvr_lightning.context import Collectives
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.rollout.types import Completion, PromptBatch, Rollout, SamplingConfig
from rlvr_lightning.training.layout import UpdateLayout
from rlvr_lightning.training.teacher import TrainerTeacher, check_same_vocabulary, response_logprobs


def test_a_teacher_with_another_vocabulary_is_refused_in_one_line(tiny_policy_dir, tmp_path):
    from transformers import AutoTokenizer

    other = tmp_path / "other"
    shutil.copytree(tiny_policy_dir, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = list(vocab)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens swap ids: the same strings, other ids
    (other / "tokenizer.json").write_text(json.dumps(spec))
    student = AutoTokenizer.from_pretrained(tiny_policy_dir)
    check_same_vocabulary(student, str(tiny_policy_dir), "same")  # the student's own vocabulary passes
    with pytest.raises(ConfigError, match="its tokenizer is not the student's .* 4 entries differ") as err:
        check_same_vocabulary(student, str(other), "other")
    assert "\n" not in str(err.value)


def test_the_teachers_log_probs_are_a_direct_forward_of_the_teacher(tiny_policy_dir):
    """Scored by the trainer's micro-batched, chunked pass over padded sequences, each response token's log-prob
    equals the teacher's own forward of that one sequence, unpadded, at temperature 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_policy_dir, dtype=torch.float32).eval()
    prompts = [[5, 6, 7], [8]]
    responses = [[20, 21, 22, 23], [24], [25, 26, 27, 28, 29, 30], [31, 32]]
    comps = [Completion(r, [0.0] * len(r), "stop") for r in responses]
    rollout = Rollout(PromptBatch(["a", "b"], ["", ""], ["", ""]), 2, prompts, comps, SamplingConfig(group_size=2), 0)
    t = rollout.tensors(0)
    layout = UpdateLayout(1, 1, 3, None, 2, 1.0, 6.0, False)  # micro-batches of 3 rows, LM-head chunks of 2 tokens
    counts = t.token_counts
    got = TrainerTeacher(model).logprobs(
        rollout, t, lambda rows, whole: layout.micro_batches(rows, counts, Collectives(), 1), 2, False, False
    )
    for n, response in enumerate(responses):
        ids = torch.tensor([prompts[n // 2] + response])
        with torch.no_grad():
            logp = model(ids).logits.float().log_softmax(-1)[0, len(prompts[n // 2]) - 1 : -1]
        direct = logp.gather(-1, torch.tensor(response)[:, None])[:, 0]
        assert got[n, : len(response)] == pytest.approx(direct.tolist(), abs=1e-5)
        assert (got[n, len(response) :] == 0).all()


def test_a_replicas_prompt_log_probs_give_the_response_tokens():
    entries = [None, {"6": {"logprob": -0.1}}, {"9": {"logprob": -2.5, "rank": 7}}, {"4": {"logprob": -0.3}}]
    assert response_logprobs(entries, [5, 6], [9, 4]) == [-2.5, -0.3]
    with pytest.raises(RuntimeError, match="scored 1 of 2"):
        response_logprobs(entries[:3], [5, 6], [9, 4])
