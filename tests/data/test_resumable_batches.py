"""ResumableBatches: the prompt stream is a pure function of (seed, step, rank, world size), so a
resumed run continues with exactly the batches it had not trained on, and ranks never share a prompt."""

from __future__ import annotations

from itertools import islice

import pytest

from rlvr_lightning.data.batches import ResumableBatches

ITEMS = list(range(23))  # 23 = 2 batches of 4 × 2 ranks per epoch, 7 left over (dropped)


def stream(start=0, rank=0, world=2, batches=7):
    ds = ResumableBatches(ITEMS, batch_size=4, seed=3, collate=list, start_batch=start, rank=rank, world_size=world)
    out = []
    while len(out) < batches:  # Lightning calls iter() once per epoch
        out += list(islice(iter(ds), batches - len(out)))
    return out


def test_resume_continues_with_exactly_the_untrained_batches():
    full = stream()
    for k in range(1, 6):
        assert stream(start=k, batches=7 - k) == full[k:], k  # mid-epoch and on an epoch boundary


def test_ranks_split_each_global_batch_and_epochs_reshuffle():
    r0, r1 = stream(rank=0), stream(rank=1)
    for a, b in zip(r0, r1):
        assert len(a) == len(b) == 4 and not set(a) & set(b)
    epoch0 = [x for batch in r0[:2] + r1[:2] for x in batch]
    assert len(set(epoch0)) == 16  # no prompt twice within an epoch
    assert r0[:2] != r0[2:4]  # a new order every epoch
    assert stream(rank=0) == r0  # deterministic


def test_too_few_items_for_the_ranks_is_refused():
    with pytest.raises(ValueError, match="cannot fill one batch of 4 × 8 ranks"):
        ResumableBatches(ITEMS, batch_size=4, seed=0, collate=list, world_size=8)


def test_batch_at_is_what_the_stream_yields_there_without_moving_it():
    for rank in (0, 1):
        full = stream(rank=rank)
        ds = ResumableBatches(ITEMS, batch_size=4, seed=3, collate=list, rank=rank, world_size=2)
        assert [ds.batch_at(k) for k in range(7)] == full  # across epoch boundaries (2 batches per epoch)
        assert ds.next_batch == 0 and list(islice(iter(ds), 1)) == full[:1]  # the stream did not move
