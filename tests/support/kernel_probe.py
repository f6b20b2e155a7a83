"""Run as a script (`python -m tests.support.kernel_probe STEPS`): the trainer's side of training, a short embedded
warm start (forwards, backwards and AdamW steps on the tiny model), in a fresh process whose environment the test
chooses; prints ATen's kernel selection and the trained weights' digest."""

from __future__ import annotations

import hashlib
import sys

import torch

import rlvr_lightning  # noqa: F401  (pins the CPU kernels unless RLVR_CPU_KERNELS=native)
from rlvr_lightning.models.embedded import build_char_tokenizer, build_tiny_qwen2
from rlvr_lightning.models.warm_start import WarmStartConfig, warm_start

if __name__ == "__main__":
    steps = int(sys.argv[1])
    cfg = WarmStartConfig(steps=steps, warmup_steps=min(10, steps))
    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen2(tokenizer, cfg.spec, seed=cfg.seed)
    warm_start(model, tokenizer, cfg)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:12]
    print(torch.backends.cpu.get_cpu_capability(), digest)
