"""Micro-batch layouts: token budgets, whole groups, one count on every rank, and trimmed tensors."""

from __future__ import annotations

import pytest
import torch

from rlvr_lightning.rollout.types import Completion, PromptBatch, Rollout, SamplingConfig
from rlvr_lightning.training import micro_batches
from rlvr_lightning.training.micro_batches import forward_tokens, split_rows

# A long-tailed spread of 16 sequences (4 groups of 4), as real rollouts have: their real tokens, a
# 20-token prompt and the rest response (one prompt length, so a micro-batch's forward is rows × its longest).
LENGTHS = torch.tensor([40, 900, 60, 2100, 75, 80, 1200, 55, 300, 45, 70, 65, 500, 2000, 90, 50])
COUNTS = torch.stack([torch.full_like(LENGTHS, 20), LENGTHS - 20], 1)


def rollout_tensors(prompt_lengths: list[int], response_lengths: list[int], group_size: int = 1):
    """The laid-out tensors of a rollout with these prompt (one per group) and response lengths."""
    prompts = [list(range(3, 3 + p)) for p in prompt_lengths]
    comps = [Completion([7] * r, [0.0] * r, "stop") for r in response_lengths]
    batch = PromptBatch([str(i) for i in range(len(prompts))], [""] * len(prompts), [""] * len(prompts))
    return Rollout(batch, group_size, prompts, comps, SamplingConfig(group_size=group_size), 0).tensors(0)


def forward_sizes(t, batches) -> list[int]:
    """Token slots of each micro-batch's forward as the update and the θ_old pass lay it out."""
    return [t.select(b).trimmed().input_ids.numel() for b in batches]


def test_rows_without_a_budget_are_consecutive_micro_batch_size_slices():
    batches = split_rows(torch.arange(16), COUNTS, 6, None)
    assert [b.tolist() for b in batches] == [list(range(6)), list(range(6, 12)), list(range(12, 16))]


