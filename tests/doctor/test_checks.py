"""`python -m rlvr_lightning.doctor` (`make doctor`): on this CPU machine every check that can run passes and
every other one says why it was skipped; a broken part of the path fails its row and the exit code."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from bench.gpu_check.fast_paths import CXX
from rlvr_lightning.doctor import as_table, run_checks
from rlvr_lightning.doctor.checks import FAIL, PASS, SKIP, Row
from rlvr_lightning.models import weights
from tests.support.cli import REPO

CONFIG = ["--config", str(REPO / "configs/base.yaml"), "--config", str(REPO / "configs/algo/grpo.yaml")]
# What this CPU machine cannot run (the rest must pass).
CPU_SKIPS = {"CUDA", "NCCL", "flash-attn", "engine sleep → wake", "flash-attention vs SDPA"}
NOT_CHOSEN = {"fast paths vs plain", "tool sandbox"}  # the defaults choose no fast path and no Python tool


def table_rows(out: str) -> dict[str, tuple[str, str]]:
    """{check: (result, the rest of its line)} from the printed table."""
    rows = {}
    for line in out.splitlines():
        m = re.match(r"^(\S.*?)\s{2,}(pass|FAIL|skipped)\b(.*)$", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3).strip())
    return rows


@pytest.mark.e2e
def test_the_doctor_passes_on_this_cpu_machine_with_the_embedded_default():
    proc = subprocess.run(
        [sys.executable, "-m", "rlvr_lightning.doctor", *CONFIG],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = table_rows(proc.stdout)
    expected = {"torch", "CUDA", "NCCL", "vLLM", "flash-attn", "transformers", "lightning", "FSDP2 training step",
                "chunked LM head", "fast paths vs plain", "packed micro-batches", "rollout engine", "weight sync",
                "engine sleep → wake", "flash-attention vs SDPA", "tool sandbox"}  # fmt: skip
    assert set(rows) == expected, proc.stdout
    for check, (result, rest) in rows.items():
        if check in CPU_SKIPS | NOT_CHOSEN:
            assert result == SKIP and rest, f"{check}: skipped without a reason\n{proc.stdout}"
        else:
            assert result == PASS, f"{check}: {result} {rest}\n{proc.stdout}"
    assert rows["rollout engine"][1].startswith("vllm, float32")
    assert rows["weight sync"][1].startswith("in-process load_weights")
    assert "vLLM's sleep mode needs CUDA" in rows["engine sleep → wake"][1]
    assert "no CUDA device" in rows["flash-attention vs SDPA"][1]
    assert "block-diagonal mask" in rows["packed micro-batches"][1]


@pytest.mark.e2e
def test_a_weight_sync_that_leaves_one_tensor_behind_fails_its_row(monkeypatch, capsys):
    """The engine receives every weight but one: the probe sees the trainer's update and the engine disagree."""
    from rlvr_lightning.doctor import main

    full_weights = weights.full_weights
    dropped = []

    def all_but_one(policy):
        for name, tensor in full_weights(policy):
            if name == "model.layers.1.mlp.down_proj.weight":
                dropped.append(name)
                continue
            yield name, tensor

    monkeypatch.setattr(weights, "full_weights", all_but_one)
    with pytest.raises(SystemExit) as exit_:
        main([*CONFIG, "--checks", "rollout,weight"])
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert dropped, "the sync did not go through models.weights.full_weights"
    assert exit_.value.code == 1, out
    assert rows["rollout engine"][0] == PASS, out
    result, rest = rows["weight sync"]
    assert result == FAIL and "differ from the trainer" in rest, out


def test_a_check_that_raises_is_one_fail_row_and_the_others_still_run():
    def broken(setup):
        raise RuntimeError("no device\nsecond line of a long traceback")

    rows = run_checks(None, [("broken", broken, "fix it"), ("fine", lambda s: Row("fine", PASS, "1 s"), "")])
    assert [(r.check, r.result) for r in rows] == [("broken", FAIL), ("fine", PASS)]
    assert rows[0].note == "RuntimeError: no device — fix it"
    assert "second line" not in as_table(rows)


def test_checks_past_the_time_budget_are_skipped_with_the_reason():
    rows = run_checks(None, [("slow", lambda s: Row("slow", PASS), ""), ("late", lambda s: Row("late", PASS), "")],
                      budget_s=-1)  # fmt: skip
    assert all(r.result == SKIP and "budget" in r.note for r in rows)


@pytest.mark.parametrize(
    "precision, mesh, fsdp_param_dtype, expected",
    [("32-true", None, "bfloat16", "float32"), ("32-true", "mesh", "bfloat16", "bfloat16"),
     ("bf16-mixed", None, "float32", "bfloat16"), ("16-mixed", None, "float32", "float16")],
)  # fmt: skip
def test_the_doctor_reads_the_trainers_compute_dtype_as_the_run_does(precision, mesh, fsdp_param_dtype, expected):
    """The run's `trainer_dtype` and the doctor's (from the configuration alone) are one function."""
    from types import SimpleNamespace

    from rlvr_lightning.algos import GRPO, wiring
    from rlvr_lightning.training.engine_setup import trainer_compute_dtype
    from rlvr_lightning.training.settings import ComputeSettings

    settings = GRPO(compute=ComputeSettings(fsdp_param_dtype=fsdp_param_dtype)).settings
    assert wiring.trainer_dtype(settings, SimpleNamespace(precision=precision), sharded=mesh is not None) == expected
    assert trainer_compute_dtype(precision, fsdp_param_dtype if mesh else None) == expected


