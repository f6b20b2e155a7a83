"""In-training evaluation on a list of named benchmarks: each shared benchmark file loads by
path, prompts that do not fit the engine next to that benchmark's max_tokens are dropped, each benchmark
gets its own sampling settings, recorded as params next to its `val/<name>/…` scores."""

from __future__ import annotations

import pytest

from rlvr_lightning.callbacks.evaluation import Benchmark, Evaluation
from rlvr_lightning.data.datamodule import RolloutDataModule
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.rewards.settings import RewardSettings, VerifierSettings
from rlvr_lightning.rollout.settings import RolloutSettings
from rlvr_lightning.training.scoring import Scoring
from tests.conftest import BENCHMARKS, needs_benchmarks


def datamodule(model_dir, **overrides) -> RolloutDataModule:
    # The tiny policy has a byte-level tokenizer and 256 positions: only the short benchmark problems fit.
    kwargs = dict(model_name_or_path=str(model_dir), batch_size=4, max_prompt_length=200, val_size=12)
    dm = RolloutDataModule(**(kwargs | overrides), rollout=RolloutSettings(max_response_length=40))
    dm.setup("fit")
    return dm


@needs_benchmarks
def test_each_shared_benchmark_becomes_a_task_with_its_own_sampling(tiny_policy_dir):
    dm = datamodule(tiny_policy_dir)
    benchmarks = [
        Benchmark(name="math500", source=str(BENCHMARKS / "math500.jsonl"), n=4, temperature=0.6, top_p=0.95),
        Benchmark(name="gsm8k", source=str(BENCHMARKS / "gsm8k.jsonl"), limit=300, max_tokens=16),
        Benchmark(name="aime24", source=str(BENCHMARKS / "aime24.jsonl"), max_tokens=8),
        Benchmark(name="amc23", source=str(BENCHMARKS / "amc23.jsonl"), max_tokens=8),
        Benchmark(name="arith", source="embedded", limit=5, pass_k=[1, 2], maj_k=[2]),
    ]
    tasks = Evaluation(num_samples=8, pass_k=[1, 8], maj_k=[8], benchmarks=benchmarks).tasks(dm)
    assert [t.prefix for t in tasks] == ["val", "val/math500", "val/gsm8k", "val/aime24", "val/amc23", "val/arith"]
    by = {t.prefix: t for t in tasks}
    assert len(by["val"].records) == 12 and by["val"].sampling.group_size == 8 and by["val"].pass_k == [1, 8]
    math = by["val/math500"]
    sampling = math.sampling
    assert (sampling.group_size, sampling.temperature, sampling.top_p, sampling.max_tokens) == (4, 0.6, 0.95, 40)
    assert math.pass_k == [1] and math.maj_k == []  # the Evaluation's k above this benchmark's n are left out
    for t in tasks[1:4]:  # prompt + max_tokens must fit the engine's 240 tokens
        room = 240 - t.sampling.max_tokens
        assert 0 < len(t.records) and all(len(dm.prompt_ids(r.problem)) <= room for r in t.records)
    assert len(by["val/gsm8k"].records) == 300  # the first 300 that fit: the long problems before them skipped
    assert len(by["val/aime24"].records) < 30
    assert by["val/arith"].pass_k == [1, 2] and by["val/arith"].maj_k == [2] and len(by["val/arith"].records) == 5
    params = by["val/math500"].params()
    assert params["val/math500/temperature"] == 0.6 and params["val/math500/n"] == 4
    assert params["val/math500/problems"] == len(math.records)


