"""The training prompts a step draws: the dataloader's batches by index, the extra prompts beyond them (DAPO's dynamic
sampling) split between ranks and resumed from their position, and only problems the verifier kept."""

from __future__ import annotations

import json

from rlvr_lightning.algos.wiring import keep_scorable_problems
from rlvr_lightning.data.datamodule import RolloutDataModule
from rlvr_lightning.data.sources import ProblemRecord
from rlvr_lightning.data.training_prompts import TrainingPrompts
from rlvr_lightning.rewards.settings import RewardSettings, VerifierSettings
from rlvr_lightning.rollout.types import PromptBatch
from rlvr_lightning.training.scoring import Scoring

RECORDS = [ProblemRecord(f"p{i}", f"{i}+1?", str(i + 1)) for i in range(10)]


def ids_of(records: list[ProblemRecord]) -> PromptBatch:
    return PromptBatch([r.id for r in records], [r.problem for r in records], [r.answer for r in records])


def prompts(rank: int = 0, world_size: int = 1) -> TrainingPrompts:
    return TrainingPrompts(RECORDS, 2, 0, ids_of, rank, world_size)


def test_extra_prompts_split_between_ranks_reshuffle_each_pass_and_resume_from_their_position():
    ranks = [prompts(r, 2) for r in (0, 1)]
    drawn = [[p.extra(3).ids for p in ranks] for _ in range(3)]  # 3 rounds × 2 ranks × 3 = 18: past one pass of 10
    for round_ids in drawn:
        assert not set(round_ids[0]) & set(round_ids[1])  # a round's prompts differ between ranks
    first_pass = [i for round_ids in drawn[:2] for ids in round_ids for i in ids][:10]
    assert sorted(first_pass) == sorted(r.id for r in RECORDS)  # each problem once per pass
    resumed = prompts(0, 2)
    resumed.load_state_dict(ranks[0].state_dict())
    assert resumed.extra(3).ids == ranks[0].extra(3).ids  # a resumed run draws what the interrupted one would have
    assert ranks[0].state_dict() != prompts().state_dict()


def test_batch_at_is_the_dataloaders_batch_and_leaves_the_extra_stream_alone():
    p = prompts()
    stream = p.stream(0)
    two_epochs = [b.ids for b in stream] + [b.ids for b in stream]  # Lightning iterates once per epoch
    assert two_epochs == [p.batch_at(i).ids for i in range(10)]
    assert p.state_dict() == {"extra_epoch": 0, "extra_pos": 0}


def test_a_problem_the_verifier_drops_after_setup_is_never_drawn(tmp_path, tiny_policy_dir):
    """The run drops problems whose gold the verifier cannot parse in the module's setup hook, after the data module's:
    the prompts the step draws are over the problems it kept, in the dataloader's batches and the extra prompts."""
    rows = [{"problem": f"{i}+1?", "answer": str(i + 1)} for i in range(7)] + [{"problem": "bad", "answer": "\\text{ }"}]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    dm = RolloutDataModule(model_name_or_path=str(tiny_policy_dir), train_data=str(data), val_data=None, batch_size=2)
    dm.setup("fit")
    bad = next(r.id for r in dm.train_records if r.answer == "\\text{ }")
    scoring = Scoring(RewardSettings(verifier=VerifierSettings(num_workers=1)))
    try:
        keep_scorable_problems(scoring, dm)  # what the module's setup hook does, after the data module's
    finally:
        scoring.close()
    assert len(dm.train_records) == 7
    drawn = [i for b in range(6) for i in dm.prompts.batch_at(b).ids] + dm.prompts.extra(20).ids
    drawn += [i for batch in dm.train_dataloader() for i in batch.ids]
    assert bad not in drawn and set(drawn) == {r.id for r in dm.train_records}
