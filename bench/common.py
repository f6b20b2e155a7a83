"""Shared set-up for the benchmarks: the embedded default workload through the real module code."""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def embedded_module(module, callbacks=(), engine: str = "vllm", batch_size: int = 16, group_size: int = 8, seed: int = 0):
    """`module` wired to the embedded default data/model (configs/base.yaml's sizes) outside `fit`."""
    from rlvr_lightning.callbacks.reward import RewardVerifier
    from rlvr_lightning.data.datamodule import RolloutDataModule
    from rlvr_lightning.standalone import standalone

    dm = RolloutDataModule(
        batch_size=batch_size, group_size=group_size, max_prompt_length=32, max_response_length=40,
        engine=engine, seed=seed, val_data=None,
    )  # fmt: skip
    torch.manual_seed(seed)
    return standalone(module, dm, callbacks=[RewardVerifier(num_workers=2, timeout_s=5.0), *callbacks])


def close(module) -> None:
    for cb in module.trainer.callbacks:
        cb.teardown(module.trainer, module, "fit")
    module.datamodule.teardown("fit")


def prompt_batches(module):
    while True:
        yield from module.datamodule.train_dataloader()


def median(values) -> float:
    return statistics.median(values) if values else float("nan")


def write(name: str, payload: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    payload = {
        "benchmark": name,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {"platform": platform.platform(), "cpus": torch.get_num_threads(),
                    "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None},  # fmt: skip
        **payload,
    }
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    print(json.dumps(payload, indent=2))
    return path