@needs_benchmarks
def test_benchmark_without_any_fitting_prompt_is_a_config_error(tiny_policy_dir):
    dm = datamodule(tiny_policy_dir, max_prompt_length=30)
    evaluation = Evaluation(benchmarks=[Benchmark(name="aime", source=str(BENCHMARKS / "aime24.jsonl"))])
    with pytest.raises(ConfigError, match=r"benchmarks\[aime\]: no problem .* fits 30 prompt tokens"):
        evaluation.tasks(dm)
    too_long = Evaluation(benchmarks=[Benchmark(name="x", max_tokens=500)])
    with pytest.raises(ConfigError, match="max_tokens=500 leaves no room"):
        too_long.tasks(dm)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(benchmarks=[Benchmark(name="a"), Benchmark(name="a")]), "must be unique"),
        (dict(benchmarks=[Benchmark(name="a/b")]), "without '/'"),
        (dict(benchmarks=[Benchmark(name="a", n=2, pass_k=[4])]), r"benchmarks\[a\].pass_k=\[4\]"),
        (dict(num_samples=4, maj_k=[8]), r"maj_k=\[8\]"),
    ],
)
def test_bad_benchmark_settings_are_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Evaluation(**kwargs)


def test_missing_benchmark_file_is_reported_at_setup(tiny_policy_dir, tmp_path):
    from rlvr_lightning.data.sources import DataSourceError

    dm = datamodule(tiny_policy_dir)
    evaluation = Evaluation(benchmarks=[Benchmark(name="mine", source=str(tmp_path / "nope.jsonl"))])
    with pytest.raises(DataSourceError, match="data file not found"):
        evaluation.tasks(dm)


@needs_benchmarks
@pytest.mark.e2e
def test_benchmarks_are_scored_and_logged_under_their_names(tiny_policy_dir, tmp_path):
    from lightning.pytorch.loggers import MLFlowLogger

    from rlvr_lightning.algos.base import RLVRModule
    from rlvr_lightning.standalone import standalone

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    logger = MLFlowLogger(experiment_name="t", tracking_uri=uri, run_name="bench")
    dm = datamodule(tiny_policy_dir, val_size=6)
    evaluation = Evaluation(num_samples=2, pass_k=[1, 2], benchmarks=[
        Benchmark(name="gsm8k", source=str(BENCHMARKS / "gsm8k.jsonl"), limit=40, n=3, temperature=0.7, max_tokens=12),
    ])  # fmt: skip
    module = standalone(RLVRModule(), dm, callbacks=[evaluation], logger=logger)
    try:
        out = evaluation.evaluate(module.trainer, module)
    finally:
        module.teardown("validate")
        for cb in module.trainer.callbacks:
            cb.teardown(module.trainer, module, "validate")
    logger.finalize("success")
    expected = {"val/accuracy", "val/pass_at_2", "val/accuracy_greedy", "val/gsm8k/accuracy", "val/gsm8k/pass_at_1",
                "val/gsm8k/pass_at_2", "val/gsm8k/accuracy_greedy", "val/gsm8k/no_answer_frac"}  # fmt: skip
    assert expected <= set(out) and 0 < out["val/gsm8k/num_problems"] <= 40
    assert all(0 <= out[k] <= 1 for k in expected)
    import mlflow

    run = mlflow.tracking.MlflowClient(tracking_uri=uri).get_run(logger.run_id)
    assert expected <= set(run.data.metrics)
    assert run.data.params["val/gsm8k/temperature"] == "0.7" and run.data.params["val/gsm8k/max_tokens"] == "12"
    assert run.data.params["val/gsm8k/n"] == "3" and run.data.params["val/n"] == "2"


