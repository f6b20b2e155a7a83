"""Kill-and-resume in one process: GRPO with a LoRA adapter whose answers call the Python tool, two versions ahead
with partial rollouts on two real `vllm serve` replicas, killed (SIGKILL) after a checkpoint and resumed, logs
exactly, bit for bit, the
metrics of an uninterrupted run into the same MLflow run, one point per step: the steps before the kill come
from one process, those after from another, so this is also two separate runs agreeing. The batches in flight
at the checkpoint are continued, not regenerated; the checkpoint holds the adapter and its AdamW state, and the
resumed replicas are handed the adapter it had before they generate (the base weights alone would sample and
score differently). Full weights resume on two FSDP ranks in tests/e2e/test_fsdp_resume.py."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal

import pytest

from tests.rollout.test_vllm_server import serve_processes
from tests.support.cli import run_cli
from tests.support.resume import COMPARED, STEPS, args_for, histories, kill_after_checkpoint
from tests.support.tool_args import FIRST_RESULT_AS_CALL

STREAM = ["--rollout.engine", "vllm-server", "--rollout.servers.replicas", "2", "--rollout.stream.max_staleness", "2",
          "--rollout.stream.partial_rollouts", "true",
          "--model.init_args.rewards.correctness", "tests.support.rewards.parity_of_tool_answers"]  # fmt: skip
LORA = ["--model.init_args.lora.rank", "8", "--model.init_args.lora.sync", "adapter", "--model.init_args.optim.lr", "1e-2"]
STALENESS = ("train/staleness_mean", "train/staleness_max")
TOOL = ("train/tool_calls_per_answer", "train/inserted_token_frac", "train/turns_mean", "train/stop_length_frac")


@pytest.mark.e2e
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
def test_two_versions_ahead_with_partial_rollouts_and_the_tool_resumes_bit_for_bit(tmp_path, quick_warm_start):
    _, warm = quick_warm_start
    model_dir = shutil.copytree(warm, tmp_path / "policy")  # its own path: its servers are told apart
    reference_dir, resumed_dir = tmp_path / "reference", tmp_path / "resumed"
    reference_dir.mkdir(), resumed_dir.mkdir()
    proc = run_cli([*args_for(reference_dir, model_dir), *STREAM, *LORA, *FIRST_RESULT_AS_CALL], reference_dir, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]

    args = [*args_for(resumed_dir, model_dir), *STREAM, *LORA, *FIRST_RESULT_AS_CALL]
    try:
        k = kill_after_checkpoint(resumed_dir, args, min_step=2)
    finally:
        for pid in serve_processes(model_dir):  # the killed trainer could not take its servers down
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert 2 <= k < STEPS, k
    (ckpt,) = resumed_dir.glob("checkpoints/*/last.ckpt")
    proc = run_cli([*args, "--ckpt_path", str(ckpt)], resumed_dir, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]

    keys = (*COMPARED, *STALENESS, *TOOL)
    run, resumed = histories(resumed_dir, keys)
    _, reference = histories(reference_dir, keys)
    assert reference["train/staleness_max"] == {0: 0.0, 1: 1.0, **{s: 2.0 for s in range(2, STEPS)}}
    assert 1.0 < reference["train/staleness_mean"][STEPS - 1] < 2.0  # partial: tokens of both versions
    assert min(reference["train/tool_calls_per_answer"].values()) > 0  # every batch's answers called the tool
    for key in keys:
        assert resumed[key] == reference[key], (key, k)  # exactly, every step, before and after the kill
    assert sorted(resumed["val/accuracy"]) == [0, 2, 4, STEPS]  # no extra evaluation on resume
    assert run.info.status == "FINISHED" and ckpt.parent.name == run.info.run_id
    assert run.data.params["model.init_args.lora.sync"] == "adapter"
    assert serve_processes(model_dir) == []
