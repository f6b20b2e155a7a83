"""The planner: its accounting on fake tensors against PyTorch's own on real ones, the row extrapolation
against full runs, the shipped model configurations, the pre-flight refusal and its bad-input errors."""

from __future__ import annotations

import dataclasses
import logging
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from rlvr_lightning.errors import ConfigError
from rlvr_lightning.planner.measure import real_step_peak_bytes
from rlvr_lightning.planner.models import model_config, shipped_models
from rlvr_lightning.planner.trainer_measurement import _measured, measure_trainer
from rlvr_lightning.planner.trainer_memory import TrainerSetup

BASE = ["--config", "configs/base.yaml", "--config", "configs/algo/grpo.yaml"]


def tiny_config(vocab: int) -> Qwen2Config:
    return Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip


def setup_for(config, rows: int, response: int, chunk: int, checkpointing: bool, **kw) -> TrainerSetup:
    return TrainerSetup(config, 1, False, "float32", "32-true", checkpointing, rows, 32, response, chunk,
                        with_reference=False, separate_old_pass=False, capture_lm_head=False, **kw)  # fmt: skip


@pytest.mark.parametrize(
    "vocab,rows,response,chunk,checkpointing",
    [(1024, 4, 256, 0, False), (151_936, 4, 256, 256, False), (151_936, 8, 128, 256, True), (1024, 8, 512, 128, True)],
)  # fmt: skip
def test_planned_peak_equals_pytorchs_own_accounting(vocab, rows, response, chunk, checkpointing):
    """The plan's trainer peak against PyTorch's MemTracker on a real step (`planner.measure`)."""
    config = tiny_config(vocab)
    setup = setup_for(config, rows, response, chunk, checkpointing)
    planned = measure_trainer(setup, with_flops=False).peak.peak_bytes
    real = real_step_peak_bytes(setup)
    assert planned == pytest.approx(real, rel=0.10), (planned / 2**20, real / 2**20)


def test_the_old_pass_the_lm_head_inputs_and_held_gradients_are_accounted():
    """The θ_old pass, THR's captured LM-head inputs, and a second micro-batch with the first's gradients
    held. (KL's reference model is checked by the RSS of real runs, bench/plan_accuracy.py: MemTracker
    fails on a second model's forward in one step.)"""
    setup = dataclasses.replace(setup_for(tiny_config(151_936), 4, 256, 256, False), separate_old_pass=True,
                                capture_lm_head=True, accumulates=True)  # fmt: skip
    planned = measure_trainer(setup, with_flops=False).peak.peak_bytes
    assert planned == pytest.approx(real_step_peak_bytes(setup), rel=0.10)


@pytest.mark.parametrize("fsdp", [False, True])
def test_rows_extrapolate_to_the_full_run(fsdp):
    """A forward of R > 2 rows is planned from runs of 1 and 2 rows: equal to running R rows."""
    setup = dataclasses.replace(setup_for(tiny_config(151_936), 6, 256, 256, True), fsdp=fsdp, world_size=2 if fsdp else 1)
    extrapolated = measure_trainer(setup)
    full = _measured(setup, with_flops=True)
    for a, b in zip(extrapolated.stages, full.stages, strict=True):
        assert a.peak_bytes == pytest.approx(b.peak_bytes, rel=0.01), a.stage
        assert a.flops == pytest.approx(b.flops, rel=0.01), a.stage


def test_activation_checkpointing_leaves_a_fraction_of_the_activations_under_fsdp():
    config = model_config("Qwen/Qwen2.5-Math-1.5B")
    planned = {}
    for checkpointing in (False, True):
        setup = TrainerSetup(config, 8, True, "bfloat16", "32-true", checkpointing, 1, 512, 1536, 1024, False, False, False, True)
        planned[checkpointing] = measure_trainer(setup, with_flops=False).peak.breakdown["activations"]
    assert planned[True] < planned[False] / 5, {k: v / 2**30 for k, v in planned.items()}


