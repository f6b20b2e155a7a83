"""Held-out evaluation with the rollout engine: before training, every N steps, and at the end.

`val/accuracy` is the accuracy of *sampled* completions at the training temperature (mean over
`num_samples` per problem): on small policies greedy accuracy is flat or noisy while the sampled
policy improves (DESIGN.md, "Embedded default"), so greedy accuracy is logged beside it.
`val/pass_at_<k>` is the unbiased pass@k over the `num_samples` completions per problem
(`rlvr_lightning.metrics`), with its standard error `val/pass_at_<k>_se`, for each k in `pass_k`
(MLflow metric names cannot contain "@"), and `val/maj_at_<k>` (majority vote over the extracted
answers of the first k samples) for each k in `maj_k`. Every evaluation also logs a bounded table of
sample completions (prompt, completion, parsed answer, gold, reward) as the MLflow artifact
`samples/<prefix>_step_<N>.json`.
Not a Lightning validation loop: evaluation needs the engine and the verifier, not `validation_step`.
"""

from __future__ import annotations

import time

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from rlvr_lightning.callbacks.reward import RewardVerifier
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.metrics import MajAtK, PassAtK
from rlvr_lightning.rewards.math import extract_prediction


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
            prefix: metric namespace (`val` in training; `eval/<benchmark>` offline).
        """
        self.pass_k = list(pass_k) if pass_k is not None else [num_samples]
        self.maj_k = list(maj_k) if maj_k is not None else []
        for name, ks in (("pass_k", self.pass_k), ("maj_k", self.maj_k)):
            if any(k < 1 or k > num_samples for k in ks):
                raise ConfigError(f"Evaluation.{name}={ks}: each k must lie in [1, num_samples={num_samples}]")
        self.log_samples, self.max_sample_chars, self.prefix = log_samples, max_sample_chars, prefix
        self.every_n_steps = every_n_steps
        self.num_samples = num_samples
        self.temperature = temperature
        self.greedy = greedy
        self.batch_size = batch_size
        self._last_step = -1

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.evaluate(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self.every_n_steps and (batch_idx + 1) % self.every_n_steps == 0:
            self.evaluate(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.evaluate(trainer, pl_module)

    @torch.no_grad()
    def evaluate(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, float]:
        # x-axis: completed rollout batches, the axis of the train/ metrics whatever the number of
        # optimizer steps per batch (GSPO takes 4), so runs of different algorithms line up in MLflow.
        step = pl_module.rollout_batches
        if step == self._last_step:
            return pl_module.latest_val
        dm = trainer.datamodule
        batches = dm.val_batches(self.batch_size)
        if not batches:
            return {}
        verifier = next(c for c in trainer.callbacks if isinstance(c, RewardVerifier))
        t0 = time.perf_counter()
        temperature = self.temperature if self.temperature is not None else dm.hparams.temperature
        sampled = dm.sampling(n=self.num_samples, temperature=temperature, seed=0)
        metrics, samples = self._score(pl_module, verifier, batches, sampled, self.pass_k, self.maj_k)
        if self.greedy:
            greedy, _ = self._score(pl_module, verifier, batches, dm.sampling(n=1, temperature=0.0, seed=0), [], [])
            metrics["accuracy_greedy"] = greedy["accuracy"]
        metrics["seconds"] = time.perf_counter() - t0
        out = {f"{self.prefix}/{k}": v for k, v in metrics.items()}
        pl_module.latest_val = out
        self._last_step = step
        if trainer.logger is not None:
            trainer.logger.log_metrics(out, step=step)
            self._log_samples(trainer, samples, step)
        return out

    def _log_samples(self, trainer: L.Trainer, samples: dict[str, list], step: int) -> None:
        experiment = getattr(trainer.logger, "experiment", None)
        if not self.log_samples or not samples["prompt"] or not hasattr(experiment, "log_table"):
            return
        table = {k: v[: self.log_samples] for k, v in samples.items()}
        for key in ("prompt", "completion"):
            table[key] = [t if len(t) <= self.max_sample_chars else t[: self.max_sample_chars] + " …" for t in table[key]]
        experiment.log_table(trainer.logger.run_id, data=table | {"step": [step] * len(table["prompt"])},
                             artifact_file=f"samples/{self.prefix.replace('/', '_')}_step_{step:06d}.json")  # fmt: skip

    @staticmethod
    def _score(
        pl_module, verifier: RewardVerifier, batches, sampling, pass_k: list[int], maj_k: list[int]
    ) -> tuple[dict[str, float], dict[str, list]]:
        correct, lengths, no_answer, n_problems = [], [], 0.0, 0
        pass_metrics = {k: PassAtK(k) for k in pass_k}
        maj_metrics = {k: MajAtK(k) for k in maj_k}
        samples: dict[str, list] = {"prompt": [], "completion": [], "parsed_answer": [], "gold": [], "reward": []}
        for batch in batches:
            rollout = pl_module.generate(batch, sampling)
            c, m = verifier.score(rollout.answers_per_sequence, rollout.texts, rollout.truncated)
            correct.append(c)
            per_problem = c.view(len(batch), sampling.n)  # completions are grouped per problem
            for metric in pass_metrics.values():
                metric.update(per_problem)
            answers = [extract_prediction(t) for t in rollout.texts]
            for metric in maj_metrics.values():
                metric.update([answers[i * sampling.n : (i + 1) * sampling.n] for i in range(len(batch))], per_problem)
            for i in range(len(batch)):  # the first sample of each problem
                n = i * sampling.n
                row = (batch.prompts[i], rollout.texts[n], answers[n], batch.answers[i], float(c[n]))
                for key, value in zip(samples, row):
                    samples[key].append(value)
            lengths.extend(rollout.response_lengths.tolist())
            no_answer += m["no_answer_frac"] * len(c)
            n_problems += len(batch)
        c = torch.cat(correct)
        out = {}
        for k, metric in pass_metrics.items():
            out[f"pass_at_{k}"] = metric.compute().item()
            out[f"pass_at_{k}_se"] = metric.standard_error().item()
        for k, metric in maj_metrics.items():
            out[f"maj_at_{k}"] = metric.compute().item()
            out[f"maj_at_{k}_se"] = metric.standard_error().item()
        return out | {
            "accuracy": c.mean().item(),
            f"mean_at_{sampling.n}": c.mean().item(),  # the papers' name for the same average
            "response_length_mean": sum(lengths) / len(lengths),
            "no_answer_frac": no_answer / len(c),
            "num_problems": float(n_problems),
        }, samples
