"""The training prompts a step draws on, as a plain object: this rank's batch of any rollout batch (the dataloader's
stream, `data.batches`), and more prompts beyond it (DAPO's dynamic sampling). The rollout DataModule makes it at
setup and the step reads it; it knows nothing of Lightning."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlvr_lightning.data.batches import ResumableBatches
from rlvr_lightning.data.sources import ProblemRecord
from rlvr_lightning.rollout.types import PromptBatch


class TrainingPrompts:
    def __init__(
        self,
        records: list[ProblemRecord],
        batch_size: int,
        seed: int,
        collate: Callable[[list[ProblemRecord]], PromptBatch],
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        """`batch_size`: prompts per rank per rollout batch; `collate`: a batch of prompts from its problems; this
        rank takes its own slice of every global batch (`ResumableBatches`)."""
        self.records, self.batch_size, self.seed, self.collate = records, batch_size, seed, collate
        self.rank, self.world_size = rank, world_size
        self.batches = self.stream(0)  # where any rollout batch's prompts are looked up
        self.extra_epoch, self.extra_pos = 0, 0  # the position in the stream of extra prompts: checkpointed

    def stream(self, start: int) -> ResumableBatches:
        """The dataloader's stream from rollout batch `start` on (a resumed run's completed batches)."""
        return ResumableBatches(self.records, self.batch_size, self.seed, self.collate, start, self.rank, self.world_size)

    def batch_at(self, index: int) -> PromptBatch:
        """This rank's prompts of rollout batch `index`: what the dataloader yields there (asynchronous rollouts
        generate it early)."""
        return self.batches.batch_at(index)

    def extra(self, n: int) -> PromptBatch:
        """`n` more training prompts, for algorithms that sample beyond the dataloader's batch.

        A separate, seeded, reshuffled-every-pass stream over the training problems, so the dataloader's own
        order (and its resume position) is untouched. Every rank advances the same stream by n × world size and
        takes its own n of them, so ranks never draw the same prompts.
        """
        picked = self._next_extra(n * self.world_size)
        return self.collate(picked[self.rank * n : (self.rank + 1) * n])

    def _next_extra(self, n: int) -> list[ProblemRecord]:
        picked: list[ProblemRecord] = []
        while len(picked) < n:
            order = torch.randperm(
                len(self.records), generator=torch.Generator().manual_seed(self.seed + 7919 * (self.extra_epoch + 1))
            )
            take = order[self.extra_pos : self.extra_pos + n - len(picked)].tolist()
            picked += [self.records[i] for i in take]
            self.extra_pos += len(take)
            if self.extra_pos >= len(order):
                self.extra_epoch, self.extra_pos = self.extra_epoch + 1, 0
        return picked

    def state_dict(self) -> dict[str, Any]:
        return {"extra_epoch": self.extra_epoch, "extra_pos": self.extra_pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.extra_epoch, self.extra_pos = state.get("extra_epoch", 0), state.get("extra_pos", 0)