@pytest.mark.parametrize(
    "name,billions",
    [("Qwen/Qwen2.5-Math-1.5B", 1.54), ("Qwen/Qwen2.5-Math-7B", 7.62), ("Qwen/Qwen3-0.6B", 0.60), ("Qwen/Qwen3-1.7B", 1.72),
     ("Qwen/Qwen3-4B", 4.02), ("Qwen/Qwen3-8B", 8.19), ("meta-llama/Llama-3.1-8B", 8.03)],
)  # fmt: skip
def test_shipped_configurations_have_the_published_sizes(name, billions):
    assert name in shipped_models()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(name))
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.01)


def test_bad_input_is_one_line(tmp_path, capsys, monkeypatch):
    from rlvr_lightning.plan import main

    monkeypatch.setattr(sys, "argv", ["plan"])
    # Offline, as this machine is: the hub's client would otherwise retry its connection for ~20 s first.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(pytest.importorskip("huggingface_hub.constants"), "HF_HUB_OFFLINE", True)
    for argv, message in [(["--hardware", "tpu-v5"], "plan.hardware: unknown hardware 'tpu-v5'"),
                          (["--data.model_name_or_path", str(tmp_path)], "is a directory without a config.json"),
                          (["--data.model_name_or_path", "nobody/no-such-model"], "no model configuration for 'nobody/no-such-model'")]:  # fmt: skip
        with pytest.raises(SystemExit) as exit_info:
            main([*BASE, *argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2 and len(err) == 1 and message in err[0], err


def parsed(*argv: str):
    from rlvr_lightning.plan import parse

    return parse([*BASE, *argv])[0]


def test_a_token_budget_below_a_group_plans_whole_groups_where_the_loss_needs_them(monkeypatch):
    """REAL's group-level loss packs whole groups: a budget of two sequences' tokens still runs a group of
    G = 8 rows; GRPO's token-level loss runs the two rows the budget holds."""
    from rlvr_lightning.plan import parse
    from rlvr_lightning.planner.hardware import hardware
    from rlvr_lightning.planner.run_spec import run_spec

    monkeypatch.setattr(sys, "argv", ["plan"])
    flags = ["--rollout.group_size", "8", "--rollout.max_response_length", "100", "--data.max_prompt_length", "28",
             "--model.init_args.compute.max_tokens_per_micro_batch", "256"]  # fmt: skip
    real = run_spec(parse([*BASE[:2], "--config", "configs/algo/real.yaml", *flags])[0], hardware("cpu"))
    grpo = run_spec(parsed(*flags), hardware("cpu"))
    assert (real.whole_groups, real.rows_per_forward) == (True, 8)
    assert (grpo.whole_groups, grpo.rows_per_forward) == (False, 2)


def test_preflight_refuses_on_a_gpu_and_names_the_first_change_that_fits(monkeypatch):
    from rlvr_lightning.planner.preflight import preflight

    monkeypatch.setattr(sys, "argv", ["plan"])
    run = ("--plan.hardware", "h100", "--plan.device_gib", "4", "--rollout.max_response_length", "1024",
           "--trainer.precision", "32-true")  # an fp32 trainer: its activations need the smaller micro-batches  # fmt: skip
    cfg = parsed(*run)
    with pytest.raises(ConfigError) as err:
        preflight(cfg)
    message = str(err.value)
    assert "predicted peak" in message and "against 4.0 GiB" in message, message
    assert "the first change that fits: --model.init_args.compute.micro_batch_size 16" in message, message
    preflight(parsed(*run, "--model.init_args.compute.micro_batch_size", "16"))  # the change it named: no error
    preflight(parsed(*run, "--plan.check", "false"))


def test_preflight_on_the_cpu_warns(monkeypatch, caplog):
    from rlvr_lightning.planner.preflight import preflight

    monkeypatch.setattr(sys, "argv", ["plan"])
    with caplog.at_level(logging.WARNING):
        preflight(parsed("--plan.hardware", "cpu", "--plan.device_gib", "0.5"))
    assert any("the run may swap or be killed" in r.getMessage() for r in caplog.records)


def test_unknown_hardware_is_refused_at_parse_time():
    from rlvr_lightning.planner.settings import PlanSettings

    with pytest.raises(ConfigError, match="unknown hardware 'b200'"):
        PlanSettings(hardware="b200")


def test_make_train_refuses_a_run_that_will_not_fit_in_one_line(tmp_path, capsys, monkeypatch):
    """The pre-flight in `make train`'s own command line, before any weights or engine (the CLI's tests
    skip it with --plan.check=false)."""
    from rlvr_lightning.cli import main

    monkeypatch.setenv("RLVR_CACHE_DIR", str(tmp_path / "cache"))  # nothing may be built there
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *BASE, "--trainer.logger.init_args.tracking_uri", f"sqlite:///{tmp_path}/mlflow.db",
              "--plan.hardware", "h100", "--plan.device_gib", "4", "--rollout.max_response_length", "1024"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and err[-1].startswith("error: plan: predicted peak") and "Traceback" not in "".join(err)
    assert "--model.init_args.compute.micro_batch_size 16" in err[-1]
    assert not (tmp_path / "cache").exists()  # the embedded warm start was not built


def test_a_lora_policy_is_planned_as_pytorch_accounts_it_and_below_full_fine_tuning():
    """PEFT's layers on fake tensors against a real LoRA step under PyTorch's MemTracker; the plan drops the
    frozen weights' gradients and AdamW state (3 × 4 bytes each) and plans no second model for the reference."""
    from rlvr_lightning.models.lora import LoraSettings

    lora = LoraSettings(rank=8)
    full = dataclasses.replace(setup_for(tiny_config(151_936), 4, 256, 256, False), separate_old_pass=True)
    adapted = dataclasses.replace(full, lora=lora)
    planned = measure_trainer(adapted, with_flops=False)
    assert planned.peak.peak_bytes == pytest.approx(real_step_peak_bytes(adapted), rel=0.10)
    frozen = planned.parameters - planned.trained
    assert 0 < planned.trained < frozen / 10
    saved = measure_trainer(full, with_flops=False).peak.peak_bytes - planned.peak.peak_bytes
    assert saved == pytest.approx(3 * 4 * frozen, rel=0.25)
    with_reference = measure_trainer(dataclasses.replace(adapted, with_reference=True), with_flops=False)
    assert with_reference.peak.breakdown.get("reference", 0) == 0  # the base is the policy's own weights
    assert with_reference.peak.peak_bytes < planned.peak.peak_bytes + frozen * 4 / 2


def test_planning_leaves_the_callers_model_config_as_it_was():
    """The plan of a GPU run builds its fake model with a mask-free causal attention. It once wrote that into the
    config it was given, so a model built later from the same config attended across the sequences of a packed
    forward (the GPU check's packed updates did, 0.01-0.025 nats of loss off their padded twins')."""
    from rlvr_lightning.models.forward import policy_forward
    from rlvr_lightning.rollout.types import RolloutTensors

    config = tiny_config(1024)
    measure_trainer(setup_for(config, 2, 16, 0, False, fused_attention=True), with_flops=False)
    assert config._attn_implementation in (None, "sdpa")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    P, T = 4, 6
    ids = torch.randint(3, 1024, (3, P + T))
    ones = torch.ones(3, P + T, dtype=torch.long)
    batch = RolloutTensors(ids, ones, torch.arange(P + T).expand(3, -1).contiguous(), torch.ones(3, T), torch.zeros(3, T), P,
                           torch.ones(3, T))  # fmt: skip
    with torch.no_grad():
        padded = policy_forward(model, batch, 1.0).logp
        packed = policy_forward(model, batch, 1.0, packed=True).logp
    torch.testing.assert_close(packed, padded)


def test_a_teacher_in_the_trainer_holds_its_weights_through_the_step_and_adds_its_forward(monkeypatch):
    """Distilling a Qwen3-0.6B teacher into the embedded student: every stage of the student's step holds the
    teacher's fp32 weights besides, the teacher's forward is a stage of its own at least as large as the student's
    no-grad one, and served on a replica it costs the trainer's ranks nothing and takes time of its own."""
    from rlvr_lightning.planner.hardware import hardware
    from rlvr_lightning.planner.planner import plan_run
    from rlvr_lightning.planner.run_spec import run_spec
    from rlvr_lightning.planner.teacher_cost import STAGE, parameter_count

    monkeypatch.setattr(sys, "argv", ["plan"])
    opd = [*BASE[:2], "--config", "configs/algo/grpo-opd.yaml", "--model.init_args.behaviour.logprobs", "trainer",
           "--model.init_args.num_mini_batches", "2"]  # fmt: skip
    from rlvr_lightning.plan import parse

    def plan(*flags):
        return plan_run(run_spec(parse([*opd, *flags])[0], hardware("cpu")))

    alone = plan_run(run_spec(parse([*opd[:2], "--config", "configs/algo/grpo.yaml", *opd[4:]])[0], hardware("cpu")))
    taught = plan("--model.init_args.teacher.model_name_or_path", "Qwen/Qwen3-0.6B")
    weights = 4 * parameter_count(model_config("Qwen/Qwen3-0.6B"))
    assert weights > 2e9  # 0.6B parameters in fp32, the student's 1.1M beside them
    before = {s.stage: s.peak_bytes for s in alone.trainer.stages}
    after = {s.stage: s for s in taught.trainer.stages}
    assert list(after) == [STAGE, *before]
    for stage, peak in before.items():
        assert after[stage].peak_bytes == peak + weights, stage
    old = next(s for s in alone.trainer.stages if s.stage.startswith("θ_old"))
    assert after[STAGE].peak_bytes - weights > old.peak_bytes - old.breakdown["parameters"] - old.breakdown.get("optimizer_state", 0)
    assert taught.step.stages[STAGE] > alone.step.stages[old.stage] > 0  # 0.6B parameters' FLOPs against 1.1M
    served = plan("--model.init_args.teacher.model_name_or_path", "Qwen/Qwen3-0.6B", "--model.init_args.teacher.servers", "2")
    assert [s.peak_bytes for s in served.trainer.stages] == list(before.values())
    assert served.step.stages["teacher (vllm serve)"] > 0


def test_weights_kept_gathered_from_forward_to_backward_are_planned_as_pytorch_accounts_them(tmp_path):
    """`model.compute.reshard_after_forward false` under FSDP2 (one rank, the GPU check's update on real tensors):
    the planned peak against FSDPMemTracker's, and keeping the gathered weights adds at least a layer's weights
    (3.9 MiB in fp32 here) to both. The plan counts one layer more than the tracker (8.2 against 3.7 MiB: it
    has both layers held at the LM head's backward, where the real run has already gathered the last one again):
    at 28 layers, 1/28 of the kept weights."""
    from bench.gpu_check.update_step import UpdateShape, measured, planned

    config = Qwen2Config(vocab_size=1024, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    shape = UpdateShape(rows=8, prompt_tokens=8, response_tokens=248, chunk_tokens=32)
    peaks = {}
    for kept in (False, True):
        variant = dataclasses.replace(shape, reshard_after_forward=not kept)
        (tmp_path / str(kept)).mkdir()
        peaks[kept] = planned(config, variant)["peak_gib"], measured(config, variant, tmp_path / str(kept))["peak_allocated_gib"]
        assert peaks[kept][0] == pytest.approx(peaks[kept][1], rel=0.06), peaks
    layer_gib = 3.5 / 1024
    assert peaks[True][0] - peaks[False][0] > layer_gib and peaks[True][1] - peaks[False][1] > layer_gib, peaks
