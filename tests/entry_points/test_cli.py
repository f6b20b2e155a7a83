"""The command line as a user runs it: a 2-step fit on the real vLLM engine, a researcher's own pieces from
outside the package (`--imports`, entry points, `make list`), and one-line errors on bad input."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

# Imported at collection, as a real CLI process imports it before anything is printed: Lightning binds its logger's
# handler to the sys.stderr of the moment it is first imported, which inside a test is that test's capture.
from rlvr_lightning.cli import main
from tests.support.cli import BASE, REPO, run_cli, run_in_process, small_run_args


@pytest.mark.e2e
@pytest.mark.parametrize("engine", ["vllm", "hf"])
def test_two_step_fit_writes_an_mlflow_run(two_step_runs, engine):
    verbose = engine == "hf"  # one run of each: the quiet default and everything
    proc, tmp_path = two_step_runs.get(engine), two_step_runs.root
    assert proc.returncode == 0, proc.stderr[-4000:]
    output = (proc.stdout + proc.stderr).replace("\r", "\n").splitlines()
    noise = ["GPU available", "reduce_op", "LeafSpec", "weights_only", "Loading weights", "Seed set to",
             "MLflow database tables"] + (["MEMBIND", "LD_PRELOAD", "set_num_threads", "Triton"] if engine == "vllm" else [])  # fmt: skip
    printed = [n for n in noise if any(n in line for line in output)]
    if verbose:
        assert "GPU available" in printed and "Seed set to" in printed, printed  # -v: the libraries' own output
    else:
        assert printed == [], printed
        other = [line for line in output if line.strip() and not line.startswith("rollout batches")]
        assert len(other) <= 30, other  # the bar aside, a short run prints a few lines and the summary
    summary = proc.stdout[proc.stdout.index(f"rlvr_lightning: grpo-{engine} (GRPO), 2 rollout batches") :]  # the run's name
    assert "held-out accuracy (T = 1): " in summary and "held-out greedy accuracy: " in summary

    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    experiment_id = client.get_experiment_by_name("rlvr_lightning").experiment_id
    (run,) = client.search_runs(experiment_id, filter_string=f"tags.engine = '{engine}'")
    assert run.info.status == "FINISHED"
    assert run.info.run_name == f"grpo-{engine}"
    assert run.data.tags["algorithm"] == "GRPO" and run.data.tags["model"] == str(two_step_runs.model_dir)
    assert run.data.tags["model_family"] == "qwen2" and run.data.tags["engine"] == engine
    assert run.data.tags["params"].endswith("M") and run.data.tags["devices"] == "1"
    assert run.info.run_id in summary and run.data.tags["mlflow.note.content"].strip("`\n").startswith(
        f"rlvr_lightning: grpo-{engine} (GRPO), 2 rollout batches")  # the summary is the run's description  # fmt: skip
    assert "system/cpu_utilization_percentage" in run.data.metrics  # MLflow's system metrics (every 10 s by default)
    datasets = {(d.dataset.name, d.tags[0].value, json.loads(d.dataset.profile)["num_rows"])
                for d in run.inputs.dataset_inputs}  # fmt: skip
    assert datasets == {("embedded-train", "training", 8320), ("embedded-test", "evaluation", 8)}, datasets
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # the UI's training views
    assert run.data.params["model.init_args.optim.lr"] == "3e-05"
    assert run.data.params["rollout.engine"] == engine
    history = {k: client.get_metric_history(run.info.run_id, k) for k in run.data.metrics}
    for key in (
        "train/reward_mean", "train/reward_std", "train/frac_reward_zero_std", "train/response_length_mean",
        "train/response_clip_ratio", "train/clip_frac", "train/entropy", "train/kl", "train/grad_norm",
        "train/lr", "train/policy_version", "train/logprob_mismatch_mean", "time/rollout", "time/reward",
        "time/old_logprob", "time/update", "time/weight_sync", "throughput/rollout_tokens_per_s",
        "train/verifier_errors", "train/verifier_timeouts",
    ):  # fmt: skip
        assert [m.step for m in history[key]] == [0, 1], key
    assert [m.value for m in history["train/policy_version"]] == [1.0, 2.0]
    assert max(m.value for m in history["train/logprob_mismatch_mean"]) < 1e-3
    # GRPO's K = 1 is on policy for its single update: ratio exactly 1, nothing clipped.
    assert all(abs(m.value - 1) < 1e-6 for m in history["train/ratio_mean"])
    assert all(m.value == 0 for m in history["train/clip_frac_high"] + history["train/clip_frac_low"])
    assert [m.step for m in history["val/accuracy"]] == [0, 2]  # before RL and after the last step
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id)]
    assert "config.yaml" in artifacts
    logged = sorted(a.path for a in client.list_artifacts(run.info.run_id, "samples"))
    samples = [p for p in logged if "/val_step_" in p]
    assert samples == ["samples/val_step_000000.json", "samples/val_step_000002.json"]  # one per evaluation
    # The training completions and their token view: every 10th rollout batch, the first included.
    assert [p for p in logged if p not in samples] == ["samples/tokens_step_000000.html", "samples/train_step_000000.json"]
    table = json.loads(Path(client.download_artifacts(run.info.run_id, samples[0], str(tmp_path))).read_text())
    assert table["columns"] == ["step", "prompt", "gold", "completion", "turns", "finish_reason", "correct",
                                "parsed_answer", "reward"]  # fmt: skip
    assert 0 < len(table["data"]) <= 16
    assert "val/maj_at_8" in history and "val/pass_at_8_se" in history
    export = Path(run.data.tags["export/final"])  # HFExport of configs/base.yaml, under the working directory
    assert export == (tmp_path / "exports" / run.info.run_id / "final").resolve()
    assert (export / "config.json").exists() and (export / "tokenizer.json").exists()


def test_print_config_shows_the_resolved_algorithm(tmp_path, monkeypatch, capsys):
    code, out, err = run_in_process([*BASE, "--print_config"], tmp_path, monkeypatch, capsys)
    assert code == 0, err[-2000:]
    model = yaml.safe_load(out)["model"]
    assert model["class_path"] == "rlvr_lightning.algos.grpo.GRPO"
    assert model["init_args"]["policy_loss"] == {"name": "ppo-clip", "knobs": {"clip_eps_low": 0.2, "clip_eps_high": 0.2}}


def test_unknown_algo_lists_the_valid_ones():
    proc = subprocess.run(["make", "-s", "train", "ALGO=nope"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "unknown ALGO 'nope'" in proc.stderr and "grpo" in proc.stderr


@pytest.mark.parametrize(
    "lines,field_args,expected",
    [
        (['{"problem": "1+1", "answer": "2"}', '{"problem": "2+2", "answer": "4"}', "{not json"], [], "line 3"),
        (['{"question": "1+1", "result": "2"}'], [], "answer"),
        (['{"problem": "1+1", "answer": "2"}'], ["--data.answer_field", "gold"], "gold"),
    ],
    ids=["malformed-line", "missing-answer-field", "unknown-explicit-field"],
)
def test_bad_data_file_is_a_clear_error_before_training(tmp_path, tiny_policy_dir, lines, field_args, expected,
                                                        monkeypatch, capsys):  # fmt: skip
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(lines) + "\n")
    args = [*small_run_args(tmp_path, tiny_policy_dir), "--data.train_data", str(data), *field_args]
    code, _, stderr = run_in_process(args, tmp_path, monkeypatch, capsys)
    assert code == 2, stderr[-3000:]
    err = stderr.strip().splitlines()[-1]
    assert err.startswith("error:") and str(data) in err and expected in err
    assert "Traceback" not in stderr
    if expected == "answer":
        assert "question" in err and "result" in err  # the columns that were found


def test_filtered_sampling_with_truncated_is_is_refused_before_training(tmp_path, tiny_policy_dir, monkeypatch, capsys):
    args = [*small_run_args(tmp_path, tiny_policy_dir), "--rollout.top_p", "0.9", "--model.init_args.rollout_correction.name", "tis-token"]
    code, _, stderr = run_in_process(args, tmp_path, monkeypatch, capsys)
    assert code == 2, stderr[-3000:]
    err = stderr.strip().splitlines()[-1]
    assert err.startswith("error:") and "rollout.top_p=0.9" in err and "allow_filtered_rollout_logprobs" in err
    assert "Traceback" not in stderr


def test_missing_model_path_is_a_clear_error(tmp_path, tiny_policy_dir, monkeypatch, capsys):
    args = [*small_run_args(tmp_path, tiny_policy_dir), "--data.model_name_or_path", str(tmp_path / "no_model")]
    code, _, stderr = run_in_process(args, tmp_path, monkeypatch, capsys)
    assert code == 2
    assert "does not exist" in stderr and str(tmp_path / "no_model") in stderr
    assert "Traceback" not in stderr


def test_embedded_warm_start_is_cached_and_partially_correct(quick_warm_start):
    from rlvr_lightning.models.warm_start import embedded_policy_path

    cfg, path = quick_warm_start
    meta = json.loads((path / "warm_start.json").read_text())
    assert meta["config"]["steps"] == cfg.steps
    mtime = (path / "model.safetensors").stat().st_mtime
    assert embedded_policy_path(cfg) == path  # second call reuses the cache...
    assert (path / "model.safetensors").stat().st_mtime == mtime  # ...without rebuilding
    assert (path / "tokenizer.json").exists() and (path / "config.json").exists()


def test_a_run_names_the_warm_start_it_began_from(quick_warm_start, monkeypatch, tiny_policy_dir):
    """Each embedded run tags the digest of the warm-start weights it loaded (a build elsewhere may differ)."""
    import hashlib

    from rlvr_lightning.models import warm_start

    cfg, path = quick_warm_start
    monkeypatch.setitem(warm_start.EMBEDDED_WARM_STARTS, "embedded-quick", cfg)
    expected = hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()[:12]
    assert warm_start.warm_start_digest("embedded-quick") == expected
    assert warm_start.warm_start_digest(str(tiny_policy_dir)) is None  # a model's own path names it


@pytest.mark.parametrize("name,digest", [("embedded", "66d538c8f3b0"), ("embedded-tir", "733e46ce7e61")])
def test_the_shipped_warm_starts_are_the_ones_every_machine_starts_from(name, digest, tmp_path, monkeypatch):
    """Built here it would cost minutes (`embedded-tir`: 2000 steps) and, without the pinned kernels, follow this CPU's;
    every machine starts from the weights the package ships (the default's are the results pages' `66d538c8f3b0`),
    with no training, and transformers loads them."""
    import hashlib

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rlvr_lightning.models import warm_start

    monkeypatch.setenv("RLVR_CACHE_DIR", str(tmp_path))
    cfg = warm_start.EMBEDDED_WARM_STARTS[name]
    shipped = warm_start.shipped_weights(cfg)
    assert shipped.is_file(), f"{name}'s key no longer names the shipped weights"
    monkeypatch.setattr(warm_start, "warm_start", lambda *a, **k: pytest.fail("the shipped warm start was trained"))
    path = warm_start.embedded_policy_path(cfg)
    assert hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()[:12] == digest
    assert json.loads((path / "warm_start.json").read_text())["shipped"] == shipped.name
    model = AutoModelForCausalLM.from_pretrained(path)
    for name, tensor in load_file(shipped).items():
        assert torch.equal(model.state_dict()[name], tensor), name


# ---- a researcher's own pieces, from a directory outside the package --------------------------------------

# An advantage estimator and a policy loss as a researcher writes them, in their own module.
OWN_PIECES = '''"""My pieces."""

import torch

from rlvr_lightning.pieces import advantage_estimators, policy_losses


@advantage_estimators.register("centred", anchor=None)
def centred(inputs, *, centred_scale: float = 1.0):
    """The group-centred reward, times centred_scale."""
    r = inputs.rewards.view(-1, inputs.group_size).float()
    return ((r - r.mean(1, keepdim=True)) * centred_scale).view(-1)


@policy_losses.register("plain-ratio", anchor=None)
def plain_ratio(x):
    """The unclipped surrogate: minus the per-token ratio times the advantage."""
    ratio = (x.logp - x.old_logp).exp()
    none = torch.zeros_like(x.mask, dtype=torch.bool)
    return -ratio * x.advantages, {"ratio": ratio.detach(), "clipped_low": none, "clipped_high": none}
'''
# The preset's policy loss knobs (its clip range) are cleared: plain-ratio reads none.
OWN_ARGS = ["--model.init_args.advantage_estimator.name", "centred", "--model.init_args.policy_loss.name", "plain-ratio",
            "--model.init_args.policy_loss.knobs", "{}"]  # fmt: skip


@pytest.fixture
def own_pieces(tmp_path) -> Path:
    """The directory holding the researcher's module `my_rl_pieces` (not on the path until a run puts it there)."""
    research = tmp_path / "research"
    research.mkdir()
    (research / "my_rl_pieces.py").write_text(OWN_PIECES)
    return research


