"""A local sandbox for model-written Python: pre-warmed workers in bubblewrap namespaces, with resource limits
and a wall-clock kill of everything a call starts (`docs/sandbox.md`). Nothing a model writes runs in the
trainer's process."""

from rlvr_lightning.sandbox.isolation import SandboxUnavailable
from rlvr_lightning.sandbox.pool import Execution, Sandbox, SandboxSettings, memory_line

__all__ = ["Execution", "Sandbox", "SandboxSettings", "SandboxUnavailable", "memory_line"]
