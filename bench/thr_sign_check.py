"""Does THR's sign mean what it says on the embedded policy's own rollouts?

Samples rollout batches of the warm-started embedded policy (vLLM, B = 16 × G = 8), scores them with
the verifier, and for every mixed group takes one small gradient step on the THR > 0 tokens and one on
the THR < 0 tokens (`rlvr_lightning.attribution.thr_check`), measuring the change of the summed
log-likelihood of the group's correct responses. Reports how often the THR > 0 step raises it and the
THR < 0 step lowers it, for a step of all parameters and of the (untied) LM head alone.

    .venv/bin/python bench/thr_sign_check.py [--batches 2] [--lrs 1e-5,1e-3]

THR is a first-order statement: the small step (1e-5) tests it; the larger one shows where it stops holding.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402
from common import close, embedded_module, prompt_batches, write  # noqa: E402


def untied(policy):
    model = copy.deepcopy(policy)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    model.config.tie_word_embeddings = False
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--lrs", default="1e-5,1e-3")
    args = parser.parse_args()

    from rlvr_lightning.algos import GRPO
    from rlvr_lightning.attribution.thr_check import thr_sign_check
    from rlvr_lightning.pieces.advantages import mixed_groups
    from rlvr_lightning.training.generation import generate_and_score
    from rlvr_lightning.training.step_metrics import StageTimer

    module = embedded_module(GRPO())
    pad = module.trainer.datamodule.tokenizer.pad_token_id
    head_model = untied(module.policy)
    batches = prompt_batches(module)
    # per step kind: [groups where it held, groups with tokens of that sign]
    lrs = [float(x) for x in args.lrs.split(",")]
    runs = [(lr, p) for lr in lrs for p in ("all", "head")]
    counts = {f"lr={lr:g}/{p}": {"positive_raises": [0, 0], "negative_lowers": [0, 0]} for lr, p in runs}
    groups = 0
    for b in range(args.batches):
        module.rollout_batches = b
        step = module.step_context()
        rollout = generate_and_score(step, next(batches), StageTimer())
        for group in mixed_groups(rollout.correct.float(), rollout.group_size).nonzero().squeeze(1).tolist():
            one = rollout.select_groups([group])
            advantages = module.rlvr_step.prepare(step, one)[0].advantages
            groups += 1
            for lr, params in runs:
                policy = module.policy if params == "all" else head_model
                out = thr_sign_check(policy, one, advantages, pad, lr=lr, params=params)
                key_run = f"lr={lr:g}/{params}"
                for key, sign, held in (("positive_raises", "positive", out["positive"] > 0),
                                        ("negative_lowers", "negative", out["negative"] < 0)):  # fmt: skip
                    if out[f"{sign}_tokens"] > 0:
                        counts[key_run][key][0] += held
                        counts[key_run][key][1] += 1
    close(module)
    write("thr_sign_check", {
        "workload": {"model": "embedded (warm start)", "batches": args.batches, "sgd_lrs": lrs},
        "mixed_groups": groups,
        "holds": {p: {k: {"frac": h / max(n, 1), "groups": n} for k, (h, n) in c.items()} for p, c in counts.items()},
    })  # fmt: skip


if __name__ == "__main__":
    main()
