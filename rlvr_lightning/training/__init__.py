"""One training step (`step.py`: `TrainingStep.run` calls the stages in order) and its stages, each in a
module of its own. A stage receives the step's context (`rlvr_lightning.context.StepContext`: policy,
engine session, tokenizer, prompt source, counters, collectives) and the values of earlier stages, and
returns values; the LightningModule builds the step and is never passed to it.

  step.py             TrainingStep (collect → prepare → update → sync) and StepAlgorithm (what an algorithm
                      changes in it: DAPO's reward shaping and dynamic sampling)
  engine_session.py   the rollout engine, the weight sync and the policy version, the stream and its checkpoint
  generation.py       sample G completions per prompt with the engine, score them (the rollout callbacks)
  dynamic_sampling.py DAPO's rounds of generation until enough groups have mixed correctness
  rollout_stream.py   rollout batches generated ahead on the servers, up to max_staleness versions
  throughput_stream.py  the same bound, groups generated continuously and trained as they finish
  prepare.py          lay the scored batch out as tensors; θ_old and reference log-probs; the advantage
                      shapers' token weights; loss mask; the rollout correction's weights → `UpdateInputs`
  behaviour.py        where θ_old's log-probs come from: a separate no-grad pass, the engine, or the
                      update's own forward when that runs exactly at θ_old
  shaping.py          the advantage shapers' (THR, OAR) token weights, composed
  batch.py            `UpdateInputs`, the micro-batch `LossBatch`, and the step's global counts
  objective.py        the loss composed from the registered pieces (`rlvr_lightning.pieces`)
  layout.py           mini-batches, passes, micro-batch layout and clipping; the optimizer handles
  micro_batches.py    how a step's sequences are split into micro-batches (rows or token budgets)
  update.py           micro-batch gradient accumulation (or the two-pass method), clipping, the non-finite guard
  step_metrics.py     what each step logs, and the stage timer
  optim.py            AdamW with warm-up and a constant or cosine schedule
The weight sync's probe lives in `rlvr_lightning.rollout.sync`, the forward that
gives log-probs, entropy and LM-head inputs in `rlvr_lightning.models.forward`.
"""
