"""The `nccl` weight transport (`rollout.sync.weight_transfer: nccl`; GPU): vLLM's NCCL weight-transfer engine on the
servers (`--weight-transfer-config '{"backend": "nccl"}'`), one NCCL group per replica with the trainer as rank 0,
joined through vLLM's `/init_weight_transfer_engine` route and vLLM's own rendezvous (`nccl_common`). A sync is
one pass over the weights for all replicas: one `/start_weight_update`, then bucket after bucket its names,
dtypes and shapes (`/update_weights`) and its tensors, broadcast one by one, then one `/finish_weight_update`.
Each tensor is cast to the servers' dtype (`rollout.dtype`) and copied to the GPU as it comes, and at most one
bucket (`BUCKET_BYTES`) of these copies exists at a time. The trainer's address for the rendezvous is
`rollout.sync.weight_transfer_host`, else `VLLM_HOST_IP`, else the local address of the route to the replica
(`trainer_address`); a rendezvous that does not complete within `rollout.sync.weight_transfer_timeout_s` is an error
naming that address and port.
Tested on CPU: the address choice, the bucketing and casting, the order of the routes and broadcasts (with
stand-ins for the communicator and the HTTP routes), the rendezvous bound (with vLLM's real rendezvous store and
no replica joining). NOT RUN: the NCCL group, the broadcasts and vLLM's receiving end, which need GPUs; no GPU
machine with vLLM has been available to this project.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from urllib.parse import urlsplit

import torch

from rlvr_lightning.rollout.engine import WeightSyncError, wire_dtype
from rlvr_lightning.rollout.loopback import free_port

BUCKET_BYTES = 1 << 30  # the wire copies held at once (vLLM's packed-transfer buffer size)


class NCCLTransport:
    """A `WeightTransport` (weight_transfer.py) by vLLM's NCCL weight transfer, one group per replica (each
    `vllm serve` numbers its workers from rank 1, so replicas cannot share a group); the servers need
    `--weight-transfer-config '{"backend": "nccl"}'` (`server_args`). `send` needs CUDA and has not run (see
    the module docstring)."""

    name = "nccl"
    server_args = ["--weight-transfer-config", '{"backend": "nccl"}']

    def __init__(self, engine) -> None:
        self.engine, self.links = engine, {}
        self.dtype = wire_dtype(engine.spec.dtype)

    def _link(self, replica) -> ReplicaLink:
        if replica.url not in self.links:
            self.links[replica.url] = ReplicaLink.connect(self.engine, replica.url)
        return self.links[replica.url]

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], replicas) -> None:
        links = [self._link(r) for r in replicas]  # every rendezvous before the first tensor is gathered
        stream_weights(named_tensors, links, self.dtype, torch.device("cuda", torch.cuda.current_device()))

    def restore(self, replica) -> None:
        self.links.pop(replica.url, None)
        raise RuntimeError("a restarted replica cannot get the current weights over NCCL mid-step; resume the run")

    def close(self) -> None:
        self.links.clear()


class ReplicaLink:
    """One replica's end of the NCCL transfer: vLLM's weight-update routes on that server, through the
    engine's HTTP client (`ServerClient`: its timeout, `rollout.servers.request_timeout_s`, and its errors,
    which name the replica and the route), and the NCCL group in which this trainer is rank 0."""

    def __init__(self, client, url: str, group=None) -> None:
        self.client, self.url, self.group = client, url, group

    @classmethod
    def connect(cls, engine, url: str) -> ReplicaLink:  # pragma: no cover - needs CUDA (not run here)
        from vllm.distributed.weight_transfer.nccl_common import (
            NCCLWeightTransferInitInfo,
            trainer_init,
            worker_init_payload,
        )

        link = cls(engine.client, url)
        world = engine.client.session.get(f"{url}/get_world_size", timeout=30).json()["world_size"]  # every DP rank
        address = trainer_address(url, engine.transfer_host)
        port = free_port(address)
        # Unpacked: the workers receive and load one tensor at a time, in the order they are sent.
        info = NCCLWeightTransferInitInfo(
            master_address=address, master_port=port, rank_offset=1, world_size=1 + world, packed=False
        )
        device = torch.cuda.current_device()

        def open_trainer_end():
            # Runs in a thread of its own, whose current CUDA device would be 0: the group must live on
            # this rank's device, where the tensors it broadcasts are.
            torch.cuda.set_device(device)
            return trainer_init(info)

        link.group = rendezvous(
            open_trainer_end,
            lambda: link.post("/init_weight_transfer_engine", {"init_info": worker_init_payload(info)}),
            engine.transfer_timeout_s,
            f"replica {url} and this trainer at {address}:{port}",
        )
        return link

    def post(self, route: str, body: dict | None = None) -> None:
        self.client.post(self.url, route, json=body)

    def start_weight_update(self) -> None:
        self.post("/start_weight_update")

    def update_weights(self, info: dict) -> None:
        """Answered once the replica's workers have received and loaded what `info` announces."""
        self.post("/update_weights", {"update_info": info})

    def finish_weight_update(self) -> None:
        self.post("/finish_weight_update")

    def broadcast(self, tensor: torch.Tensor) -> None:  # pragma: no cover - needs CUDA (not run here)
        self.group.broadcast(tensor, src=0, stream=torch.cuda.current_stream())


