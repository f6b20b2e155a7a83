"""How the trainer's weights reach `vllm serve` replicas (`rollout.weight_transfer`).

- `snapshot` (CPU, and any machine sharing a filesystem with the servers): the weights written as
  safetensors shards to a fresh directory in shared memory (`/dev/shm`), then loaded by every replica
  with vLLM's own `reload_weights(weights_path=…)` through its `/collective_rpc` route. vLLM 0.32 ships no
  weight-transfer backend that runs on CPU (NCCL, CUDA IPC and the others need GPUs), hence this one.
- `nccl` (GPU): vLLM's native NCCL weight-transfer engine, set up as its RL documentation shows
  (`WeightTransferTrainerFactory` + `NCCLTrainerInitInfo` + `HTTPVLLMWeightSyncClient`), one NCCL group per
  replica. UNTESTED: the GPU machines available to this project have no vLLM. Kept small on purpose.
`auto` picks `nccl` when CUDA is available and `snapshot` otherwise.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from rlvr_lightning.rollout.loopback import free_port

SHARD_BYTES = 2 << 30  # a shard is written (and its tensors freed) once it holds this much


class SnapshotTransport:
    def __init__(self, engine) -> None:
        self.engine = engine
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None  # memory, not disk, where there is one
        self.root = Path(tempfile.mkdtemp(prefix="rlvr-weights-", dir=base))
        self.current: Path | None = None

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], replicas: list) -> None:
        path = self.write(named_tensors, self.engine.version)
        for r in replicas:
            self.load(r, path)
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

    def load(self, replica, path: Path) -> None:
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(path), "is_checkpoint_format": True},
                "timeout": self.engine.request_timeout_s}  # fmt: skip
        self.engine.post(replica.url, "/collective_rpc", json=body)

    def restore(self, replica) -> None:
        """A restarted replica starts from the base checkpoint: give it the current weights and version."""
        if self.current is not None:
            self.load(replica, self.current)
        self.engine.post(replica.url, "/update_weight_version", json={"new_version": str(self.engine.version)})

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


class NCCLTransport:  # pragma: no cover - needs CUDA and vLLM on the same machine (untested here)
    """vLLM's NCCL weight transfer, one group per replica (each `vllm serve` numbers its workers from
    rank 1, so replicas cannot share a group); the servers need `--weight-transfer-config
    '{"backend": "nccl"}'` (added by `extra_server_args`)."""

    extra_server_args = ["--weight-transfer-config", '{"backend": "nccl"}']

    def __init__(self, engine) -> None:
        self.engine, self.senders, self.tensors = engine, {}, []
        self.source = _tensor_source(self.tensors)

    def _sender(self, replica):
        if replica.url not in self.senders:
            from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            world = self.engine.session.get(f"{replica.url}/get_world_size", timeout=30).json()["world_size"]
            local = any(h in replica.url for h in ("127.0.0.1", "localhost"))
            address = "127.0.0.1" if local else socket.gethostbyname(socket.getfqdn())  # where the server reaches us
            info = NCCLTrainerInitInfo(master_address=address, master_port=free_port(), world_size=1 + world,
                                       rank=0, packed=True)  # fmt: skip
            self.senders[replica.url] = WeightTransferTrainerFactory.trainer_init(
                info, client=HTTPVLLMWeightSyncClient(replica.url), source=self.source
            )
        return self.senders[replica.url]

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], replicas: list) -> None:
        # NCCL broadcasts from device memory; one pass per replica over the (gathered) weights.
        self.tensors[:] = [(n, t.detach().cuda()) for n, t in named_tensors]
        try:
            for r in replicas:
                self._sender(r).send_weights()
        finally:
            self.tensors.clear()

    def restore(self, replica) -> None:
        self.senders.pop(replica.url, None)
        raise RuntimeError("a restarted replica cannot get the current weights over NCCL mid-step; resume the run")

    def close(self) -> None:
        self.senders.clear()


def _tensor_source(tensors: list[tuple[str, torch.Tensor]]):  # pragma: no cover - see NCCLTransport
    """vLLM's `WeightSource` over `tensors`, a list the transport refills before every sync."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class TensorSource(WeightSource):
        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            return iter(list(tensors))

    return TensorSource()


def resolve(kind: str) -> str:
    if kind == "auto":
        return "nccl" if torch.cuda.is_available() else "snapshot"
    if kind not in ("snapshot", "nccl"):
        raise ValueError(f"rollout.weight_transfer={kind!r}; valid: auto, snapshot, nccl")
    return kind


def server_args(kind: str) -> list[str]:
    """What every server must be started with for this transport."""
    return NCCLTransport.extra_server_args if resolve(kind) == "nccl" else []


def make_transport(kind: str, engine):
    kind = resolve(kind)
    if kind == "snapshot":
        return SnapshotTransport(engine)
    return NCCLTransport(engine)
