"""How the sequences of one forward/backward pass are split into micro-batches.

Two rules, the second opt-in (`model.max_tokens_per_micro_batch`):
  - by rows: `micro_batch_size` consecutive sequences at a time (groups stay contiguous);
  - by token budget: sequences sorted by length and packed so that each micro-batch's padded size,
    rows × its own longest row (prompt + response), stays within the budget. Sorting puts rows of
    similar length together, so trimming each micro-batch to its longest row (`RolloutTensors.trimmed`)
    leaves little padding even when response lengths spread from hundreds to thousands of tokens.
Where a consumer needs whole groups (THR scores a group from all its responses; REAL's one-pass loss
couples them), the unit packed is a group instead of a sequence. A unit longer than the budget gets a
micro-batch of its own.

Every rank must run the same number of forwards (FSDP gathers each layer's weights in every forward),
so under token budgets the count is agreed across ranks (the maximum) and ranks below it split their
largest micro-batches. The update's gradient does not depend on the layout: losses are normalised by
the optimizer step's global counts (`training.batch.StepNorms`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def keeps_groups_whole(micro_batch_size: int, max_tokens: int | None, group_size: int) -> bool:
    """Whether micro-batches can hold whole groups when asked: token budgets pack groups as units; rows
    of `micro_batch_size` only when it is a multiple of the group size."""
    return max_tokens is not None or micro_batch_size % group_size == 0


def split_rows(
    rows: torch.Tensor,
    lengths: torch.Tensor,
    micro_batch_size: int,
    max_tokens: int | None,
    unit: int = 1,
    agree_count: Callable[[int], int] | None = None,
) -> list[torch.Tensor]:
    """Micro-batches (index tensors into the batch) covering `rows` exactly once.

    lengths: [N] real tokens (prompt + response) of every sequence of the batch (host tensor).
    unit: rows that must share a micro-batch (1, or the group size G; `rows` are group-contiguous).
    agree_count: maps this rank's number of micro-batches to the number every rank must use.
    """
    if max_tokens is None:
        return list(rows.split(micro_batch_size))
    if len(rows) % unit:
        raise ValueError(f"{len(rows)} rows do not split into units of {unit}")
    units = rows.view(-1, unit)
    unit_len = lengths[units.cpu()].max(1).values
    order = torch.argsort(unit_len, descending=True, stable=True).tolist()
    bins: list[list[int]] = []  # unit indices, longest first in each bin
    for u in order:
        if bins and (len(bins[-1]) + 1) * unit * int(unit_len[bins[-1][0]]) <= max_tokens:
            bins[-1].append(u)
        else:
            bins.append([u])
    if len(order) <= _MAX_UNITS_FOR_BALANCING:
        bins = _least_padding(order, unit_len, unit, max_tokens, len(bins))
    if agree_count is not None:
        bins = _split_to_count(bins, agree_count(len(bins)), unit_len, unit)
    return [units[b].flatten() for b in bins]


# Above this many units per step the greedy bins already waste little (many rows of similar length
# share each bin), and the O(units² · bins) search below would cost more than it saves.
_MAX_UNITS_FOR_BALANCING = 512


def _least_padding(order: list[int], unit_len: torch.Tensor, unit: int, max_tokens: int, count: int) -> list[list[int]]:
    """The `count` contiguous bins of the length-sorted units with the fewest padded slots in total that
    fit the budget (greedy packing fixes the fewest bins; it can leave a long tail of short rows in the
    last bin). Dynamic programme over split points: best[b][j] = the cheapest cover of the first j units by b bins."""
    n = len(order)
    sorted_len = unit_len[order].double()
    i, j = torch.arange(n)[:, None], torch.arange(n + 1)[None, :]
    slots = (j - i) * unit * sorted_len[:, None]  # the bin of units i..j−1; its longest is unit i
    cost = torch.where((j > i) & ((slots <= max_tokens) | (j - i == 1)), slots, torch.inf)  # [n, n+1]
    best = torch.full((n + 1,), torch.inf, dtype=torch.float64)
    best[0] = 0.0
    starts = []
    for _ in range(count):
        total = best[:n, None] + cost  # [start i, end j]
        best = torch.cat([torch.tensor([torch.inf], dtype=torch.float64), total.min(0).values[1:]])
        starts.append(total.argmin(0))
    if not torch.isfinite(best[n]):  # cannot happen: greedy found `count` bins; keep its answer's shape
        raise RuntimeError("no packing into the greedy number of micro-batches")
    bounds, end = [], n
    for start_of in reversed(starts):
        start = int(start_of[end])
        bounds.append((start, end))
        end = start
    return [[order[k] for k in range(a, b)] for a, b in reversed(bounds)]


def _split_to_count(bins: list[list[int]], count: int, unit_len: torch.Tensor, unit: int) -> list[list[int]]:
    """Split the costliest multi-unit bins in two until there are `count` bins."""
    if count > sum(len(b) for b in bins):
        raise RuntimeError(
            f"another rank needs {count} micro-batches, but this rank has only {sum(len(b) for b in bins)} "
            "sequences (or groups) in this step: ranks must hold the same number of prompts"
        )
    while len(bins) < count:
        i = max((k for k in range(len(bins)) if len(bins[k]) > 1), key=lambda k: len(bins[k]) * int(unit_len[bins[k][0]]))
        half = len(bins[i]) // 2
        bins[i : i + 1] = [bins[i][:half], bins[i][half:]]
    return bins