@pytest.mark.e2e
def test_a_lora_run_checks_the_adapter_sync_through_vllms_lora_path(capsys):
    """`make doctor` of a LoRA run with an adapter sync: the engine is built with LoRA and the probe checks an
    update that reached it through the adapter alone."""
    from rlvr_lightning.doctor import main

    try:
        main([*CONFIG, "--model.init_args.lora.rank", "8", "--model.init_args.lora.sync", "adapter",
              "--checks", "rollout,weight"])  # fmt: skip
    except SystemExit as exit_:
        assert not exit_.code, capsys.readouterr().out
    rows = table_rows(capsys.readouterr().out)
    assert rows["weight sync"][0] == PASS and rows["weight sync"][1].startswith("LoRA r=8, adapter"), rows


def test_the_packed_row_runs_the_cuda_attention_function_and_passes(tmp_path):
    """The packed row through `PACKED_SDPA`, the attention a CUDA run packs with (here its per-sequence
    path: no varlen kernel on the CPU): agreement with the padded forward, no leak past a sequence's end."""
    from rlvr_lightning.doctor.checks import Setup, packed_micro_batches
    from rlvr_lightning.models.packed_attention import PACKED_SDPA, prepare_packed_attention
    from rlvr_lightning.plan import parse

    cfg, _ = parse([*CONFIG, "--rollout.engine", "hf"])
    setup = Setup(cfg, tmp_path)
    assert prepare_packed_attention(setup.trainer_policy, force=True) == PACKED_SDPA
    row = packed_micro_batches(setup)
    assert row.result == PASS, row
    assert PACKED_SDPA in row.figure and "leak 0.0e+00" in row.figure, row


def test_the_fsdp_row_runs_the_runs_fast_paths_and_fails_on_one_that_cannot_run():
    """The FSDP2 row builds the policy with the run's fast paths (`models.fast_paths`): kept weights and fused AdamW
    step and name themselves; Liger's kernels on this CPU are one failed row naming why, before any run starts.
    (`make doctor` in its own process, as a user runs it: an in-process vLLM engine of an earlier test holds a
    process group that the row's own would collide with.)"""

    def fsdp_row(*flags):
        proc = subprocess.run(
            [sys.executable, "-m", "rlvr_lightning.doctor", *CONFIG, "--rollout.engine", "hf", "--checks", "FSDP2", *flags],
            cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        return table_rows(proc.stdout).get("FSDP2 training step"), proc.stdout + proc.stderr

    (result, rest), out = fsdp_row("--model.init_args.compute.reshard_after_forward", "false", "--model.init_args.optim.fused", "true")
    assert result == PASS and "fast paths: weights kept gathered, fused AdamW" in rest, out
    (result, rest), out = fsdp_row("--model.init_args.compute.fused_kernels", "liger")
    assert result == FAIL and "no CUDA device" in rest, out


@pytest.mark.skipif(not any(map(shutil.which, CXX)), reason="torch.compile's CPU backend needs a C++ compiler (make setup installs g++)")
def test_the_fast_path_row_passes_compiled_layers_and_fails_a_fast_path_that_changes_the_update(tmp_path, monkeypatch):
    """Compiled layers against the plain ones on the doctor's tiny policy (fp32 on this CPU): the same log-probs,
    loss and gradient norm. A "fast path" that scales the final norm's weights by 1.05 fails the row, naming the gap."""
    from rlvr_lightning.doctor import checks
    from rlvr_lightning.plan import parse

    cfg, _ = parse([*CONFIG, "--model.init_args.compute.compile_layers", "true"])
    row = checks.fast_paths(checks.Setup(cfg, tmp_path / "right"))
    assert row.result == PASS and row.figure.startswith("compiled layers: max |Δ log-prob|"), row

    def changes_the_update(model, *args):
        with torch.no_grad():
            model.model.norm.weight.mul_(1.05)

    monkeypatch.setattr(checks, "apply_fast_paths", changes_the_update)
    row = checks.fast_paths(checks.Setup(cfg, tmp_path / "wrong"))
    assert row.result == FAIL and "a fast path that changes the update" in row.note, row


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
def test_the_tool_sandbox_row_confines_a_call_and_fails_a_sandbox_without_its_filter(tmp_path, monkeypatch):
    from rlvr_lightning.doctor.checks import Setup, tool_sandbox
    from rlvr_lightning.plan import parse
    from rlvr_lightning.sandbox import pool

    cfg, _ = parse(["--config", str(REPO / "configs/base.yaml"), "--config", str(REPO / "configs/algo/grpo-tir.yaml")])
    setup = Setup(cfg, tmp_path)
    row = tool_sandbox(setup)
    assert row.result == PASS and "memory per " in row.figure, row
    monkeypatch.setattr(pool, "seccomp_program", lambda: b"")  # a sandbox that loads no filter
    row = tool_sandbox(setup)
    assert row.result == FAIL and "not confined" in row.note, row
