"""The stages of one training step, each in a module of its own (`RLVRModule.training_step` calls
them in order):

  generation.py   sample G completions per prompt, score them (and DAPO's dynamic sampling rounds)
  prepare.py      lay the rollout out as tensors; behaviour (θ_old) and reference log-probs; token
                  weights of the advantage shapers; loss mask; truncated-IS weights → `UpdateInputs`
  behaviour.py    where θ_old's log-probs come from: a separate no-grad pass, the engine, or the
                  update's own forward when that runs exactly at θ_old
  update.py       mini-batches, micro-batch gradient accumulation (or the two-pass method), clipping,
                  the non-finite guard
  step_metrics.py what each step logs, and the stage timer
The engine weight sync lives beside its probe (`rlvr_lightning.rollout.sync`), the forward that
gives log-probs, entropy and LM-head inputs in `rlvr_lightning.models.forward`.
"""
