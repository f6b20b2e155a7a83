"""The `snapshot` weight transport (`rollout.sync.weight_transfer: snapshot`; CPU, and any machine sharing a
filesystem with the servers): the weights written as safetensors shards to a fresh directory in shared memory
(`/dev/shm`), then loaded by every replica with vLLM's own `reload_weights(weights_path=…)` through its
`/collective_rpc` route. vLLM 0.32 ships no weight-transfer backend that runs on CPU (NCCL, CUDA IPC and the
others need GPUs), hence this one. Tested end to end on CPU (tests/rollout/test_vllm_server.py).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import ClassVar

import torch

SHARD_BYTES = 2 << 30  # a shard is written (and its tensors freed) once it holds this much


class SnapshotTransport:
    """A `WeightTransport` (weight_transfer.py) through shared memory and vLLM's `reload_weights`."""

    name = "snapshot"
    server_args: ClassVar[list[str]] = []  # vLLM's own `reload_weights` needs no flag

    def __init__(self, engine) -> None:
        self.engine = engine
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None  # memory, not disk, where there is one
        self.root = Path(tempfile.mkdtemp(prefix="rlvr-weights-", dir=base))
        self.current: Path | None = None

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], replicas) -> None:
        path = self.write(named_tensors, self.engine.version)
        for r in replicas:  # a replica that dies meanwhile is restarted (from `current`) and loads `path` again
            self.load(r, path, recover=True)
        if self.current is not None and self.current != path:
            shutil.rmtree(self.current, ignore_errors=True)
        self.current = path  # kept: a restarted replica loads it

    def write(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> Path:
        """The weights as safetensors shards in a new directory, renamed into place when complete (vLLM
        loads every `*.safetensors` it finds there)."""
        from safetensors.torch import save_file

        final = self.root / f"v{version}"
        partial = self.root / f".v{version}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        shard, size, count, seen = {}, 0, 0, set()
        for name, tensor in named_tensors:
            tensor = tensor.detach().to("cpu").contiguous()
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
            # A tied weight (lm_head = embed_tokens) is written under both names: vLLM's in-place reload
            # leaves a layer it gets no weights for unusable, tied or not. safetensors refuses shared
            # storage, hence the copy.
            shard[name] = tensor.clone() if key in seen else tensor
            seen.add(key)
            size += tensor.numel() * tensor.element_size()
            if size >= SHARD_BYTES:
                save_file(shard, partial / f"model-{count:05d}.safetensors")
                shard, size, count = {}, 0, count + 1
        if shard:
            save_file(shard, partial / f"model-{count:05d}.safetensors")
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        return final

    def load(self, replica, path: Path, recover: bool = False) -> None:
        client = self.engine.client
        body = {
            "method": "reload_weights",
            "kwargs": {"weights_path": str(path), "is_checkpoint_format": True},
            "timeout": client.route_timeout_s,
        }
        if recover:
            self.engine.replicas.request(replica, "/collective_rpc", json=body)
        else:  # restoring a restarted replica: a failure is an error
            client.post(replica.url, "/collective_rpc", json=body)

    def restore(self, replica) -> None:
        """A restarted replica starts from the base checkpoint: give it the current weights and version."""
        if self.current is not None:
            self.load(replica, self.current)
        self.engine.client.post(replica.url, "/update_weight_version", json={"new_version": str(self.engine.version)})

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
