"""Every RLVR algorithm, importable by name for `--model <Name>`."""

from rlvr_lightning.algos.base import RLVRModule
from rlvr_lightning.algos.grpo import GRPO

__all__ = ["RLVRModule", "GRPO"]
