"""rlvr_lightning: reinforcement learning with verifiable rewards, every algorithm a LightningModule."""

from rlvr_lightning.cpu_kernels import pin_cpu_kernels

pin_cpu_kernels()  # before any tensor is computed: one CPU kernel path on every x86 processor (cpu_kernels.py)

__version__ = "0.1.0"