@pytest.mark.parametrize("n, world, batch_size", [(200, 2, 64), (129, 2, 64), (128, 2, 64), (7, 3, 2), (5, 4, 8), (64, 1, 64)])
def test_ranks_score_disjoint_shares_in_equally_many_batches(n, world, batch_size):
    """Under several ranks each scores its share of the held-out set; every rank calls the engine equally
    often (an FSDP-sharded HF engine's generate is a collective); a set too small to share is scored whole."""
    from rlvr_lightning.callbacks.evaluation import rank_batches

    records = list(range(n))
    per_rank = [rank_batches(records, r, world, batch_size) for r in range(world)]
    sharded = {s for _, s in per_rank}
    assert len(sharded) == 1
    counts = {len(batches) for batches, _ in per_rank}
    assert len(counts) == 1  # the same number of generate calls on every rank
    assert all(0 < len(b) <= batch_size for batches, _ in per_rank for b in batches)
    scored = sorted(x for batches, _ in per_rank for b in batches for x in b)
    if sharded.pop():
        assert scored == records  # disjoint and complete
    else:
        assert scored == sorted(records * world)  # every rank scores the whole set
    if world > 1 and n >= world * batch_size:
        assert per_rank[0][1]  # large sets are always shared


def test_an_evaluation_scores_any_sampler_without_a_trainer(tiny_policy_dir):
    """`Evaluation.run` on a plain target (what `make eval` builds): problem i of the held-out set gets
    c_i = i mod 5 correct completions of n = 4 (c = 4 stands for all), so accuracy, the unbiased pass@k,
    greedy accuracy (the first sample) and the no-answer fraction are known in closed form."""
    from math import comb

    from rlvr_lightning.callbacks.evaluation import EvalTarget
    from rlvr_lightning.rollout.types import Completion
    from rlvr_lightning.training.generation import to_rollout

    dm = datamodule(tiny_policy_dir, val_size=10)
    tok, n = dm.tokenizer, 4
    correct = {p: min(i % 5, n) for i, p in enumerate(dm.collate(dm.val_records).prompts)}
    calls = []

    def scripted(batch, sampling):
        calls.append(sampling)
        texts = [
            [f"so \\boxed{{{gold}}}" if j < correct[p] else ("no answer" if j == n - 1 else "\\boxed{\\pi}") for j in range(sampling.group_size)]
            for p, gold in zip(batch.prompts, batch.answers)
        ]  # fmt: skip
        groups = [[Completion(tok(t).input_ids + [tok.eos_token_id], [0.0], "stop") for t in group] for group in texts]
        return to_rollout(tok, batch, [tok(p).input_ids for p in batch.prompts], sampling, groups, 0)

    scoring = Scoring(RewardSettings(verifier=VerifierSettings(num_workers=1)))
    evaluation = Evaluation(num_samples=n, pass_k=[1, 2, 4], batch_size=3)
    try:
        out = evaluation.run(EvalTarget(scripted, dm, scoring), step=0)
    finally:
        scoring.close()
    c = list(correct.values())
    assert out["val/num_problems"] == 10 and len(calls) == 2 * 4  # 4 batches of ≤ 3 prompts, sampled and greedy
    assert out["val/accuracy"] == pytest.approx(sum(c) / (n * 10))
    for k in (1, 2, 4):
        expected = sum(1 - comb(n - ci, k) / comb(n, k) for ci in c) / 10
        assert out[f"val/pass_at_{k}"] == pytest.approx(expected), k
    assert out["val/accuracy_greedy"] == pytest.approx(sum(ci > 0 for ci in c) / 10)
    assert out["val/no_answer_frac"] == pytest.approx(sum(ci < n for ci in c) / (n * 10))
    assert evaluation.run(EvalTarget(scripted, dm, scoring), step=0) is out and len(calls) == 8  # once per step


def credit(completion: str, gold: str, metadata: dict) -> float:
    """A run's own correctness (`rewards.correctness`): full, half or no credit, read off the answer."""
    return {"right": 1.0, "half": 0.5}.get(completion, 0.0)


