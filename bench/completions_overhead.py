"""What logging the training completions table, token view and traces (`CompletionsTable`) costs a training step.

One GRPO module with THR (so that the token view carries shaper weights) and a reward function on the embedded
default (B = 16 prompts × G = 8, max 40 tokens, vLLM engine), an MLflow logger on a temporary sqlite store. After
every fifth step the callback runs as Lightning runs it at the batch's end, at its default size (two groups in the
table and the token view, one group traced); its time on the training thread is measured, and its background writes
(the table, the page, the traces and MLflow's export of them) run beside the next steps, as in a run. The cost of a
logged batch is its time on the training thread plus how much longer each of the three steps after it takes than a
step with no write beside it (medians, side by side in one process). Then one more logged batch's background writes are waited for and
timed alone. Reports each against the median step, per logged batch and at base.yaml's every 10th batch.

    .venv/bin/python bench/completions_overhead.py [--steps 6] [--engine vllm]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "examples"))  # my_rewards
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from common import close, embedded_module, median, prompt_batches, write  # noqa: E402

PERIOD = 5  # a logged batch, three steps beside its writes, one step after them


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--engine", default="vllm")
    args = parser.parse_args()

    from lightning.pytorch.loggers import MLFlowLogger

    from rlvr_lightning.algos import GRPO
    from rlvr_lightning.callbacks.completions import CompletionsTable
    from rlvr_lightning.training.settings import ComputeSettings, OptimSettings
    from rlvr_lightning.training.step_metrics import StepResult

    store = tempfile.mkdtemp(prefix="completions_overhead_")
    logger = MLFlowLogger(experiment_name="bench", tracking_uri=f"sqlite:///{store}/mlflow.db", artifact_location=f"{store}/artifacts")
    module = GRPO(optim=OptimSettings(lr=3e-5), compute=ComputeSettings(micro_batch_size=128), shapers={"thr": {"p": 0.2}},
                  rewards={"functions": [{"function": "my_rewards.brevity", "weight": 0.1}]})  # fmt: skip
    module = embedded_module(module, logger=logger, engine=args.engine)
    table = CompletionsTable(every_n_steps=1)
    module.trainer.callbacks.append(table)  # as in a run: the step keeps the logged groups' entropy for its token view
    batches = prompt_batches(module)
    after: dict[int, list[float]] = {k: [] for k in range(PERIOD)}  # step times by steps since the last logged batch
    main_thread = []
    for i in range(args.warmup + PERIOD * args.steps):
        batch = next(batches)
        t0 = time.perf_counter()
        module.last_result = module.train_on_batch(batch)
        module.rollout_batches += 1
        t1 = time.perf_counter()
        timed = i >= args.warmup and isinstance(module.last_result, StepResult)
        if timed:
            after[(i - args.warmup) % PERIOD].append(t1 - t0)
        if (i - args.warmup) % PERIOD == 0:
            table.on_train_batch_end(module.trainer, module, None, batch, i)
            if timed:
                main_thread.append(time.perf_counter() - t1)
    table.teardown(module.trainer, module, "fit")  # the last batch's writes (and MLflow's trace export) waited for
    t0 = time.perf_counter()
    table.on_train_batch_end(module.trainer, module, None, batch, 0)
    table.teardown(module.trainer, module, "fit")
    written = time.perf_counter() - t0
    close(module)
    # position 0 is the logged step itself (its writes start after it); PERIOD - 1 steps later they are long done
    step, on_thread = median(after[0] + after[PERIOD - 1]), median(main_thread)
    slowdown = {k: median(after[k]) - step for k in range(1, PERIOD - 1)}
    per_logged = on_thread + sum(max(0.0, x) for x in slowdown.values())
    write("completions_overhead", {
        "workload": {"model": "embedded", "batch_size": 16, "group_size": 8, "max_response_length": 40,
                     "engine": args.engine, "steps": args.steps, "groups_logged": table.groups, "shapers": "thr",
                     "logged": "table, token view, traces"},
        "median_seconds": {"step": step, "on_training_thread": on_thread, "background_write_alone": written,
                           **{f"slowdown_of_step_{k}_after": x for k, x in slowdown.items()}},
        "steps_timed": {"logged": len(after[0]), "per_position": [len(after[k]) for k in range(PERIOD)]},
        "ratio_to_step": {"logged_batch": per_logged / step, "every_10th_batch": per_logged / step / 10,
                          "training_thread_every_batch": on_thread / step, "background_alone": written / step},
    })  # fmt: skip


if __name__ == "__main__":
    main()
