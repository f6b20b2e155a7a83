"""Every RLVR algorithm, importable by name for `--model <Name>`."""

from rlvr_lightning.algos.base import RLVRModule
from rlvr_lightning.algos.dapo import DAPO
from rlvr_lightning.algos.dr_grpo import DrGRPO
from rlvr_lightning.algos.grpo import GRPO
from rlvr_lightning.algos.gspo import GSPO
from rlvr_lightning.algos.real import REAL

__all__ = ["RLVRModule", "GRPO", "DrGRPO", "DAPO", "GSPO", "REAL"]