def test_evaluation_reports_the_runs_own_correctness(tiny_policy_dir):
    """Evaluation scores as the run trains (`rewards.correctness`), here a function of the run's own that gives partial
    credit and none of math-verify's metrics: accuracy is the mean credit, pass@k counts full credit only, and the
    no-answer fraction is the answers without one, whatever gives correctness."""
    from rlvr_lightning.callbacks.evaluation import EvalTarget
    from rlvr_lightning.rollout.types import Completion
    from rlvr_lightning.training.generation import to_rollout

    dm = datamodule(tiny_policy_dir, val_size=4)
    tok, n = dm.tokenizer, 4

    def scripted(batch, sampling):
        texts = ["right", "half", "none", "none"][: sampling.group_size]
        groups = [[Completion(tok(t).input_ids + [tok.eos_token_id], [0.0], "stop") for t in texts] for _ in batch.prompts]
        return to_rollout(tok, batch, [tok(p).input_ids for p in batch.prompts], sampling, groups, 0)

    scoring = Scoring(RewardSettings(correctness="tests.callbacks.test_evaluation.credit"))
    out = Evaluation(num_samples=n, pass_k=[1, 4]).run(EvalTarget(scripted, dm, scoring), step=0)
    assert out["val/accuracy"] == pytest.approx(1.5 / 4)
    assert out["val/pass_at_1"] == pytest.approx(1 / 4) and out["val/pass_at_4"] == pytest.approx(1.0)
    assert out["val/no_answer_frac"] == 1.0 and out["val/accuracy_greedy"] == 1.0  # greedy: the first, "right"


def shortness(completion: str, gold: str, metadata: dict) -> float:
    """A reward function of the run's: 1 / the answer's length in characters."""
    return 1.0 / len(completion)


def test_the_held_out_samples_table_scores_each_first_answer_as_training_would(tiny_policy_dir, tmp_path):
    """The samples table of an evaluation, read back from a real MLflow store: the first answer to each of the first
    `log_samples` problems, across batches, with its correctness, each reward term (the run's reward function, run on
    these answers) and the reward they make, w_c·c + w·f, as the training table's columns name them."""
    import json

    from lightning.pytorch.loggers import MLFlowLogger

    from rlvr_lightning.callbacks.evaluation import EvalTarget
    from rlvr_lightning.rollout.types import Completion
    from rlvr_lightning.training.generation import to_rollout

    dm = datamodule(tiny_policy_dir, val_size=5)
    tok = dm.tokenizer

    def scripted(batch, sampling):
        texts = ["half", "right", "right", "none"][: sampling.group_size]
        groups = [[Completion(tok(t).input_ids + [tok.eos_token_id], [0.0], "stop") for t in texts] for _ in batch.prompts]
        return to_rollout(tok, batch, [tok(p).input_ids for p in batch.prompts], sampling, groups, 0)

    rewards = {"correctness": "tests.callbacks.test_evaluation.credit", "correctness_weight": 2.0,
               "functions": [{"function": "tests.callbacks.test_evaluation.shortness", "weight": 0.5}]}  # fmt: skip
    logger = MLFlowLogger(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", artifact_location=str(tmp_path / "artifacts"))
    evaluation = Evaluation(num_samples=4, greedy=False, batch_size=2, log_samples=3)
    evaluation.run(EvalTarget(scripted, dm, Scoring(RewardSettings.of(rewards)), logger), step=7)
    path = logger.experiment.download_artifacts(logger.run_id, "samples/val_step_000007.json", str(tmp_path))
    table = json.loads(open(path).read())
    assert table["columns"] == ["step", "prompt", "gold", "completion", "turns", "finish_reason", "correct",
                                "reward/shortness", "parsed_answer", "reward"]  # fmt: skip
    rows = [dict(zip(table["columns"], row)) for row in table["data"]]
    prompts = dm.collate(dm.val_records).prompts
    assert [r["prompt"] for r in rows] == prompts[:3]  # 3 problems over two batches of 2
    for r in rows:
        assert r["completion"] == "half" and r["correct"] == 0.5 and r["reward/shortness"] == 0.5 * 0.25
        assert r["reward"] == 2.0 * 0.5 + 0.5 * 0.25 and r["step"] == 7 and r["turns"] == 1
