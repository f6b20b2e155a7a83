"""RolloutDataModule: prompt batches for RL, the held-out problems and the tokenizer.

The dataloader yields *prompts* only. Completions are generated inside the training step
(`rlvr_lightning.training.generation`): Lightning fetches the next batch before the current step runs, so generating in a
dataset iterator would sample from stale weights.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import asdict
from functools import partial

import lightning as L
from torch.utils.data import DataLoader

from rlvr_lightning.data.batches import ResumableBatches
from rlvr_lightning.data.prompt_format import PromptFormat
from rlvr_lightning.data.sources import ProblemRecord, embedded_records, load_problems
from rlvr_lightning.data.training_prompts import TrainingPrompts
from rlvr_lightning.environments.base import Environment
from rlvr_lightning.environments.python_tool import PythonToolSettings, environment_of
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.models.policy import load_tokenizer
from rlvr_lightning.models.tasks import EMBEDDED_TASKS
from rlvr_lightning.models.warm_start import EMBEDDED, resolve_policy_path
from rlvr_lightning.rollout.settings import RolloutSettings
from rlvr_lightning.rollout.types import PromptBatch

log = logging.getLogger(__name__)


ENVIRONMENT_OPTIONS = ("data.tool", "data.environment")


def context_length_problem(config, max_prompt_length: int, max_response_length: int, model: str) -> str | None:
    """Why prompt + response do not fit the model's positions (None when they do)."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit is None or max_prompt_length + max_response_length <= limit:
        return None
    return (
        f"data.max_prompt_length={max_prompt_length} + rollout.max_response_length={max_response_length} exceeds "
        f"the {limit} positions of {model}; lower one of them"
    )


