"""How the sequences of one forward/backward pass are split into micro-batches.

Two rules, the second opt-in (`model.compute.max_tokens_per_micro_batch`):
  - by rows: `micro_batch_size` consecutive sequences at a time (groups stay contiguous);
  - by token budget: sequences sorted by length and packed so that each micro-batch's forward,
    rows × (its longest prompt + its longest response), stays within the budget. That is the size of
    the tensors the forward really runs: every micro-batch is trimmed to its own rows
    (`RolloutTensors.trimmed`), prompts left-padded to the longest prompt and responses right-padded to
    the longest response (at least one column), so a row with a long prompt and a short response
    packed with one with a short prompt and a long response costs more than either's own length.
    Sorting puts rows of similar length together, so little padding is left even when response
    lengths spread from hundreds to thousands of tokens.
Token budgets count real tokens when micro-batches are packed (`model.compute.packing`: each micro-batch's
sequences concatenated without padding, `models.packing`): a micro-batch's forward then costs
Σ (prompt + response) of its rows, wherever their tokens lie. Every cover costs the same slots then,
and rows of different lengths may share a micro-batch at no cost, so units are packed first-fit,
longest first (`_first_fit`), not in contiguous runs of the sorted order.
Where a consumer needs whole groups (THR scores a group from all its responses; REAL's one-pass loss
couples them), the unit packed is a group instead of a sequence. A unit whose own forward exceeds the
budget gets a micro-batch of its own (the only forwards above it).

Every rank must run the same number of forwards (FSDP gathers each layer's weights in every forward),
so under token budgets the count is agreed across ranks (the maximum) and ranks below it split their
largest micro-batches. The update's gradient does not depend on the layout: losses are normalised by
the optimizer step's global counts (`training.batch.OptimizerStepNorms`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def keeps_groups_whole(micro_batch_size: int, max_tokens: int | None, group_size: int) -> bool:
    """Whether micro-batches can hold whole groups when asked: token budgets pack groups as units; rows
    of `micro_batch_size` only when it is a multiple of the group size."""
    return max_tokens is not None or micro_batch_size % group_size == 0


def forward_tokens(token_counts: torch.Tensor, packed: bool = False) -> int:
    """Token slots of the forward over sequences with these [n, 2] (prompt, response) real tokens, laid
    out as `RolloutTensors.trimmed` does: n × (longest prompt + longest response, at least one column);
    packed, their real tokens."""
    if packed:
        return int(token_counts.sum())
    prompt, response = token_counts.amax(0).tolist()
    return len(token_counts) * (prompt + max(1, response))


def split_rows(
    rows: torch.Tensor,
    token_counts: torch.Tensor,
    micro_batch_size: int,
    max_tokens: int | None,
    unit: int = 1,
    agree_count: Callable[[int], int] | None = None,
    packed: bool = False,
) -> list[torch.Tensor]:
    """Micro-batches (index tensors into the batch) covering `rows` exactly once.

    token_counts: [N, 2] real prompt and response tokens of every sequence of the batch (host tensor,
        `RolloutTensors.token_counts`): a micro-batch's forward spans its longest prompt plus its
        longest response, so the budget needs both, not their sum per row.
    unit: rows that must share a micro-batch (1, or the group size G; `rows` are group-contiguous).
    agree_count: maps this rank's number of micro-batches to the number every rank must use.
    packed: the micro-batches run packed, so a budget counts their real tokens.
    """
    if max_tokens is None:
        return list(rows.split(micro_batch_size))
    if token_counts.dim() != 2 or token_counts.shape[1] != 2:
        raise ValueError(f"token_counts must be [N, 2] (prompt, response) tokens, got {tuple(token_counts.shape)}")
    if len(rows) % unit:
        raise ValueError(f"{len(rows)} rows do not split into units of {unit}")
    units = rows.view(-1, unit)
    # Each unit's longest prompt and longest response: what it adds to a micro-batch's width; packed,
    # its real prompt and response tokens: what it adds to the micro-batch's row.
    counts = token_counts[units.cpu()]  # [U, unit, 2]
    extent = counts.sum(1) if packed else counts.amax(1)  # [U, 2]
    if packed:  # by total tokens, longest first
        bins = _first_fit(_orders(extent)[0], extent.sum(1).tolist(), max_tokens)
    else:
        packings = [_pack(order, extent, unit, max_tokens) for order in _orders(extent)]
        bins = min(packings, key=lambda bins: (len(bins), sum(_slots(extent[b], unit) for b in bins)))
    if agree_count is not None:
        bins = _split_to_count(bins, agree_count(len(bins)), extent, unit, packed)
    return [units[b].flatten() for b in bins]


def _slots(extent: torch.Tensor, unit: int, packed: bool = False) -> int:
    """Token slots of the forward over units with these [n, 2] longest prompts and responses (packed:
    real prompt and response tokens)."""
    return forward_tokens(extent, packed=True) if packed else unit * forward_tokens(extent)


def _orders(extent: torch.Tensor) -> list[list[int]]:
    """The units longest first, by total length and by response length (then prompt length). Rows of
    similar totals can still differ in where their tokens lie (a long prompt and a short response beside
    a short prompt and a long one), which sorting by response avoids; where prompt lengths weigh more,
    the total can pack tighter. Both are packed and the better kept (fewer micro-batches, then fewer
    slots); with one prompt length throughout they are the same order."""
    total = extent.sum(1)
    by_response = extent[:, 1] * (int(extent[:, 0].max()) + 1) + extent[:, 0]
    orders = [torch.argsort(key, descending=True, stable=True).tolist() for key in (total, by_response)]
    return orders[:1] if orders[0] == orders[1] else orders


def _pack(order: list[int], extent: torch.Tensor, unit: int, max_tokens: int) -> list[list[int]]:
    """Contiguous bins of the units in `order`: as few as fit the budget (greedy), then, for not too many
    units, the split into that many with the fewest slots (`_least_padding`)."""
    bins: list[list[int]] = []
    width = (0, 0)  # the longest prompt and response of the last bin
    pairs = extent.tolist()
    for u in order:
        p, r = pairs[u]
        grown = (max(width[0], p), max(width[1], r))
        if bins and (len(bins[-1]) + 1) * unit * (grown[0] + max(1, grown[1])) <= max_tokens:
            bins[-1].append(u)
            width = grown
        else:
            bins.append([u])
            width = (p, r)
    if len(order) <= _MAX_UNITS_FOR_BALANCING:
        bins = _least_padding(order, extent, unit, max_tokens, len(bins))
    return bins


def _first_fit(order: list[int], tokens: list[int], max_tokens: int) -> list[list[int]]:
    """Packed bins: each unit, in `order` (longest first), into the first bin its real `tokens` fit
    (first-fit decreasing: at most 11/9 of the fewest bins, plus one)."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for u in order:
        b = next((b for b, load in enumerate(loads) if load + tokens[u] <= max_tokens), len(bins))
        if b == len(bins):
            bins.append([])
            loads.append(0)
        bins[b].append(u)
        loads[b] += tokens[u]
    return bins