def test_imports_makes_ones_own_piece_names_parse_and_list(tmp_path, own_pieces):
    """`imports:` in a config file loads the module before parsing, so its names are valid values, and the
    saved config names the module; `list --imports` lists its pieces with the module as their docs."""
    mine = tmp_path / "mine.yaml"
    mine.write_text("imports: [my_rl_pieces]\nmodel:\n  init_args:\n"
                    "    advantage_estimator: {name: centred, knobs: {centred_scale: 0.5}}\n"
                    "    policy_loss: {name: plain-ratio, knobs: {}}\n")  # fmt: skip
    proc = run_cli([*BASE, "--config", str(mine), "--print_config"], tmp_path, timeout=300, pythonpath=(own_pieces,))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "imports:\n- my_rl_pieces\n" in proc.stdout
    model = yaml.safe_load(proc.stdout)["model"]["init_args"]
    assert model["advantage_estimator"] == {"name": "centred", "knobs": {"centred_scale": 0.5}}
    assert model["policy_loss"] == {"name": "plain-ratio", "knobs": {}}  # the file's knobs replace the preset's

    proc = run_cli(["list", "--imports", "my_rl_pieces"], tmp_path, timeout=300, pythonpath=(own_pieces,))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "    centred                  The group-centred reward, times centred_scale. [knobs: centred_scale=1.0]  (my_rl_pieces)" in lines
    assert "    plain-ratio              The unclipped surrogate: minus the per-token ratio times the advantage.  (my_rl_pieces)" in lines