class RolloutDataModule(L.LightningDataModule):
    def __init__(
        self,
        model_name_or_path: str = EMBEDDED,
        train_data: str = EMBEDDED,
        val_data: str | None = EMBEDDED,
        train_split: str = "train",
        val_split: str = "test",
        problem_field: str | None = None,
        answer_field: str | None = None,
        id_field: str | None = None,
        prompt_template: str = "{problem}",
        use_chat_template: bool = False,
        batch_size: int = 16,
        max_prompt_length: int = 64,
        val_size: int | None = 200,
        seed: int = 0,
        rollout: RolloutSettings = None,  # not `| None`: jsonargparse links only into a plain class type
        tool: PythonToolSettings | None = None,
        environment: Environment | None = None,
    ) -> None:
        """
        Args:
            model_name_or_path: `embedded` (the built-in tiny model, warm-started on first use;
                `embedded-balanced`: its warm start with about half the samples correct; `embedded-tir`: warm-started
                on `embedded-multiply`, calling the Python tool some of the time), an HF model id, or a local HF
                model directory. The trainer and the engine both load it.
            train_data: `embedded` (the built-in arithmetic task), `embedded-multiply` (three-digit products: the
                Python tool's task), a .jsonl/.json/.parquet file, or an HF dataset name.
            val_data: held-out problems for `val/accuracy` (same forms), or null for none.
            problem_field / answer_field / id_field: column names; auto-detected when null.
            prompt_template: Python format string applied to each problem (`{problem}`).
            use_chat_template: wrap the templated prompt in the tokenizer's chat template.
            batch_size: prompts per rollout batch (B); each gets `rollout.group_size` completions.
            max_prompt_length: prompts longer than this (in tokens) are dropped, with a count.
            val_size: held-out problems used (the first ones; null: all).
            seed: the prompt order's seed, and the seed every sampling seed of the run derives from.
            rollout: the `rollout:` section (sampling and engine settings); LightningCLI passes it in.
            tool: a Python tool the answers may call (`--data.tool.max_calls 4`; docs/tools.md); null: none.
            environment: an environment of one's own that answers the model between the segments of an
                answer, by dotted path (`--data.environment my_envs.SecondChance`; docs/environments.md).
        """
        super().__init__()
        self.save_hyperparameters(ignore=["rollout", "tool", "environment"])
        # plain values: a checkpoint loads weights-only
        self.hparams["tool"] = None if tool is None else asdict(tool)
        self.hparams["environment"] = None if environment is None else f"{type(environment).__module__}.{type(environment).__qualname__}"
        environment_of(tool, environment, ENVIRONMENT_OPTIONS)  # a bad tool setting or both: one line, here
        self.tool = tool
        self.environment = environment
        self.rollout = rollout if rollout is not None else RolloutSettings()
        self.tokenizer = None
        self.format: PromptFormat | None = None  # made at setup, with the tokenizer
        self.policy_path: str | None = None
        self.train_records: list[ProblemRecord] = []
        self.val_records: list[ProblemRecord] = []
        self._prompts: TrainingPrompts | None = None  # `prompts`, made on first use
        self._ranks = (0, 1)  # this rank and the world size, known at setup
        self.train_batches: ResumableBatches | None = None  # the stream behind train_dataloader
        self._prompts_state: dict = {}  # a checkpoint's position in the extra prompts, if restored before setup

    def make_environment(self) -> Environment | None:
        """The environment the answers are generated in: the Python tool (`tool`), one's own, or None (one
        segment per answer)."""
        return self.environment_factory()()

    def environment_factory(self) -> Callable[[], Environment | None]:
        """What makes that environment, as a function of the settings alone (it keeps no reference to this module)."""
        return partial(environment_of, self.tool, self.environment, ENVIRONMENT_OPTIONS)

    # ---- setup -------------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        if self.tokenizer is not None:
            return
        self.policy_path = resolve_policy_path(self.hparams.model_name_or_path)
        self.tokenizer = load_tokenizer(self.policy_path)
        self.format = PromptFormat(self.hparams.prompt_template, self.hparams.use_chat_template, self.tokenizer)
        self._check_context_length()
        self.train_records = self._load(self.hparams.train_data, self.hparams.train_split, train=True)
        self.val_records = (
            self._load(self.hparams.val_data, self.hparams.val_split, train=False)[: self.hparams.val_size]
            if self.hparams.val_data
            else []
        )
        if len(self.train_records) < self.hparams.batch_size:
            raise ConfigError(
                f"data.train_data has {len(self.train_records)} usable problems, fewer than data.batch_size="
                f"{self.hparams.batch_size}"
            )
        self._ranks = (self.trainer.global_rank, self.trainer.world_size) if self.trainer is not None else (0, 1)

    @property
    def prompts(self) -> TrainingPrompts:
        """What the step draws its training prompts from, over the training problems as they are now: a setup hook
        may drop some after this module's setup (the verifier drops those whose gold it cannot parse)."""
        if self._prompts is None or self._prompts.records is not self.train_records:
            try:
                made = TrainingPrompts(self.train_records, self.hparams.batch_size, self.hparams.seed, self.format.batch, *self._ranks)
            except ValueError as err:
                raise ConfigError(f"data.train_data / data.batch_size: {err}") from None
            made.load_state_dict(self._prompts.state_dict() if self._prompts is not None else self._prompts_state)
            self._prompts = made
        return self._prompts

    def _check_context_length(self) -> None:
        """Prompt + response must fit the model's positions; vLLM would refuse deep inside otherwise."""
        from transformers import AutoConfig

        problem = context_length_problem(
            AutoConfig.from_pretrained(self.policy_path),
            self.hparams.max_prompt_length,
            self.rollout.max_response_length,
            self.hparams.model_name_or_path,
        )
        if problem:
            raise ConfigError(problem)

    def _load(self, source: str, split: str, train: bool) -> list[ProblemRecord]:
        h = self.hparams
        return self.load_records(
            source,
            split,
            problem_field=h.problem_field,
            answer_field=h.answer_field,
            id_field=h.id_field,
            max_prompt_tokens=h.max_prompt_length,
            embedded_part="train" if train else "test",
        )

    def load_records(
        self,
        source: str,
        split: str = "test",
        max_prompt_tokens: int | None = None,
        embedded_part: str | None = None,
        limit: int | None = None,
        **fields: str | None,
    ) -> list[ProblemRecord]:
        """Problems from an embedded task (`EMBEDDED_TASKS`; its train or test part: `embedded_part`, else
        `split`), a file or an HF dataset (`fields`: `problem_field`, `answer_field`, `id_field` of
        `load_problems`), without those whose templated prompt is longer than `max_prompt_tokens` (counted): the
        first `limit` of those that fit, reading the source only as far as they take."""

        def read(n: int | None) -> list[ProblemRecord]:
            if source in EMBEDDED_TASKS:
                return embedded_records(embedded_part or split, task=source)[:n]
            return load_problems(source, split=split, limit=n, **fields)

        if max_prompt_tokens is None:
            return read(limit)
        wanted = limit
        while True:
            records = read(limit)
            fits = [len(self.prompt_ids(r.problem)) <= max_prompt_tokens for r in records]
            if wanted is None or sum(fits) >= wanted or len(records) < limit:
                break
            limit = max(1, 2 * limit)  # too many of those read were too long: read twice as far
        kept, seen = [], 0
        for record, fit in zip(records, fits):
            if wanted is not None and len(kept) == wanted:
                break
            seen += 1
            kept += [record] if fit else []
        if len(kept) < seen:
            log.warning("%s: dropped %d of %d problems whose prompt is longer than %d tokens", source,
                        seen - len(kept), seen, max_prompt_tokens)  # fmt: skip
        return kept

    def format_prompt(self, problem: str) -> str:
        return self.format.text(problem)

    def prompt_ids(self, problem: str) -> list[int]:
        return self.format.token_ids(problem)

    # ---- dataloaders -------------------------------------------------------------------------
    def collate(self, records: list[ProblemRecord]) -> PromptBatch:
        return self.format.batch(records)

    def train_dataloader(self) -> DataLoader:
        """Seeded, shuffled prompt batches, one per rollout batch; a resumed run continues where the
        checkpoint was taken (`ResumableBatches`), and each rank gets its own slice of every batch."""
        module = self.trainer.lightning_module if self.trainer is not None else None
        self.train_batches = self.prompts.stream(getattr(module, "rollout_batches", 0))
        # Lightning warns that __len__ may be wrong with several loader workers; there are none here.
        warnings.filterwarnings("ignore", message=r".*`IterableDataset` has `__len__` defined")
        return DataLoader(self.train_batches, batch_size=None)  # the dataset yields whole batches

    def state_dict(self) -> dict:
        return self._prompts.state_dict() if self._prompts is not None else dict(self._prompts_state)

    def load_state_dict(self, state: dict) -> None:
        self._prompts_state = dict(state)
        if self._prompts is not None:
            self._prompts.load_state_dict(state)

    def max_model_len(self) -> int:
        """Prompt + response tokens the engine is built for."""
        return self.hparams.max_prompt_length + self.rollout.max_response_length
