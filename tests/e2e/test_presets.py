"""Every GRPO-family preset as a user runs it: `configs/base.yaml` + `configs/algo/<name>.yaml`, 2 rollout batches."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.support.cli import run_cli, run_in_process

METRICS_EVERY_PRESET_LOGS = (
    "train/reward_mean", "train/accuracy", "train/entropy", "train/clip_frac_low", "train/clip_frac_high",
    "train/ratio_mean", "train/grad_norm", "train/logprob_mismatch_mean", "train/logprob_mismatch_max",
    "train/rollout_is_ratio_min", "train/rollout_is_ratio_max", "time/rollout", "time/update",
)  # fmt: skip


def preset_args(tmp_path: Path, algo: str, model_dir: Path, max_response_length: int = 16) -> list[str]:
    return [
        "fit", "--config", "configs/base.yaml", "--config", f"configs/algo/{algo}.yaml",
        "--trainer.logger.init_args.run_name", algo,
        "--trainer.logger.init_args.tracking_uri", f"sqlite:///{tmp_path}/mlflow.db",
        "--trainer.logger.init_args.artifact_location", str(tmp_path / "artifacts"),
        "--data.model_name_or_path", str(model_dir),
        "--data.batch_size", "4", "--rollout.group_size", "4", "--data.val_size", "8",
        "--rollout.max_response_length", str(max_response_length),
    ]  # fmt: skip


COMPOSED = [
    "--model.init_args.advantage_estimator.name=rloo", "--model.init_args.rollout_correction.name=icepop",
    # On CPU the engine's and the trainer's log-probs agree to ~1e-6, so IcePop's [0.5, 5] band never masks
    # here; a lower bound just below 1 masks the tokens the engine found likelier by more than 5e-7.
    "--model.init_args.rollout_correction.knobs.is_mask_low=0.9999995",
    "--model.init_args.shapers.thr.p=0.2",
    "--model.init_args.num_mini_batches=2",
]  # fmt: skip


@pytest.mark.e2e
def test_pieces_of_four_papers_compose_in_one_run(tmp_path, quick_warm_start):
    """CISPO's loss, RLOO's advantages, IcePop's rollout correction and THR's token reweighting."""
    run, history = two_batch_run(tmp_path, quick_warm_start[1], "cispo", COMPOSED)
    params = run.data.params
    assert (params["model.init_args.policy_loss.name"], params["model.init_args.advantage_estimator.name"],
            params["model.init_args.rollout_correction.name"]) == ("cispo", "rloo", "icepop")  # fmt: skip
    assert float(params["model.init_args.rollout_correction.knobs.is_mask_low"]) == 0.9999995
    for key in ("train/is_masked_frac", "train/is_weight_mean", "train/thr/dominant_frac", "train/loss"):
        assert [m.step for m in history[key]] == [0, 1], key
    # IcePop acted: it masked some tokens, whose weight is 0, and kept the others at their ratio ≈ 1.
    masked, weight_mean = values(history, "train/is_masked_frac"), values(history, "train/is_weight_mean")
    assert max(masked) > 0, masked
    assert weight_mean == pytest.approx([1 - m for m in masked], abs=1e-4), (weight_mean, masked)
    assert_thr_reweighted(history)


THIS_YEARS = [
    "--model.init_args.policy_loss.name=dppo-tv", "--model.init_args.advantage_estimator.name=maxrl",
    "--model.init_args.loss_agg.name=seq-mean-token-sum", "--model.init_args.rollout_correction.name=opsm",
    # On CPU the engine's and the trainer's log-probs agree to ~1e-7: at δ = 0 OPSM masks the negative
    # sequences whose rollout log-probs came out the higher, as a real mismatch past δ would.
    "--model.init_args.rollout_correction.knobs.opsm_delta=0.0",
    "--model.init_args.kl_estimator.name=kimi", "--model.init_args.kl_coef=0.001",
    "--model.init_args.shapers.thr.p=0.2",
    "--model.init_args.num_mini_batches=2",
]  # fmt: skip


@pytest.mark.e2e
def test_this_years_pieces_compose_with_thr_in_one_run(tmp_path, quick_warm_start):
    """DPPO's trust-region loss, MaxRL's advantages, the token-sum aggregation, OPSM's sequence mask and
    Kimi's regulariser to the behaviour policy, with THR's token reweighting, through the CLI."""
    run, history = two_batch_run(tmp_path, quick_warm_start[1], "grpo", THIS_YEARS)
    params = run.data.params
    assert [params[f"model.init_args.{k}.name"] for k in ("policy_loss", "advantage_estimator", "loss_agg",
            "rollout_correction", "kl_estimator")] == ["dppo-tv", "maxrl", "seq-mean-token-sum", "opsm", "kimi"]  # fmt: skip
    for key in ("train/opsm_masked_frac", "train/kl", "train/clip_frac_high", "train/thr/dominant_frac", "train/loss"):
        assert [m.step for m in history[key]] == [0, 1], key
    assert max(values(history, "train/opsm_masked_frac")) > 0  # OPSM masked some negative sequences
    assert max(values(history, "train/kl")) > 0  # the second mini-batch moved away from θ_old
    assert_thr_reweighted(history)


def values(history, key: str) -> list[float]:
    return [m.value for m in history[key]]


def assert_thr_reweighted(history) -> list[int]:
    """THR acted: in some rollout batch it scored the tokens of a mixed group and found dominant ones,
    whose advantage weight is 1 + p·sign(THR) ≠ 1. The steps where it scored tokens."""
    scored = [m.step for m in history["train/thr/tokens"] if m.value > 0]
    assert scored, "no mixed group sampled: THR had nothing to reweight"
    dominant = {m.step: m.value for m in history["train/thr/dominant_frac"]}
    assert all(dominant[step] > 0 for step in scored), dominant
    return scored


def two_batch_run(tmp_path: Path, model_dir: Path, preset: str, pieces: Sequence[str] = ()):
    """The preset with `pieces` over it, 2 rollout batches of 40-token answers, run by the CLI in `tmp_path`:
    its finished run and metric history."""
    args = [*preset_args(tmp_path, preset, model_dir, max_response_length=40), "--rollout_batches", "2"]
    proc = run_cli([*args, *pieces], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return finished_run(tmp_path, preset)


def finished_run(tmp_path: Path, algo: str):
    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs(client.get_experiment_by_name("rlvr_lightning").experiment_id)
    assert run.info.status == "FINISHED" and run.info.run_name == algo
    history = {k: client.get_metric_history(run.info.run_id, k) for k in run.data.metrics}
    return run, history


@pytest.mark.e2e
@pytest.mark.parametrize(
    "algo,cls,extra",
    [
        # One fit per distinct structure of the step; the presets that differ from these only by their pieces
        # (dr-grpo, gspo, dapo-real-baseline, real-bce, thr-explore) are held by the pieces' and the modules'
        # own tests, and every preset is built through the CLI by entry_points/test_presets_config.py.
        # K = 4, as the paper's recipe: from the second update on the ratio leaves 1, so clip-higher can act.
        # The tests' quick warm start answers ~2% correctly, so dynamic sampling would draw round after round
        # for mixed groups; the parity correctness mixes most groups in the first round.
        ("dapo", "DAPO", ["--model.init_args.rewards.correctness=tests.support.rewards.parity"]),
        ("kl-cov", "GRPO", []),  # a token selection over each step: θ_old's pass, the covariance logged
    ],
)
def test_preset_two_step_fit(tmp_path, quick_warm_start, algo, cls, extra):
    _, model_dir = quick_warm_start
    run, history = two_batch_run(tmp_path, model_dir, algo, extra)
    assert run.data.tags["algorithm"] == cls
    for key in METRICS_EVERY_PRESET_LOGS:
        assert [m.step for m in history[key]] == [0, 1], key
    if algo.startswith("dapo"):  # off-policy updates after the first: the ratios move
        assert max(m.value for m in history["train/ratio_max"]) > 1.001
        assert run.data.params["model.init_args.num_mini_batches"] == "4"
    if algo == "kl-cov":
        for key in ("train/cov_mean", "train/cov_max", "train/cov_selected_frac", "train/cov_selected_mean"):
            assert [m.step for m in history[key]] == [0, 1], key
        assert all(0 < m.value < 0.2 for m in history["train/cov_selected_frac"])  # about the preset's 2%
    if algo == "dapo":
        assert all(m.value == 0 for m in history["train/frac_reward_zero_std"])  # only mixed groups are kept
        assert [m.step for m in history["train/dynamic_sampling_rounds"]] == [0, 1]
        assert "train/overlong_penalty_mean" in history and "train/accuracy_before_filter" in history


@pytest.mark.e2e
def test_real_preset_two_step_fit(tmp_path, quick_warm_start):
    """real-bce is the same step with another loss (algos/test_real.py)."""
    _, model_dir = quick_warm_start
    # Two rollout batches of K = 4 optimizer steps; 4 prompts → one prompt (one whole group) per step.
    run, history = two_batch_run(tmp_path, model_dir, "real")
    assert run.data.tags["algorithm"] == "REAL"
    assert run.data.params["model.init_args.policy_loss.name"] == "real-anchor"
    assert float(run.data.params["model.init_args.policy_loss.knobs.tau"]) == 0.5
    for key in ("train/loss", "train/entropy", "train/mixed_group_frac", "train/grad_norm", "time/update"):
        assert [m.step for m in history[key]] == [0, 1], key
    # Logged only for batches with a mixed group; the seeded warm start samples some, so it must be there.
    assert history["train/grad_weight_abs_max"], "no mixed group sampled: the bound went unchecked"
    assert max(m.value for m in history["train/grad_weight_abs_max"]) <= 1 / 0.5


@pytest.mark.e2e
def test_dapo_without_any_mixed_group_stops_cleanly(tmp_path, tiny_policy_dir):
    """An untrained policy never answers correctly: every round is filtered out. The run must stop
    with a warning after `max_empty_batches`, not loop forever or crash. (The HF engine: the rounds' bookkeeping
    does not depend on the engine, and it starts in a fraction of vLLM's time.)"""
    args = [
        *preset_args(tmp_path, "dapo", tiny_policy_dir), "--rollout_batches", "2", "--rollout.engine", "hf",
        "--model.init_args.max_num_gen_batches", "2", "--model.init_args.max_empty_batches", "2",
        "--model.init_args.on_exhausted", "train_partial",
    ]  # fmt: skip
    proc = run_cli(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "found 0 of 4 groups with mixed rewards in 2 generation rounds" in proc.stderr
    assert "consecutive rollout batches had no group with mixed correctness" in proc.stderr
    _, history = finished_run(tmp_path, "dapo")
    assert [m.value for m in history["train/dynamic_sampling_exhausted"]] == [1.0, 1.0]
    assert "train/grad_norm" not in history  # nothing was trained on


@pytest.mark.e2e
def test_dapo_rounds_running_out_stop_the_run_with_one_error_line(tmp_path, tiny_policy_dir, monkeypatch, capsys):
    """The preset's default `on_exhausted: error` (the recipe's): no silent training on fewer groups. In process,
    on the HF engine: the error is the dynamic sampling's, whatever the engine."""
    monkeypatch.setattr(logging.root, "handlers", [])  # main's logging.basicConfig binds this test's stderr
    args = [*preset_args(tmp_path, "dapo", tiny_policy_dir), "--rollout_batches", "1", "--rollout.engine", "hf",
            "--model.init_args.max_num_gen_batches", "1"]  # fmt: skip
    code, _, stderr = run_in_process(args, tmp_path, monkeypatch, capsys)
    assert code == 2, stderr[-4000:]
    err = stderr.strip().splitlines()[-1]
    assert err.startswith("error: dynamic sampling found 0 of 4 groups") and "on_exhausted" in err, err
    assert stderr.count("error:") == 1 and "Traceback" not in stderr


THR_ON_GSPO_TOKEN = [
    "--model.init_args.shapers.thr.p=-0.2",
    "--model.init_args.num_mini_batches=2",
]  # the README's example, with two prompts per mini-batch for the 4-prompt test batch


@pytest.mark.e2e
@pytest.mark.parametrize(
    "algo,extra,p",
    [("thr", [], 0.2), ("gspo-token", THR_ON_GSPO_TOKEN, -0.2)],  # thr-explore: thr's step with p < 0, as here
)
def test_thr_presets_two_step_fit(tmp_path, quick_warm_start, algo, extra, p):
    _, model_dir = quick_warm_start
    run, history = two_batch_run(tmp_path, model_dir, algo, extra)
    assert float(run.data.params["model.init_args.shapers.thr.p"]) == p
    for key in ("train/thr/dominant_frac", "train/thr/positive_frac", "train/thr/abs_p90",
                "train/thr/abs_entropy_spearman", "time/attribution"):  # fmt: skip
        assert key in history, key
    scored = assert_thr_reweighted(history)
    if run.data.params["model.init_args.num_mini_batches"] == "1":
        # One on-policy update per rollout batch: GRPO's loss is −(1/N)·Σ_n Â_n·ratio = 0 up to rounding
        # (the advantages of a group sum to 0; β·KL is 0 at θ_ref), unless THR reweighted the tokens.
        loss = {m.step: m.value for m in history["train/loss"]}
        assert all(abs(loss[step]) > 1e-4 for step in scored), loss
    assert {"val/pass_at_4", "val/pass_at_8", "val/pass_at_8_se"} <= set(history)


@pytest.mark.e2e
def test_oar_presets_two_step_fit(tmp_path, quick_warm_start):
    """OAR-G and OAR-P from the same seed: the same rollouts and the same GRPO, but for OAR's weights."""
    _, model_dir = quick_warm_start
    first_scored, grad_norms = {}, {}
    for algo in ("oar-g", "oar-p"):
        run_dir = tmp_path / algo
        run_dir.mkdir()
        run, history = two_batch_run(run_dir, model_dir, algo)
        assert run.data.params["model.init_args.shapers.oar.method"] == ("gradient" if algo == "oar-g" else "perturbation")
        for key in ("train/oar/weight_p50", "train/oar/suppressed_frac", "train/oar/boosted_frac",
                    "train/oar/no_answer_span_frac", "time/attribution"):  # fmt: skip
            assert [m.step for m in history[key]] == [0, 1], key
        # OAR acted: in some rollout batch it scored reasoning tokens and gave them weights other than 1.
        scored = [m.step for m in history["train/oar/scored"] if m.value > 0]
        assert scored, "no rollout with a non-zero advantage and an answer span: OAR had nothing to weigh"
        for step in scored:
            low, high, suppressed, boosted = (history[f"train/oar/{k}"][step].value
                                              for k in ("weight_min", "weight_max", "suppressed_frac", "boosted_frac"))  # fmt: skip
            assert low < 1 < high and suppressed > 0 and boosted > 0, (low, high, suppressed, boosted)
        first_scored[algo], grad_norms[algo] = scored[0], values(history, "train/grad_norm")
    # Up to the first batch OAR weighs, the two runs are the same (seed, rollouts, GRPO update); from
    # there they differ only in OAR's weights, which reached the update if the gradients differ.
    step = first_scored["oar-g"]
    assert first_scored["oar-p"] == step, first_scored
    assert abs(grad_norms["oar-g"][step] - grad_norms["oar-p"][step]) > 1e-3, grad_norms