def wire_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype | None,
    device: torch.device | str,
    bucket_bytes: int = BUCKET_BYTES,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The weights as they go over the wire: each floating-point tensor cast to `dtype` (None: kept; other
    tensors keep theirs) and copied to `device` contiguous, one at a time, in buckets of at most
    `bucket_bytes` (a larger tensor is a bucket of its own). The list yielded is emptied when the next
    bucket is asked for, so at most one bucket's copies exist at a time (unless the caller keeps its own
    references), and the input is read once, in order: under FSDP each tensor is gathered as it comes."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        nbytes = tensor.numel() * target.itemsize
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket.clear()
            size = 0
        bucket.append((name, tensor.detach().to(device=device, dtype=target).contiguous()))
        size += nbytes
        del tensor  # a gathered full tensor goes before the next one is gathered
    if bucket:
        yield bucket


def update_info(bucket: list[tuple[str, torch.Tensor]]) -> dict:
    """vLLM's NCCL `update_weights` payload for one bucket: what its workers are to receive, in order."""
    return {
        "names": [name for name, _ in bucket],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
    }


def stream_weights(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    links: list,
    dtype: torch.dtype | None,
    device: torch.device | str,
    bucket_bytes: int = BUCKET_BYTES,
) -> None:
    """One weight sync over NCCL to every replica in `links` (`ReplicaLink`s), in one pass over the
    weights: one `start_weight_update` each, then for every bucket its metadata (`update_weights`, which
    returns once the workers have received it) and its tensors, broadcast one by one, then one
    `finish_weight_update` each. vLLM's own trainer engine announces every name and shape up front and
    reads its weights once per replica; the trainer's weights are a one-pass stream, gathered under FSDP
    as they come, so each bucket announces itself."""
    for link in links:
        link.start_weight_update()
    for bucket in wire_buckets(named_tensors, dtype, device, bucket_bytes):
        _send_bucket(bucket, links)  # a function of its own: no local of it outlives the bucket
    for link in links:
        link.finish_weight_update()


def _send_bucket(bucket: list[tuple[str, torch.Tensor]], links: list) -> None:
    info = update_info(bucket)
    # The workers wait inside `update_weights` for the broadcasts: the requests run while we send.
    answers = [in_thread(link.update_weights, info) for link in links]
    for link in links:
        for _, tensor in bucket:
            link.broadcast(tensor)
    for answer in answers:
        answer.result()  # bounded by the request timeout; a worker's error surfaces here


def in_thread(fn: Callable, *args) -> Future:
    """`fn(*args)` in a daemon thread: one stuck in a rendezvous or a collective that never completes
    does not keep the process from exiting (a thread pool's threads are joined at exit)."""
    future: Future = Future()

    def run() -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # handed to whoever waits on the future
                future.set_exception(e)

    threading.Thread(target=run, daemon=True, name=f"weight-transfer-{getattr(fn, '__name__', 'call')}").start()
    return future


def rendezvous(open_trainer_end: Callable, join_replica: Callable, timeout_s: float, where: str):
    """Both ends of an NCCL group at once, the trainer's (`open_trainer_end`, whose result is returned) and
    the replica's (`join_replica`, a request the server answers once its workers have joined), bounded: if
    they have not met within `timeout_s` it is an error naming `where`, not a hang. Either side's error
    ends the wait at once."""
    trainer_end, replica_end = in_thread(open_trainer_end), in_thread(join_replica)
    done, pending = wait((trainer_end, replica_end), timeout=timeout_s, return_when=FIRST_EXCEPTION)
    for future in (replica_end, trainer_end):  # the server's answer says more than a store's timeout
        if future in done and future.exception() is not None:
            raise future.exception()
    if pending:
        raise WeightSyncError(
            f"the NCCL rendezvous of {where} did not complete within {timeout_s:g} s "
            "(rollout.sync.weight_transfer_timeout_s): the replica's workers must reach that address and port; "
            "set rollout.sync.weight_transfer_host to an address of this machine they can reach"
        )
    return trainer_end.result()


def trainer_address(replica_url: str, configured: str | None = None) -> str:
    """The address of this machine at which a replica's workers reach the trainer for the NCCL
    rendezvous: `configured` (`rollout.sync.weight_transfer_host`) if given, else `VLLM_HOST_IP` if set
    (through vLLM's `get_ip`), else the local address of this machine's route to the replica's host
    (loopback for a replica on loopback, the interface facing it otherwise), found as vLLM's `get_ip`
    finds the outgoing interface: a UDP socket's `connect` sends nothing. Not the address of this
    machine's name (`gethostbyname(getfqdn())`), which is 127.0.1.1 on Debian and Ubuntu. IPv4 only:
    vLLM's rendezvous store listens on an IPv4 socket."""
    from vllm.utils.network_utils import get_ip

    if configured:
        return configured
    if os.environ.get("VLLM_HOST_IP"):
        return get_ip()
    try:
        sockaddr = socket.getaddrinfo(urlsplit(replica_url).hostname, 80, socket.AF_INET, socket.SOCK_DGRAM)[0][4]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            return s.getsockname()[0]
    except OSError:  # no IPv4 address or no route to the host: vLLM's choice, the default route's interface
        address = get_ip()
    if address == "0.0.0.0":
        raise WeightSyncError(
            f"no address of this machine found for the NCCL rendezvous with {replica_url}: "
            "set rollout.sync.weight_transfer_host"
        )
    return address
