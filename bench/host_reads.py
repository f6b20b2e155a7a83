"""Host reads in the update: how often one micro-batch of the update reads a value back from the device.

Every `float(t)`, `.item()` or `bool(t)` of a tensor runs PyTorch's `aten._local_scalar_dense`; on a GPU each one
waits for every kernel queued before it, the backward's included, so a read per micro-batch keeps the host from
queueing the next micro-batch while the GPU runs this one. This counts them at PyTorch's dispatcher during one real
training step of each preset on the embedded default (HF engine: the count is the update's, not the engine's), at
two micro-batch sizes, and reports the reads per micro-batch (the difference over the difference in micro-batches)
by the innermost frame of this library or of transformers that made them. On the CPU nothing waits; the count is
what a GPU run would wait on.

    .venv/bin/python bench/host_reads.py [--presets grpo,dapo]     # ~1 min
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402
from common import CONFIGS, _instantiate, close, embedded_module, prompt_batches, write  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

SIZES = (16, 8)  # sequences per micro-batch: 8 and 16 micro-batches of the 128 sequences (DAPO: of its 4 mini-batches)


class HostReads(TorchDispatchMode):
    """Counts `_local_scalar_dense` by the innermost frame of rlvr_lightning or transformers above it."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            frames = [f for f in traceback.extract_stack() if "rlvr_lightning/" in f.filename or "transformers/" in f.filename]
            site = "other"
            if frames:
                path = frames[-1].filename
                site = f"{path[path.rindex('rlvr_lightning/' if 'rlvr_lightning/' in path else 'transformers/'):]}:{frames[-1].lineno}"
            self.sites[site] += 1
        return func(*args, **(kwargs or {}))


def update_reads(name: str, micro_batch_size: int) -> tuple[collections.Counter, int]:
    """The host reads of one training step's `accumulate_gradients` calls, and the micro-batches they ran."""
    import yaml

    from rlvr_lightning.training.layout import UpdateLayout
    from rlvr_lightning.training.update import PolicyUpdate

    cfg = yaml.safe_load((CONFIGS / "algo" / f"{name}.yaml").read_text())
    cfg["model"].setdefault("init_args", {}).setdefault("compute", {})["micro_batch_size"] = micro_batch_size
    module = embedded_module(_instantiate(cfg["model"]), engine="hf")
    counted, micro_batches, inside = collections.Counter(), [0], [False]
    inner, split = PolicyUpdate.accumulate_gradients, UpdateLayout.micro_batches

    def counting(self, *args, **kwargs):
        inside[0] = True
        try:
            with HostReads() as reads:
                loss = inner(self, *args, **kwargs)
        finally:
            inside[0] = False
        counted.update(reads.sites)
        return loss

    def counted_split(self, *args, **kwargs):
        out = split(self, *args, **kwargs)
        micro_batches[0] += len(out) if inside[0] else 0
        return out

    PolicyUpdate.accumulate_gradients, UpdateLayout.micro_batches = counting, counted_split
    try:
        module.train_on_batch(next(prompt_batches(module)))
    finally:
        PolicyUpdate.accumulate_gradients, UpdateLayout.micro_batches = inner, split
        close(module)
    return counted, micro_batches[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", default="grpo,dapo")
    args = parser.parse_args()
    rows = {}
    for name in args.presets.split(","):
        (few, n_few), (many, n_many) = (update_reads(name, size) for size in SIZES)
        extra = n_many - n_few
        assert extra > 0, f"{name}: both sizes ran {n_few} micro-batches"
        per_site = {site: (many[site] - few[site]) / extra for site in many | few if many[site] != few[site]}
        rows[name] = {"micro_batches": [n_few, n_many], "reads": [sum(few.values()), sum(many.values())],
                      "reads_per_micro_batch": sum(per_site.values()), "per_micro_batch_by_site": per_site}  # fmt: skip
    write("host_reads", {"micro_batch_sizes": SIZES, "presets": rows})


if __name__ == "__main__":
    main()
