"""What the 2-rank FSDP test (test_fsdp.py) loads into the CLI run: a stand-in correctness (`even_length`, see
below), and a callback that records, per rank, how much of the policy the rank holds, every scored rollout (to
replay them in one process), the engine's agreement with the trainer after the last sync, and the gathered final
weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from rlvr_lightning.callbacks.rollout import RolloutCallback
from rlvr_lightning.models.forward import sequence_logprobs
from rlvr_lightning.models.lora import adapter_weights
from rlvr_lightning.models.weights import full_weights

EVEN_LENGTH = "tests.support.fsdp_probe.even_length"  # `--model.init_args.rewards.correctness`


def even_length(completion: str, gold: str, metadata: dict) -> float:
    """The test's 60-step warm start answers almost nothing correctly, so a step can carry no learning signal at
    all (then nothing moves and the replay comparison proves nothing). A deterministic stand-in correctness, "the
    response has an even length", gives every step mixed groups; the replay reads the same recorded rewards."""
    return float(metadata["response_tokens"] % 2 == 0)


class ShardProbe(RolloutCallback):
    def __init__(self, out: str) -> None:
        self.out = Path(out)

    def on_train_start(self, trainer, pl_module) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        params = list(pl_module.policy.parameters())
        local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
        info = {"local": local, "total": sum(p.numel() for p in params), "world": trainer.world_size,
                "sharded": all(isinstance(p, DTensor) for p in params)}  # fmt: skip
        if pl_module.teacher is not None:  # on-policy distillation's teacher in the trainer
            info["teacher_sharded"] = all(isinstance(p, DTensor) for p in pl_module.teacher.model.parameters())
        (self.out / f"rank{trainer.global_rank}_shard.json").write_text(json.dumps(info))
        if pl_module.settings.lora is not None:  # the adapter's random start, for the one-process replay
            adapter = dict(adapter_weights(pl_module.policy))  # collective: every rank gathers
            if trainer.is_global_zero:
                torch.save(adapter, self.out / "initial_adapter.pt")

    def on_rollout_generated(self, step, rollout) -> None:  # the scored rollout: `even_length`'s correctness
        record = {k: getattr(rollout, k) for k in ("batch", "group_size", "prompt_ids", "completions", "sampling",
                                                  "texts", "correct")}  # fmt: skip
        torch.save(record, self.out / f"rank{step.collectives.rank}_step{step.rollout_batch}.pt")

    def on_train_end(self, trainer, pl_module) -> None:
        weights = dict(full_weights(pl_module.policy))  # collective: every rank gathers
        rollout = torch.load(self.out / f"rank{trainer.global_rank}_step0.pt", weights_only=False)
        n = next(i for i, c in enumerate(rollout["completions"]) if c.token_ids)
        prompt, completion = rollout["prompt_ids"][n // rollout["group_size"]], rollout["completions"][n].token_ids
        engine = pl_module.session.engine.logprobs(prompt, completion)
        trainer_lp = sequence_logprobs(pl_module.policy, prompt, completion)
        diff = max(abs(a - b) for a, b in zip(engine, trainer_lp))
        (self.out / f"rank{trainer.global_rank}_engine.json").write_text(json.dumps({"max_abs_diff": diff}))
        if trainer.is_global_zero:
            torch.save(weights, self.out / "final_weights.pt")
