"""Held-out evaluation with the rollout engine: before training, every N steps, and at the end.

`val/accuracy` is the accuracy of *sampled* completions at the training temperature (mean over
`num_samples` per problem): on small policies greedy accuracy is flat or noisy while the sampled
policy improves (seen on the embedded default), so greedy accuracy is logged beside it.
`val/pass_at_<k>` is the unbiased pass@k over the `num_samples` completions per problem
(`rlvr_lightning.metrics`), with its standard error `val/pass_at_<k>_se`, for each k in `pass_k`
(MLflow metric names cannot contain "@"), and `val/maj_at_<k>` (majority vote over the extracted
answers of the first k samples) for each k in `maj_k`. Every evaluation also logs a bounded table of
sample completions as the MLflow artifact `samples/<prefix>_step_<N>.json`: the first answer to each of the first
`log_samples` problems with the columns of the training completions table (`callbacks.completions`: prompt, gold,
completion with its turns, finish reason, correctness, each reward term) and its parsed answer and reward (w_c·c + Σ
terms: the run's reward functions run on these answers alone); held-out answers train nothing, so no advantage.

`benchmarks` adds named benchmarks (MATH-500, AIME24, … by path or HF name), each with its own
sampling settings: `val/<name>/accuracy`, `val/<name>/pass_at_<k>`, `val/<name>/maj_at_<k>`,
`val/<name>/accuracy_greedy`, with the settings recorded as MLflow params `val/<name>/temperature`, ….
Correctness is the run's own (`rewards.correctness`): math-verify against the gold by default (with the run's
`verifier` options), the environment's verdict, or your function; `accuracy` is its mean, and pass@k and maj@k
count an answer correct when it has full credit (c = 1). `make eval` scores with math-verify unless given
`--correctness`, the same values, so a run's held-out scores and `make eval` of its export agree given the run's.
Not a Lightning validation loop: evaluation needs the engine and the verifier, not `validation_step`.
`Evaluation.run` scores an `EvalTarget` (a sampler, the data module, the verifier, a logger), so `make eval`
evaluates a model without a training module or a trainer. Under several ranks (FSDP) each rank scores its
share of every set and the metrics are reduced over ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger

from rlvr_lightning.callbacks.answer_rows import answer_columns, table_of
from rlvr_lightning.callbacks.periodic import is_due
from rlvr_lightning.data.sources import ProblemRecord
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.metrics import MajAtK, PassAtK
from rlvr_lightning.rewards.extraction import extract_prediction
from rlvr_lightning.rollout.types import PromptBatch, Rollout, SamplingConfig


@dataclass
class Benchmark:
    """A named held-out benchmark with its own sampling settings; its metrics go to `val/<name>/…`.

    Unset sampling fields take the Evaluation's value (`n` = num_samples, `pass_k`, `maj_k`) or the
    `rollout:` section's (`temperature`, `top_p`, `max_tokens` = rollout.max_response_length).
    """

    name: str
    source: str = "embedded"  # `embedded` (its test split), a .jsonl/.json/.parquet file or an HF dataset name
    split: str = "test"
    problem_field: str | None = None
    answer_field: str | None = None
    id_field: str | None = None
    limit: int | None = None  # the first N problems whose prompt fits
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    pass_k: list[int] | None = None
    maj_k: list[int] | None = None


@dataclass(frozen=True)
class EvalTarget:
    """What one evaluation runs on: in training, the module's engine and the trainer's data module, logger and
    ranks (`Evaluation.target`); offline (`make eval`), an engine built for the model alone."""

    generate: Callable[[PromptBatch, SamplingConfig], Rollout]  # the policy's completions of a prompt batch
    data: Any  # the RolloutDataModule: held-out set, prompt template, `rollout:` settings, collate
    scoring: Any  # the run's scoring stage (`training.scoring.Scoring`): correctness as training scores it
    logger: Logger | None = None
    rank: int = 0
    world_size: int = 1
    sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None  # needed where world_size > 1


@dataclass
class _Task:
    """A benchmark resolved against the data module: its problems and its complete sampling settings."""

    prefix: str
    source: str
    records: list[ProblemRecord]
    sampling: SamplingConfig
    pass_k: list[int]
    maj_k: list[int]

    def params(self) -> dict[str, object]:
        s = self.sampling
        return {
            f"{self.prefix}/{k}": v
            for k, v in dict(
                source=self.source,
                problems=len(self.records),
                n=s.group_size,
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=s.top_k,
                max_tokens=s.max_tokens,
                seed=s.seed,
            ).items()
        }


class Evaluation(Callback):
    def __init__(
        self,
        every_n_steps: int = 20,
        num_samples: int = 4,
        temperature: float | None = None,
        greedy: bool = True,
        batch_size: int = 256,
        pass_k: list[int] | None = None,
        maj_k: list[int] | None = None,
        log_samples: int = 16,
        max_sample_chars: int = 2000,
        prefix: str = "val",
        benchmarks: list[Benchmark] | None = None,
    ) -> None:
        """
        Args:
            every_n_steps: evaluate after every N rollout batches (0 = only at start and end).
            num_samples: sampled completions per problem for `val/accuracy`.
            temperature: sampling temperature; null = the training temperature.
            greedy: also log `val/accuracy_greedy` (temperature 0, one completion).
            batch_size: prompts per engine call.
            pass_k: the k of `val/pass_at_<k>` (each ≤ num_samples); null = [num_samples].
            maj_k: the k of `val/maj_at_<k>` (each ≤ num_samples); null = none.
            log_samples: problems whose first sampled completion goes into the samples table (0 = off).
            max_sample_chars: prompts and completions longer than this are cut in the table.
            prefix: metric namespace (`val` in training; `eval` offline).
            benchmarks: named benchmarks evaluated besides `data.val_data` (set that to null for only
                these), each with its own sampling settings, logged as `<prefix>/<name>/…`; the settings
                are recorded as MLflow params `<prefix>/<name>/n`, `…/temperature`, ….
        """
        self.pass_k = list(pass_k) if pass_k is not None else [num_samples]
        self.maj_k = list(maj_k) if maj_k is not None else []
        _check_ks("Evaluation", num_samples, self.pass_k, self.maj_k)
        self.benchmarks = list(benchmarks or [])
        names = [b.name for b in self.benchmarks]
        if len(set(names)) < len(names) or any(not n or "/" in n for n in names):
            raise ConfigError(f"Evaluation.benchmarks: names must be unique, non-empty and without '/': {names}")
        for b in self.benchmarks:
            n = b.n or num_samples
            _check_ks(f"Evaluation.benchmarks[{b.name}]", n, b.pass_k or [], b.maj_k or [])
        self.log_samples, self.max_sample_chars, self.prefix = log_samples, max_sample_chars, prefix
        self.every_n_steps = every_n_steps
        self.num_samples = num_samples
        self.temperature = temperature
        self.greedy = greedy
        self.batch_size = batch_size
        self._last_step, self._latest = -1, {}
        self._tasks: list[_Task] | None = None
        self._params_logged = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # A missing file or a benchmark that fits no prompt fails before training.
        self.tasks(trainer.datamodule, pl_module.scoring)

    def tasks(self, dm, scoring: Any = None) -> list[_Task]:
        """The evaluation sets: `data.val_data` as `<prefix>/…`, then each benchmark as `<prefix>/<name>/…`.

        With the run's `scoring`, problems whose gold answer it cannot parse are left out (and reported)."""
        if self._tasks is not None:
            return self._tasks

        def usable(records: list[ProblemRecord], where: str) -> list[ProblemRecord]:
            return scoring.drop_unparseable_golds(records, where) if scoring is not None else records

        h, r = dm.hparams, dm.rollout
        temperature = self.temperature if self.temperature is not None else r.temperature
        tasks = []
        if dm.val_records:
            sampling = r.sampling(group_size=self.num_samples, temperature=temperature, seed=0)
            records = usable(dm.val_records, "data.val_data")
            tasks.append(_Task(self.prefix, str(h.val_data), records, sampling, self.pass_k, self.maj_k))
        for b in self.benchmarks:
            n = b.n or self.num_samples
            sampling = r.sampling(
                group_size=n,
                temperature=b.temperature if b.temperature is not None else temperature,
                top_p=b.top_p if b.top_p is not None else r.top_p,
                max_tokens=b.max_tokens or r.max_response_length,
                seed=0,
            )
            room = dm.max_model_len() - sampling.max_tokens  # the engine holds prompt + response
            if room < 1:
                raise ConfigError(
                    f"Evaluation.benchmarks[{b.name}]: max_tokens={sampling.max_tokens} leaves no room for a prompt in "
                    f"the engine's {dm.max_model_len()} tokens (data.max_prompt_length + rollout.max_response_length)"
                )
            fields = {k: v for k, v in asdict(b).items() if k in ("split", "problem_field", "answer_field", "id_field", "limit")}
            records = usable(dm.load_records(b.source, max_prompt_tokens=room, **fields), f"benchmark {b.name}")
            if not records:
                raise ConfigError(
                    f"Evaluation.benchmarks[{b.name}]: no problem of {b.source} fits {room} prompt tokens "
                    f"(engine length {dm.max_model_len()} − max_tokens {sampling.max_tokens}); raise data.max_prompt_length"
                )
            pass_k = list(b.pass_k) if b.pass_k is not None else [k for k in self.pass_k if k <= n] or [n]
            maj_k = list(b.maj_k) if b.maj_k is not None else [k for k in self.maj_k if k <= n]
            tasks.append(_Task(f"{self.prefix}/{b.name}", b.source, records, sampling, pass_k, maj_k))
        self._tasks = tasks
        return tasks

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if pl_module.rollout_batches == 0:  # "before training"; a resumed run was evaluated on its schedule
            self.evaluate(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        # Rollout batches, not Lightning's batch_idx: that restarts at 0 every epoch of the prompt set.
        if is_due(pl_module.rollout_batches, self.every_n_steps):
            self.evaluate(trainer, pl_module)

    def state_dict(self) -> dict:
        return {"last_step": self._last_step}

    def load_state_dict(self, state_dict: dict) -> None:
        self._last_step = state_dict.get("last_step", -1)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.evaluate(trainer, pl_module)

    def evaluate(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, float]:
        # x-axis: completed rollout batches, the axis of the train/ metrics whatever the number of
        # optimizer steps per batch (GSPO takes 4), so runs of different algorithms line up in MLflow.
        pl_module.latest_val = self.run(self.target(trainer, pl_module), pl_module.rollout_batches)
        return pl_module.latest_val

    @staticmethod
    def target(trainer: L.Trainer, pl_module: L.LightningModule) -> EvalTarget:
        """The training run's policy, data, verifier, logger and ranks as an evaluation target."""
        strategy, device = trainer.strategy, pl_module.device
        return EvalTarget(
            pl_module.generate,
            trainer.datamodule,
            pl_module.scoring,
            trainer.logger,
            trainer.global_rank,
            trainer.world_size,
            lambda sums: strategy.reduce(sums.to(device), reduce_op="sum").cpu(),
        )

    @torch.no_grad()
    def run(self, target: EvalTarget, step: int) -> dict[str, float]:
        """Score every evaluation set on `target` and log the metrics at `step` (once per step)."""
        if step == self._last_step:
            return self._latest
        tasks = self.tasks(target.data, target.scoring)
        if not tasks:
            return {}
        logger = target.logger
        if logger is not None and not self._params_logged:  # the settings next to the scores
            logger.log_hyperparams({k: v for t in tasks for k, v in t.params().items()})
            self._params_logged = True
        out: dict[str, float] = {}
        for task in tasks:
            t0 = time.perf_counter()
            parts, sharded = rank_batches(task.records, target.rank, target.world_size, self.batch_size)
            batches = [target.data.collate(part) for part in parts]
            score = partial(self._score, target, batches, sharded=sharded)
            metrics, samples = score(task.sampling, task.pass_k, task.maj_k, self.log_samples, self.max_sample_chars)
            if self.greedy:
                greedy, _ = score(replace(task.sampling, group_size=1, temperature=0.0), [], [])
                metrics["accuracy_greedy"] = greedy["accuracy"]
            metrics["seconds"] = time.perf_counter() - t0
            out |= {f"{task.prefix}/{k}": v for k, v in metrics.items()}
            if logger is not None:
                self._log_samples(logger, samples, step, task.prefix)
        self._latest, self._last_step = out, step
        if logger is not None:
            logger.log_metrics(out, step=step)
        return out

    def _log_samples(self, logger: Logger, samples: list[dict], step: int, prefix: str) -> None:
        experiment = getattr(logger, "experiment", None)
        if not samples or not hasattr(experiment, "log_table"):
            return
        experiment.log_table(
            logger.run_id,
            data=table_of([{"step": step, **row} for row in samples]),
            artifact_file=f"samples/{prefix.replace('/', '_')}_step_{step:06d}.json",
        )

    @staticmethod
    def _score(
        target: EvalTarget, batches, sampling, pass_k: list[int], maj_k: list[int], log_rows: int = 0,
        max_chars: int = 2000, sharded: bool = False,
    ) -> tuple[dict[str, float], list[dict]]:  # fmt: skip
        correct, lengths, no_answer, n_problems = [], [], 0.0, 0
        episode_sums: dict[str, float] = {}  # an environment's episode metrics, weighted by completions
        # Under several ranks each scores its share (`rank_batches`): the torchmetrics states below
        # synchronise in compute(), the plain sums through the strategy.
        pass_metrics = {k: PassAtK(k) for k in pass_k}
        maj_metrics = {k: MajAtK(k) for k in maj_k}
        samples: list[dict] = []  # the samples table's rows: the first answer to each of the first `log_rows` problems
        for batch in batches:
            rollout = target.generate(batch, sampling)
            c, _ = target.scoring.correctness(rollout)
            correct.append(c)
            per_problem = (c >= 1).view(len(batch), sampling.group_size)  # full credit; grouped per problem
            for metric in pass_metrics.values():
                metric.update(per_problem)
            answers = [extract_prediction(t) for t in rollout.answer_texts]
            for metric in maj_metrics.values():
                metric.update(
                    [answers[i * sampling.group_size : (i + 1) * sampling.group_size] for i in range(len(batch))],
                    per_problem,
                )
            if target.rank == 0 and len(samples) < log_rows:  # rank 0 alone logs them
                samples += held_out_rows(target, rollout, c, answers, log_rows - len(samples), max_chars)
            lengths.extend(rollout.response_lengths.tolist())
            no_answer += sum(a is None for a in answers)  # whatever gives correctness
            n_problems += len(batch)
            for key, value in rollout.metrics.items():  # generation's: an environment's episode metrics, if any
                episode_sums[key] = episode_sums.get(key, 0.0) + value * len(c)
        c = torch.cat(correct)
        keys = sorted(episode_sums)  # every rank runs the same environment over as many batches: the same keys
        sums = torch.tensor([c.sum().item(), len(c), sum(lengths), no_answer, n_problems, *(episode_sums[k] for k in keys)],
                            dtype=torch.float64)  # fmt: skip
        if sharded:
            sums = target.sum_over_ranks(sums)
        correct_sum, count, length_sum, no_answer, n_problems, *episode_totals = sums.tolist()
        out = {k: total / count for k, total in zip(keys, episode_totals)}
        for k, metric in pass_metrics.items():
            out[f"pass_at_{k}"] = metric.compute().item()
            out[f"pass_at_{k}_se"] = metric.standard_error().item()
        for k, metric in maj_metrics.items():
            out[f"maj_at_{k}"] = metric.compute().item()
            out[f"maj_at_{k}_se"] = metric.standard_error().item()
        return out | {
            "accuracy": correct_sum / count,
            "response_length_mean": length_sum / count,
            "no_answer_frac": no_answer / count,
            "num_problems": n_problems,
        }, samples



def held_out_rows(
    target: EvalTarget, rollout: Rollout, correct: torch.Tensor, answers: list[str | None], limit: int, max_chars: int
) -> list[dict]:
    """The first answer to each of the first `limit` problems of a held-out rollout as samples-table rows, scored as
    training scores an answer: its correctness `correct` (already computed), each reward term (the run's reward
    functions, run on these answers only), and the reward they make, w_c·c + Σ terms."""
    picked = [i * rollout.group_size for i in range(min(limit, len(rollout.batch)))]
    first = replace(
        rollout, group_size=1, completions=[rollout.completions[n] for n in picked], texts=[rollout.texts[n] for n in picked],
        own_texts=[rollout.own_texts[n] for n in picked] if rollout.own_texts else (),
        reward_terms={name: values[picked] for name, values in rollout.reward_terms.items()},
    )  # fmt: skip
    scored = target.scoring.with_terms(first, correct[picked])
    rewards = scored.reward_with_terms(scored.correct)
    decode = target.data.tokenizer.decode
    return [{**answer_columns(scored, k, decode, max_chars), "parsed_answer": answers[n], "reward": float(rewards[k])}
            for k, n in enumerate(picked)]  # fmt: skip


def rank_batches(records: list, rank: int, world: int, batch_size: int) -> tuple[list[list], bool]:
    """This rank's evaluation batches, and whether they are its share only. Every rank scores a disjoint
    share of `records` (interleaved), in the same number of batches (an FSDP-sharded HF engine makes
    each generate call a collective). When the set is too small for every rank to fill that many
    batches, every rank scores all of it (duplicated work, the same metrics)."""
    if world > 1:
        share = records[rank::world]
        n_batches = -(-len(records[0::world]) // batch_size)  # rank 0 holds the largest share
        if len(records) // world >= n_batches:  # the smallest share still fills every batch
            bounds = torch.linspace(0, len(share), n_batches + 1).round().long().tolist()
            return [share[a:b] for a, b in zip(bounds, bounds[1:])], True
    return [records[i : i + batch_size] for i in range(0, len(records), batch_size)], False


def _check_ks(where: str, n: int, pass_k: list[int], maj_k: list[int]) -> None:
    for name, ks in (("pass_k", pass_k), ("maj_k", maj_k)):
        if any(k < 1 or k > n for k in ks):
            raise ConfigError(f"{where}.{name}={ks}: each k must lie in [1, n={n}] (the samples per problem)")
