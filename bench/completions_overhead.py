"""What logging the training completions table and token view (`CompletionsTable`) costs a training step.

One GRPO module with THR (so that the token view carries shaper weights) and a reward function on the embedded
default (B = 16 prompts × G = 8, max 40 tokens, vLLM engine), an MLflow logger on a temporary sqlite store. After each
timed step the callback runs as Lightning runs it at the batch's end, logging every batch (`every_n_steps` 1, the worst
case) at its default size (two groups); its time on the training thread is measured, then its background writes are
waited for and timed. Reports, per logged batch, both times and their ratio to the median step time, and the ratio at
base.yaml's every 10th batch (what a run pays).

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
    batches = prompt_batches(module)
    steps, main_thread, background = [], [], []
    for i in range(args.warmup + args.steps):
        batch = next(batches)
        t0 = time.perf_counter()
        module.last_result = module.train_on_batch(batch)
        module.rollout_batches += 1
        t1 = time.perf_counter()
        table.on_train_batch_end(module.trainer, module, None, batch, i)
        t2 = time.perf_counter()
        for future in table._pending:
            future.result()
        t3 = time.perf_counter()
        if i >= args.warmup and isinstance(module.last_result, StepResult):
            steps.append(t1 - t0)
            main_thread.append(t2 - t1)
            background.append(t3 - t2)
    table.teardown(module.trainer, module, "fit")
    close(module)
    step, on_thread, written = median(steps), median(main_thread), median(background)
    write("completions_overhead", {
        "workload": {"model": "embedded", "batch_size": 16, "group_size": 8, "max_response_length": 40,
                     "engine": args.engine, "steps": args.steps, "groups_logged": table.groups, "shapers": "thr"},
        "median_seconds": {"step": step, "on_training_thread": on_thread, "background_write": written},
        "ratio_to_step": {"training_thread_every_batch": on_thread / step, "background_every_batch": written / step,
                          "training_thread_every_10th_batch": on_thread / step / 10},
    })  # fmt: skip


if __name__ == "__main__":
    main()
