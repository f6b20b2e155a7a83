"""How the trainer's weights reach `vllm serve` replicas (`rollout.sync.weight_transfer`): one `WeightTransport` per
engine, chosen by name.

- `snapshot` (snapshot_transport.py; CPU, and any machine sharing a filesystem with the servers): safetensors
  shards in shared memory, loaded by every replica with vLLM's `reload_weights`.
- `nccl` (nccl_transport.py; GPU): vLLM's NCCL weight-transfer engine, one group per replica with the trainer
  as rank 0.
`auto` picks `nccl` when CUDA is available and `snapshot` otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar, Protocol

import torch

from rlvr_lightning.rollout.nccl_transport import NCCLTransport
from rlvr_lightning.rollout.snapshot_transport import SnapshotTransport


class WeightTransport(Protocol):
    """What the server engine asks of a transport. It is built from the engine (`transport(engine)`), whose
    `version` is the one being synced, whose `client` posts to the replicas and whose `spec` they run."""

    name: ClassVar[str]  # as `rollout.sync.weight_transfer` names it, and the sync's errors
    server_args: ClassVar[list[str]]  # what every server must be started with for it

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], replicas) -> None:
        """All the weights, read once in order, to every replica (generation is paused meanwhile)."""

    def restore(self, replica) -> None:
        """A restarted replica (back at the base checkpoint): the current weights and version, or an error
        saying why this transport cannot give them."""

    def close(self) -> None: ...


TRANSPORTS: dict[str, type[WeightTransport]] = {t.name: t for t in (SnapshotTransport, NCCLTransport)}


def resolve(kind: str) -> str:
    if kind == "auto":
        return "nccl" if torch.cuda.is_available() else "snapshot"
    if kind not in TRANSPORTS:
        raise ValueError(f"rollout.sync.weight_transfer={kind!r}; valid: auto, snapshot, nccl")
    return kind


def server_args(kind: str) -> list[str]:
    """What every server must be started with for this transport."""
    return TRANSPORTS[resolve(kind)].server_args


def make_transport(kind: str, engine) -> WeightTransport:
    return TRANSPORTS[resolve(kind)](engine)
