"""The training prompt stream: seeded epochs of shuffled batches that a resumed run re-enters exactly.

Why not a DataLoader over a map-style dataset with a shuffling sampler: a resumed run must see the
batches the interrupted run had not trained on yet, no replay, no skip. Lightning prefetches one batch
ahead, so a sampler's own position is one batch past what was trained when the checkpoint is written,
and under DDP/FSDP it wraps custom samplers in a distributed wrapper whose position it does not save.
Here the position is the number of completed rollout batches (restored with the module), the order of
epoch e is a permutation seeded by (seed, e) alone, and every rank takes its own slice of each global
batch, so the stream is a pure function of (seed, step, rank, world size).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset


class ResumableBatches(IterableDataset):
    def __init__(
        self,
        items: list[Any],
        batch_size: int,
        seed: int,
        collate: Callable[[list[Any]], Any],
        start_batch: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        """
        Args:
            items: the training problems.
            batch_size: prompts per rank per batch.
            seed: the order of epoch e is `randperm(len(items), seed + e)`, the same on every rank.
            collate: builds one batch from its items.
            start_batch: batches already trained on (a resumed run's `rollout_batches`).
            rank / world_size: this rank takes items [rank·B, (rank+1)·B) of each global batch of B·world_size.
        """
        self.global_batch = batch_size * world_size
        if len(items) < self.global_batch:
            raise ValueError(f"{len(items)} items cannot fill one batch of {batch_size} × {world_size} ranks")
        self.items, self.batch_size, self.seed, self.collate = items, batch_size, seed, collate
        self.rank, self.next_batch = rank, start_batch
        self.batches_per_epoch = len(items) // self.global_batch  # the incomplete last batch is dropped

    def __len__(self) -> int:
        return self.batches_per_epoch

    def epoch_order(self, epoch: int) -> torch.Tensor:
        return torch.randperm(len(self.items), generator=torch.Generator().manual_seed(self.seed + epoch))

    def __iter__(self) -> Iterator[Any]:
        # One call = the rest of the current epoch (Lightning calls iter() once per epoch).
        epoch, offset = divmod(self.next_batch, self.batches_per_epoch)
        order = self.epoch_order(epoch)
        for b in range(offset, self.batches_per_epoch):
            self.next_batch = epoch * self.batches_per_epoch + b + 1
            yield self._batch(order, b)

    def batch_at(self, index: int) -> Any:
        """This rank's batch number `index` of the stream (counted over epochs), without moving the
        stream: what the iterator yields there. Asynchronous rollouts generate it one step early."""
        epoch, b = divmod(index, self.batches_per_epoch)
        return self._batch(self.epoch_order(epoch), b)

    def _batch(self, order: torch.Tensor, b: int) -> Any:
        lo = b * self.global_batch + self.rank * self.batch_size
        return self.collate([self.items[i] for i in order[lo : lo + self.batch_size].tolist()])