@pytest.mark.parametrize("unit", [1, 4])
@pytest.mark.parametrize("budget", [100, 2500, 5000, 10**6])
def test_budget_packs_every_row_once_within_the_budget(unit, budget):
    rows = torch.arange(16)
    batches = split_rows(rows, COUNTS, 6, budget, unit)
    assert sorted(torch.cat(batches).tolist()) == rows.tolist()
    for b in batches:
        if len(b) > unit:  # a unit longer than the budget alone is allowed to exceed it
            assert len(b) * int(LENGTHS[b].max()) <= budget
        # Whole groups (unit = G): every group met in a micro-batch has all its rows there.
        for g in set((b // unit).tolist()):
            assert set(range(g * unit, (g + 1) * unit)) <= set(b.tolist()), (g, b.tolist())


def test_sorting_by_length_removes_most_padding():
    """512 responses log-normal around 900 tokens, clipped to [512, 2048], under 100-token prompts:
    buckets by length waste under 5% of the slots, consecutive rows of the same size far more."""
    g = torch.Generator().manual_seed(0)
    responses = (900 * torch.exp(0.5 * torch.randn(512, generator=g))).clamp(512, 2048).long()
    counts = torch.stack([torch.full_like(responses, 100), responses], 1)
    rows, budget = torch.arange(512), 8 * 2148

    def padding(batches):
        return 1 - int(counts.sum()) / sum(forward_tokens(counts[b]) for b in batches)

    assert padding(split_rows(rows, counts, 8, budget)) < 0.05 < 0.2 < padding(split_rows(rows, counts, 8, None))


def test_ranks_agree_on_the_count_by_splitting_their_largest_micro_batches():
    batches = split_rows(torch.arange(16), COUNTS, 6, 10**6, agree_count=lambda k: k + 3)
    assert len(batches) == 4  # one micro-batch alone would do; another rank needs four
    assert sorted(torch.cat(batches).tolist()) == list(range(16))
    with pytest.raises(RuntimeError, match="same number of prompts"):
        split_rows(torch.arange(16), COUNTS, 6, 10**6, unit=4, agree_count=lambda k: 5)


def test_trimmed_keeps_every_real_token_at_its_position():
    prompts = [[5, 6], [7, 8, 9, 10, 11]]
    comps = [Completion([20, 21, 22], [0.0] * 3, "stop"), Completion([23], [0.0], "stop"),
             Completion([24, 25, 26, 27, 28, 29], [0.0] * 6, "length"), Completion([30], [0.0], "stop")]  # fmt: skip
    t = Rollout(
        PromptBatch(["a", "b"], ["", ""], ["", ""]), 2, prompts, comps, SamplingConfig(group_size=2), 0
    ).tensors(0)
    sub = t.select(torch.tensor([0, 1]))  # group 0: prompt of 2 under a width of 5, responses ≤ 3
    trimmed = sub.trimmed()
    assert trimmed.prompt_width == 2 and trimmed.response_mask.shape[1] == 3
    assert trimmed.input_ids.tolist() == [[5, 6, 20, 21, 22], [5, 6, 23, 0, 0]]
    real = sub.attention_mask.bool()
    assert trimmed.position_ids[trimmed.attention_mask.bool()].tolist() == sub.position_ids[real].tolist()
    assert t.trimmed().input_ids.shape == t.input_ids.shape  # nothing to trim in the whole batch


def test_sharded_ranks_run_the_same_separate_pass_forwards_even_without_rows_to_score():
    """Under FSDP every forward gathers weights on all ranks: a rank whose micro-batch has no group to
    score (THR reads mixed groups only) must still run it when another rank's does (`lockstep`)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlvr_lightning.training.behaviour import separate_pass

    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2)).eval()  # fmt: skip
    comps = [Completion([5, 6, 7], [0.0] * 3, "stop") for _ in range(4)]
    t = Rollout(
        PromptBatch(["a", "b"], ["", ""], ["", ""]), 2, [[3, 4], [3]], comps, SamplingConfig(group_size=2), 0
    ).tensors(0)

    class NothingToScore:  # this rank's groups are all unmixed
        def needs_any(self, rows):
            return False

    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    by_two = lambda rows, _whole: list(rows.split(2))  # noqa: E731
    for lockstep, expected in ((False, 0), (True, 2)):
        calls.clear()
        separate_pass(model, None, t, 1.0, by_two, 0, with_old=False, weigher=NothingToScore(), lockstep=lockstep)
        assert len(calls) == expected


def test_small_batches_get_the_least_padding_of_any_split_into_as_few_micro_batches():
    """Against brute force over every contiguous split of the length-sorted rows into the fewest
    micro-batches that fit the budget."""
    from itertools import combinations

    g = torch.Generator().manual_seed(4)
    lengths = (900 * torch.exp(0.6 * torch.randn(11, generator=g))).clamp(100, 3000).long()
    budget = 4 * 1500
    counts = torch.stack([torch.full_like(lengths, 30), lengths - 30], 1)  # one prompt length
    batches = split_rows(torch.arange(11), counts, 8, budget)
    slots = lambda bs: sum(len(b) * int(lengths[b].max()) for b in bs)  # noqa: E731
    s = sorted(lengths.tolist(), reverse=True)
    best = None
    for cuts in combinations(range(1, 11), len(batches) - 1):
        edges = [0, *cuts, 11]
        parts = [s[a:b] for a, b in zip(edges, edges[1:])]
        if all(len(p) == 1 or len(p) * p[0] <= budget for p in parts):
            cost = sum(len(p) * p[0] for p in parts)
            best = cost if best is None else min(best, cost)
    assert slots(batches) == best


def test_budget_counts_the_longest_prompt_plus_the_longest_response():
    """A long prompt with a short answer and a short prompt with a long answer: 64 real tokens each, but
    together their forward is 2 × (60 + 60) columns, far over a budget of 130."""
    t = rollout_tensors([60, 4], [4, 60])
    assert t.lengths.tolist() == [64, 64] and t.token_counts.tolist() == [[60, 4], [4, 60]]
    batches = split_rows(torch.arange(2), t.token_counts, 8, 130)
    assert sorted(torch.cat(batches).tolist()) == [0, 1]
    assert max(forward_sizes(t, batches)) <= 130
    # Room for both once the budget covers their joint width.
    assert [b.tolist() for b in split_rows(torch.arange(2), t.token_counts, 8, 240)] == [[0, 1]]
    # Empty responses still take one column: two 10-token prompts without an answer run 2 × 11.
    t = rollout_tensors([10, 10], [0, 0])
    for budget, count in ((21, 2), (22, 1)):
        batches = split_rows(torch.arange(2), t.token_counts, 8, budget)
        assert len(batches) == count and max(forward_sizes(t, batches)) <= budget
    # … also where the least-padding search would otherwise put three empty answers together (3 × 4 ≤ 12).
    t = rollout_tensors([1, 3, 3, 5, 4], [1, 0, 0, 3, 0])
    batches = split_rows(torch.arange(5), t.token_counts, 8, 12)
    assert all(size <= 12 for b, size in zip(batches, forward_sizes(t, batches)) if len(b) > 1)


def test_rows_alike_in_length_but_not_in_shape_pair_by_shape():
    """Four rows of 64 tokens, two mostly prompt and two mostly response: sorted by length alone no two
    neighbours fit 140 together; sorted by response length the alike pair up."""
    t = rollout_tensors([60, 4, 58, 6], [4, 60, 6, 58])
    batches = split_rows(torch.arange(4), t.token_counts, 8, 140)
    assert sorted(sorted(b.tolist()) for b in batches) == [[0, 2], [1, 3]]
    assert forward_sizes(t, batches) == [2 * 66, 2 * 66]


@pytest.mark.parametrize("balanced", [True, False])
@pytest.mark.parametrize("unit", [1, 4])
@pytest.mark.parametrize("seed", range(3))
def test_every_forward_fits_the_budget_when_prompt_and_response_lengths_both_vary(unit, seed, balanced, monkeypatch):
    """Groups of 4 with their own prompt lengths and spread response lengths, packed as sequences or as
    whole groups, with and without another rank's count, with the least-padding search or greedy alone
    (large batches): the forward each micro-batch really runs (its rows selected and trimmed, as the
    update and the θ_old pass do) fits the budget, unless it is one unit that alone does not."""
    if not balanced:
        monkeypatch.setattr(micro_batches, "_MAX_UNITS_FOR_BALANCING", 0)
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, 300, (12,), generator=g).tolist()
    responses = (150 * torch.exp(torch.randn(48, generator=g))).clamp(0, 1500).long().tolist()
    t = rollout_tensors(prompts, responses, group_size=4)
    rows = torch.arange(48)
    for budget in (400, 1500, 4000, 12000):
        for agree in (None, lambda k: min(k + 2, 48 // unit)):  # another rank needs more micro-batches
            batches = split_rows(rows, t.token_counts, 8, budget, unit, agree)
            assert sorted(torch.cat(batches).tolist()) == rows.tolist()
            for b, size in zip(batches, forward_sizes(t, batches)):
                assert size == forward_tokens(t.token_counts[b])
                assert size <= budget or len(b) == unit, (budget, b.tolist(), size)
                if unit == 4:  # whole groups: every group met has all its rows here
                    assert all(set(range(4 * g, 4 * g + 4)) <= set(b.tolist()) for g in (b // 4).tolist())


def test_a_unit_over_the_budget_runs_alone():
    t = rollout_tensors([50, 10], [10, 10, 300, 5], group_size=2)  # group 0's forward is 2 × 60, group 1's 2 × 310
    batches = split_rows(torch.arange(4), t.token_counts, 8, 200, unit=2)
    assert sorted(b.tolist() for b in batches) == [[0, 1], [2, 3]]
    assert sorted(forward_sizes(t, batches)) == [2 * 60, 2 * 310]