def test_an_installed_packages_entry_points_are_loaded_by_every_command(tmp_path, own_pieces):
    """A distribution on the path (its dist-info, as pip installs it) declares `my_rl_pieces` in the group
    `rlvr_lightning.pieces`: `list` shows its pieces without `--imports`. A broken entry point is one line."""
    site = tmp_path / "site"
    dist = site / "my_rl_pieces-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-rl-pieces\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[rlvr_lightning.pieces]\nmine = my_rl_pieces\n")
    proc = run_cli(["list"], tmp_path, timeout=300, pythonpath=(site, own_pieces))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(my_rl_pieces)" in proc.stdout and "    centred " in proc.stdout

    (dist / "entry_points.txt").write_text("[rlvr_lightning.pieces]\nmine = my_rl_piecez\n")  # misspelt
    proc = run_cli(["list"], tmp_path, timeout=300, pythonpath=(site, own_pieces))
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr[-3000:]
    assert "entry point 'mine' of my-rl-pieces" in err[0] and "'my_rl_piecez'" in err[0] and "PYTHONPATH" in err[0]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--imports", "my_missing_pieces"], ["error: --imports: cannot import 'my_missing_pieces'", "on PYTHONPATH"]),
        (["--model.init_args.policy_loss.name", "my_missing_pieces.my_loss"],
         ["error: model.policy_loss='my_missing_pieces.my_loss': cannot import it", "on PYTHONPATH"]),
        (["--model.init_args.policy_loss.name", "plain-ratio"], ["error: model.policy_loss='plain-ratio'; registered: ppo-clip"]),
        (["--model.init_args.optim.lr", "fast"], ["error: model.optim.lr: Expected a <class 'float'>. Got value: fast"]),
        (["--model.init_args.clip_eps_hgh", "0.3"], ["error: model: Option 'clip_eps_hgh' is not accepted"]),
        (["--rollout.group_sise", "4"], ["error: unrecognized arguments: --rollout.group_sise 4"]),
    ],
    ids=["module-not-on-path", "unimportable-dotted-path", "unknown-name", "bad-type", "unknown-key", "unknown-flag"],
)  # fmt: skip
def test_a_config_error_is_one_line(args, expected, capsys, tmp_path, monkeypatch):
    """No usage dump, no nested account of jsonargparse's union types: the option and what is wrong."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["rlvr_lightning"])  # pytest's own flags are not the CLI's
    base = [*BASE[:1], *(str(REPO / a) if a.startswith("configs/") else a for a in BASE[1:])]
    with pytest.raises(SystemExit) as exit_info:
        main([*base, *args, "--print_config"])  # should the arguments parse after all: print them, train nothing
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1, err[-40:]
    assert err[0].startswith(expected[0]) and all(e in err[0] for e in expected[1:]), err[0]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--model.init_args.policy_loss.name", "sapo", "--model.init_args.policy_loss.knobs", "{sapo_tau_poz: 1.0}"],
         "error: model.policy_loss=sapo does not read the knob 'sapo_tau_poz'; its knobs: sapo_tau_pos, sapo_tau_neg"),
        (["--model.init_args.policy_loss.name", "sapo"],  # the preset's clip range, which SAPO does not read
         "error: model.policy_loss=sapo does not read the knob 'clip_eps_low'; its knobs: sapo_tau_pos, sapo_tau_neg "
         "(set them with --model.init_args.policy_loss.knobs.<knob>; --model.init_args.policy_loss.knobs '{}' clears"),
        (["--model.init_args.policy_loss.name", "sapo", "--model.init_args.policy_loss.knobs", "{sapo_tau_pos: -1.0}"],
         "error: model.policy_loss=sapo: the gate's temperatures must be > 0"),
        (["--model.init_args.policy_loss.knobs.clip_eps_hihg", "0.28"],
         "error: model.policy_loss=ppo-clip does not read the knob 'clip_eps_hihg'; its knobs: clip_eps_low, clip_eps_high, "
         "dual_clip_c"),
        (["--data.tool.max_calls", "2", "--data.environment", "rlvr_lightning.environments.python_tool.PythonTool"],
         "error: data.tool and data.environment: set one"),
    ],
    ids=["misspelt-knob", "a-presets-knobs-kept", "failing-knob-check", "misspelt-knob-flag", "tool-and-environment"],
)  # fmt: skip
def test_a_knob_the_module_refuses_is_one_line(args, expected, capsys, tmp_path, monkeypatch):
    """Refused while the module is built, before any weights: a knob its piece does not read (misspelt, or the
    preset's knobs of another piece), a piece's own check, the Python tool and an environment of one's own both set."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["rlvr_lightning"])
    monkeypatch.setattr(logging.root, "handlers", [])  # main's logging.basicConfig binds this test's stderr, not an earlier one's
    base = [*BASE[:1], *(str(REPO / a) if a.startswith("configs/") else a for a in BASE[1:])]
    with pytest.raises(SystemExit) as exit_info:  # should it be accepted after all: no model there, fit stops at once
        main([*base, *args, "--data.model_name_or_path", str(tmp_path / "no_model"), "--plan.check=false",
              "--trainer.logger.init_args.tracking_uri", f"sqlite:///{tmp_path}/mlflow.db"])  # fmt: skip
    err = capsys.readouterr().err  # in-process, the libraries' notes that `python -m rlvr_lightning` silences print too
    assert exit_info.value.code == 2 and err.strip().splitlines()[-1].startswith(expected), err[-3000:]
    assert err.count("error:") == 1 and "Traceback" not in err


def test_the_summary_names_the_run_and_its_pieces():
    from types import SimpleNamespace

    from rlvr_lightning.algos import GRPO
    from rlvr_lightning.callbacks.summary import summary_lines

    lines = summary_lines(SimpleNamespace(loggers=[], callbacks=[]), GRPO(policy_loss="cispo", kl_coef=0.0))
    assert lines[:2] == ["rlvr_lightning: GRPO, 0 rollout batches",
                         "  pieces: advantage_estimator=grpo, policy_loss=cispo, loss_agg=seq-mean-token-mean, "
                         "rollout_correction=none, proximal_policy=recompute"]  # fmt: skip


def test_make_plan_takes_a_preset_files_path_as_algo(tmp_path):
    """`ALGO=` is a preset's name or the path of a preset file (make train, plan and doctor compose it alike)."""
    venv = tmp_path / "venv"  # make's $(VENV), set up already: its python is the one running the tests
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    (venv / ".installed").touch()
    mine = tmp_path / "my_preset.yaml"
    mine.write_text((REPO / "configs" / "algo" / "gspo.yaml").read_text() + "rollout:\n  group_size: 3\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "RLVR_CACHE_DIR": str(tmp_path / "cache")}
    make = ["make", "-s", "-C", str(REPO), f"VENV={venv}"]
    # --print_config: what the plan would be made from (the parse `make plan` shares with train), then exit.
    proc = subprocess.run([*make, "plan", f"ALGO={mine}", "ARGS=--print_config"], capture_output=True, text=True,
                          env=env, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "class_path: rlvr_lightning.algos.gspo.GSPO" in proc.stdout and "  group_size: 3\n" in proc.stdout
    proc = subprocess.run([*make, "plan", f"ALGO={tmp_path / 'nope.yaml'}"], capture_output=True, text=True, env=env)
    assert proc.returncode != 0 and f"unknown ALGO '{tmp_path / 'nope.yaml'}'" in proc.stderr


def test_list_never_cuts_a_description_and_says_why_k_1_never_clips(capsys):
    from rlvr_lightning.catalogue import main as list_everything

    list_everything([])
    out = capsys.readouterr().out
    assert "…" not in out
    text = " ".join(out.split())  # wrapped lines joined
    for whole in (
        "GMPO (arXiv 2507.20673): the geometric mean of token ratios, each clipped in log space to [−0.4, 0.4] on the "
        "side the advantage pushes (docs/algorithms.md#gmpo).",
        "SAPO (arXiv 2511.20347): a temperature-controlled soft gate in place of the hard clip, τ_pos 1.0 and τ_neg "
        "1.05 (docs/algorithms.md#sapo).",
        "Dr. GRPO (arXiv 2503.20783): GRPO without the std division and without 1/|o|;",  # "Dr." ends no sentence
        "GMPO: the geometric mean of the token ratios, each clipped in log space to [−ε_low, ε_high] on the side the "
        "sequence advantage pushes (above for Â > 0, below for Â < 0); one term per sequence.",
        "SAPO: a soft gate f(r) = (4/τ)·σ(τ(r − 1)) in place of the hard clip, −f(r)·Â per token; τ_pos for Â > 0, "
        "τ_neg otherwise.",
        "With K = 1 every step is exactly on policy (π_θ = π_old: each ratio is 1), so a ratio-based loss's clipping "
        "never acts",
    ):  # fmt: skip
        assert whole in text, whole
    for line in out.splitlines():  # a preset's description continues under itself, never into the next column
        assert len(line) <= 120 or line.startswith("    "), line


@pytest.mark.e2e
def test_a_researchers_own_loss_and_estimator_train_and_name_the_run(tmp_path, tiny_policy_dir, own_pieces):
    """The acceptance run: a loss and an estimator written outside the package, loaded with `--imports`,
    selected by their registered names; the run's name, tags, params and summary say which pieces ran."""
    args = [*small_run_args(tmp_path, tiny_policy_dir), "--rollout_batches", "1", "--imports", "my_rl_pieces",
            *OWN_ARGS, "--model.init_args.advantage_estimator.knobs.centred_scale", "0.5",
            "--rollout.engine", "hf"]  # the pieces are the engine's concern in no way; HF starts faster  # fmt: skip
    proc = run_cli(args, tmp_path, pythonpath=(own_pieces,))
    assert proc.returncode == 0, proc.stderr[-4000:]
    name = "grpo+advantage_estimator=centred+policy_loss=plain-ratio"
    assert f"rlvr_lightning: {name} (GRPO), 1 rollout batches" in proc.stdout, proc.stdout[-3000:]
    assert "  pieces: advantage_estimator=centred, policy_loss=plain-ratio, loss_agg=seq-mean-token-mean, " in proc.stdout

    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("rlvr_lightning").experiment_id])
    assert run.info.run_name == name and run.info.status == "FINISHED"
    tags, params = run.data.tags, run.data.params
    assert tags["preset"] == "grpo" and tags["changes"] == "advantage_estimator=centred+policy_loss=plain-ratio"
    assert tags["piece.advantage_estimator"] == "centred" and tags["piece.policy_loss"] == "plain-ratio"
    assert params["model.init_args.advantage_estimator.name"] == "centred" and params["imports"] == "my_rl_pieces"
    assert params["model.init_args.advantage_estimator.knobs.centred_scale"] == "0.5"
    assert params["model.init_args.policy_loss.name"] == "plain-ratio"


def test_make_compare_keeps_a_run_with_other_pieces_apart_from_the_presets(tmp_path):
    """By default `make compare` takes the latest run of each name: a run named after the pieces it changed
    is its own row, its algorithm column naming them, not a later GRPO baseline."""
    import mlflow

    from rlvr_lightning.compare import load_history, markdown_table, select_runs

    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.create_experiment("rlvr_lightning", artifact_location=str(tmp_path / "artifacts"))
    for name, changed in (("grpo", None), ("grpo+policy_loss=plain-ratio", "policy_loss=plain-ratio")):
        tags = {"algorithm": "GRPO", "preset": "grpo", **({"changes": changed} if changed else {})}
        run = client.create_run(exp, run_name=name, tags=tags)
        client.log_metric(run.info.run_id, "train/accuracy", 0.5, step=0)
        client.set_terminated(run.info.run_id)
    table = markdown_table([load_history(client, r) for r in select_runs(client, exp, None)])
    assert "| grpo | GRPO | 1 |" in table
    assert "| grpo+policy_loss=plain-ratio | GRPO+policy_loss=plain-ratio | 1 |" in table
