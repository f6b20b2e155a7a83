"""DAPO's dynamic sampling on 2 gloo ranks whose rounds find different numbers of mixed groups: the
ranks draw the same number of rounds, keep the same number of groups, and skip or raise together.
(A rank that stopped alone would leave the other waiting in the update's collectives.)"""

from __future__ import annotations

import pytest

from tests.support.two_ranks import run_two_ranks
from tests.training.test_dynamic_sampling import scored_rollout

MIXED, ALL_RIGHT, ALL_WRONG = [1, 0], [1, 1], [0, 0]

# Per case: each rank's rounds (groups of G = 2 per round), target groups, round limit, on_exhausted.
CASES = {
    # Rank 1 has its 2 groups after round 0, rank 0 only after round 1: both draw 2 rounds.
    "late_rank": ([[[ALL_RIGHT, ALL_WRONG], [MIXED, MIXED]], [[MIXED, MIXED], [MIXED, ALL_WRONG]]], 2, 5, "error"),
    # At the round limit rank 0 has 1 group, rank 1 has 3: both train on 1.
    "partial": ([[[MIXED, ALL_WRONG], [ALL_WRONG, ALL_WRONG]], [[MIXED, MIXED], [MIXED, ALL_WRONG]]], 4, 2, "train_partial"),
    # Rank 0 finds nothing: both skip the batch (None), although rank 1 found groups.
    "empty": ([[[ALL_WRONG, ALL_WRONG], [ALL_RIGHT, ALL_WRONG]], [[MIXED, MIXED], [MIXED, MIXED]]], 2, 2, "train_partial"),
    # The same under on_exhausted=error: both raise, not only rank 0.
    "error": ([[[ALL_WRONG, ALL_WRONG], [ALL_RIGHT, ALL_WRONG]], [[MIXED, MIXED], [MIXED, MIXED]]], 2, 2, "error"),
}


def _rank(rank: int, port: int, case: str, out: dict) -> None:
    import os

    import torch
    import torch.distributed as dist

    from rlvr_lightning.training.dynamic_sampling import DynamicSamplingExhausted, dynamic_sample

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    rounds, target, max_rounds, on_exhausted = CASES[case]
    calls = []

    def draw(k: int):
        calls.append(k)
        return scored_rollout(rounds[rank][k], k)

    def fewest(n: int) -> int:
        t = torch.tensor(n)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t)

    try:
        rollout, stats = dynamic_sample(draw, target, max_rounds, on_exhausted, fewest)
        out[rank] = (len(calls), None if rollout is None else len(rollout.batch), stats.exhausted)
    except DynamicSamplingExhausted:
        out[rank] = (len(calls), "raised", True)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "case,expected",
    [
        ("late_rank", (2, 2, False)),
        ("partial", (2, 1, True)),
        ("empty", (2, None, True)),
        ("error", (2, "raised", True)),
    ],
)
def test_ranks_agree_on_rounds_groups_and_the_decision(case, expected):
    result = run_two_ranks(_rank, case, timeout_s=60)
    assert result == {0: expected, 1: expected}


@pytest.mark.e2e
def test_dapo_on_two_fsdp_ranks_with_the_hf_engine_stays_in_step(tmp_path, quick_warm_start):
    """The whole run through the CLI: FSDP2 on 2 gloo ranks, the HF engine (its sharded `generate` is a
    collective per decoding step), correctness that differs between the ranks (tests/support/dapo_rank_probe.py)."""
    import json

    from tests.e2e.test_fsdp import fsdp_args
    from tests.support.cli import run_cli
    from tests.support.dapo_rank_probe import UNEVEN

    _, model_dir = quick_warm_start
    (tmp_path / "uneven.yaml").write_text(
        "trainer:\n  callbacks+:\n    - class_path: tests.support.dapo_rank_probe.RoundRecord\n"
        f"      init_args: {{out: {tmp_path / 'uneven'}}}\n"
    )
    args = fsdp_args(tmp_path, model_dir, "dapo")
    args += ["--config", str(tmp_path / "uneven.yaml"), "--rollout.engine", "hf", "--rollout_batches", "2",
             "--model.init_args.num_mini_batches=2", "--model.init_args.compute.micro_batch_size=8",
             f"--model.init_args.rewards.correctness={UNEVEN}",  # over fsdp_args' own
             "--data.val_data", "null"]  # no held-out evaluation: it would score with UNEVEN too, a round it counts  # fmt: skip
    proc = run_cli(args, tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / "uneven" / f"rank{r}.json").read_text()) for r in (0, 1)]
    for record in ranks:
        assert [len(record["rounds"][step]) for step in ("0", "1")] == [2, 2]  # rank 1 waited for rank 0
        assert record["policy_version"] == 2  # both trained and synced on both rollout batches
    for step in ("0", "1"):  # the extra prompts of the ranks' rounds are different prompts
        extra = [{i for batch in r["rounds"][step] for i in batch[2:]} for r in ranks]
        assert extra[0] and not extra[0] & extra[1]