# Above this many units per step the greedy bins already waste little (many rows of similar length
# share each bin), and the O(units² · bins) search below would cost more than it saves.
_MAX_UNITS_FOR_BALANCING = 512


def _least_padding(order: list[int], extent: torch.Tensor, unit: int, max_tokens: int, count: int) -> list[list[int]]:
    """The `count` contiguous bins of the sorted units with the fewest forward slots in total that fit
    the budget (greedy packing fixes the fewest bins; it can leave a long tail of short rows in the last
    bin). Dynamic programme over split points: best[b][j] = the cheapest cover of the first j units by b bins."""
    n = len(order)
    i, j = torch.arange(n)[:, None], torch.arange(n + 1)[None, :]
    # longest[i, k, :] = the longest prompt and response among sorted units i..k (k ≥ i; 0 before i).
    sorted_extent = extent[order].double()
    after = (torch.arange(n)[None, :] >= torch.arange(n)[:, None])[..., None]  # [i, k, 1]
    longest = torch.where(after, sorted_extent[None], 0.0).cummax(1).values  # [n, n, 2]
    span = longest[..., 0] + longest[..., 1].clamp(min=1)  # [i, k]: the width of bin i..k
    span = torch.cat([torch.zeros(n, 1, dtype=span.dtype), span], 1)  # [i, j]: of bin i..j−1
    slots = (j - i) * unit * span
    cost = torch.where((j > i) & ((slots <= max_tokens) | (j - i == 1)), slots, torch.inf)  # [n, n+1]
    best = torch.full((n + 1,), torch.inf, dtype=torch.float64)
    best[0] = 0.0
    starts = []
    for _ in range(count):
        total = best[:n, None] + cost  # [start i, end j]
        cheapest, start_of = total.min(0)
        best = torch.cat([torch.tensor([torch.inf], dtype=torch.float64), cheapest[1:]])
        starts.append(start_of)
    if not torch.isfinite(best[n]):  # cannot happen: greedy found `count` bins; keep its answer's shape
        raise RuntimeError("no packing into the greedy number of micro-batches")
    bounds, end = [], n
    for start_of in reversed(starts):
        start = int(start_of[end])
        bounds.append((start, end))
        end = start
    return [[order[k] for k in range(a, b)] for a, b in reversed(bounds)]


def _split_to_count(
    bins: list[list[int]], count: int, extent: torch.Tensor, unit: int, packed: bool = False
) -> list[list[int]]:
    """Split the costliest multi-unit bins in two until there are `count` bins."""
    if count > sum(len(b) for b in bins):
        raise RuntimeError(
            f"another rank needs {count} micro-batches, but this rank has only {sum(len(b) for b in bins)} "
            "sequences (or groups) in this step: ranks must hold the same number of prompts"
        )
    while len(bins) < count:
        i = max((k for k in range(len(bins)) if len(bins[k]) > 1), key=lambda k: _slots(extent[bins[k]], unit, packed))
        half = len(bins[i]) // 2
        bins[i : i + 1] = [bins[i][:half], bins[i][half:]]
    return bins
