"""The NCCL weight transport's parts that run on CPU: the trainer's address for the rendezvous, the
weights cast to the servers' dtype and streamed in bounded buckets, the order of vLLM's weight-update
routes and the broadcasts, the bounded rendezvous (with vLLM's real rendezvous store), and the routes'
request timeout. The NCCL group itself needs GPUs and is not run here."""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
import types
import weakref

import pytest
import torch

from rlvr_lightning.rollout.engine import WeightSyncError
from rlvr_lightning.rollout.loopback import free_port
from rlvr_lightning.rollout.nccl_transport import (
    NCCLTransport,
    ReplicaLink,
    rendezvous,
    stream_weights,
    trainer_address,
    update_info,
    wire_buckets,
)
from rlvr_lightning.rollout.server_client import ServerClient
from rlvr_lightning.rollout.server_process import RolloutServerError, ServerSpec


# ---- the trainer's address ------------------------------------------------------------------------
def routable_addresses() -> set[str]:
    """This machine's non-loopback IPv4 addresses."""
    import psutil

    return {
        a.address
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback
    }


def has_route_to(host: str) -> bool:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 80))
        return True
    except OSError:
        return False


@pytest.fixture
def no_vllm_host_ip(monkeypatch):
    monkeypatch.delenv("VLLM_HOST_IP", raising=False)


def test_a_replica_elsewhere_reaches_the_trainer_at_a_routable_address(no_vllm_host_ip):
    """Not 127.0.1.1 or 127.0.0.1, which `gethostbyname(getfqdn())` gives on Debian/Ubuntu (and here)."""
    mine = routable_addresses()
    if not mine:
        pytest.skip("this machine has no routable IPv4 address")
    for address in sorted(mine):  # a replica reached at one of this machine's own routable addresses
        assert trainer_address(f"http://{address}:8000") == address
    remote = "198.51.100.7"  # TEST-NET-2: routed (a UDP socket's connect sends nothing), never contacted
    if not has_route_to(remote):
        pytest.skip("this machine has no route beyond its own networks")
    assert trainer_address(f"http://{remote}:8000/") in mine


def test_a_replica_on_loopback_reaches_the_trainer_on_loopback(no_vllm_host_ip):
    assert trainer_address("http://127.0.0.1:8000") == "127.0.0.1"
    assert trainer_address("http://localhost:8000") == "127.0.0.1"


def test_a_configured_address_wins_then_vllm_host_ip(monkeypatch):
    assert trainer_address("http://198.51.100.7:8000", configured="203.0.113.9") == "203.0.113.9"
    monkeypatch.setenv("VLLM_HOST_IP", "203.0.113.5")  # vLLM's own setting, through vLLM's get_ip
    assert trainer_address("http://127.0.0.1:8000") == "203.0.113.5"
    assert trainer_address("http://127.0.0.1:8000", configured="203.0.113.9") == "203.0.113.9"


# ---- the weights on the wire ----------------------------------------------------------------------
def test_wire_buckets_cast_floats_to_the_servers_dtype_in_order_and_bounded_buckets():
    transposed = torch.randn(4, 2).t()  # not contiguous: NCCL sends numel elements from data_ptr()
    weights = [("a", torch.randn(4, 8)), ("b", transposed), ("ids", torch.arange(6)), ("c", torch.randn(16, 8)),
               ("d", torch.randn(2))]  # fmt: skip
    got = [list(bucket) for bucket in wire_buckets(iter(weights), torch.bfloat16, "cpu", bucket_bytes=128)]
    # bf16 sizes: a 64 B, b 16 B, ids 48 B (int64, not cast), c 256 B (a bucket of its own), d 4 B.
    assert [[name for name, _ in bucket] for bucket in got] == [["a", "b", "ids"], ["c"], ["d"]]
    sent = dict(pair for bucket in got for pair in bucket)
    for name, tensor in weights:
        expected = tensor if name == "ids" else tensor.to(torch.bfloat16)
        assert sent[name].dtype == expected.dtype and sent[name].is_contiguous()
        assert torch.equal(sent[name], expected)


def test_wire_buckets_in_the_trainers_dtype_copy_nothing():
    weights = [("a", torch.randn(3)), ("b", torch.randn(5))]
    (bucket,) = wire_buckets(iter(weights), None, "cpu")
    assert all(sent.data_ptr() == original.data_ptr() for (_, sent), (_, original) in zip(bucket, weights))


def test_at_most_one_bucket_and_one_input_tensor_exist_at_a_time():
    """While the next tensor is read (gathered, under FSDP), the previous bucket's wire copies and the
    previous input tensor are gone, even though the caller's loop variable still names the bucket."""
    delivered, inputs, alive_when_read = [], [], []

    def source():
        for i in range(10):
            alive_when_read.append((sum(r() is not None for r in delivered), sum(r() is not None for r in inputs)))
            tensor = torch.full((16,), float(i))  # 64 B in fp32, 32 B in bf16: 3 to a 96-byte bucket
            inputs.append(weakref.ref(tensor))
            yield f"w{i}", tensor
            del tensor

    for bucket in wire_buckets(source(), torch.bfloat16, "cpu", bucket_bytes=96):
        delivered.extend(weakref.ref(t) for _, t in bucket)
    assert len(delivered) == 10 and alive_when_read == [(0, 0)] * 10


def test_the_bucket_metadata_is_what_vllms_nccl_receiver_parses():
    import json

    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

    bucket = [("w", torch.zeros(2, 3, dtype=torch.bfloat16)), ("ids", torch.zeros(4, dtype=torch.int64))]
    parsed = NCCLWeightTransferUpdateInfo(**json.loads(json.dumps(update_info(bucket))))  # as over HTTP
    # The receiver allocates getattr(torch, dtype_name) of each shape (NCCLWeightTransferEngine.receive_weights).
    received = [(n, getattr(torch, d), tuple(s)) for n, d, s in zip(parsed.names, parsed.dtype_names, parsed.shapes)]
    assert received == [("w", torch.bfloat16, (2, 3)), ("ids", torch.int64, (4,))]


def test_the_nccl_transport_sends_in_the_servers_dtype(tmp_path):
    engine = types.SimpleNamespace(spec=ServerSpec(str(tmp_path), max_model_len=64, dtype="bfloat16"))
    assert NCCLTransport(engine).dtype == torch.bfloat16
    engine.spec.dtype = "auto"  # the checkpoint's, which the trainer does not know: sent as it is
    assert NCCLTransport(engine).dtype is None


class RecordingLink:
    """Stands in for one replica's weight-update routes and NCCL group (no NCCL or vLLM here): records
    what the transport does, and like vLLM's receiver, answers `update_weights` only once every tensor it
    announced has been broadcast (a transport waiting for the answer first would deadlock)."""

    def __init__(self, delivered: list) -> None:
        self.events, self.delivered = [], delivered
        self.announced, self.received = [], threading.Semaphore(0)

    def start_weight_update(self) -> None:
        self.events.append("start")

    def update_weights(self, info: dict) -> None:
        self.announced.append(info)
        for _ in info["names"]:
            if not self.received.acquire(timeout=10):
                raise TimeoutError("the tensors announced were never broadcast")

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.events.append(("broadcast", tensor.dtype, tensor.sum().item()))
        self.delivered.append(weakref.ref(tensor))
        self.received.release()

    def finish_weight_update(self) -> None:
        self.events.append("finish")


def test_one_pass_streams_every_bucket_to_every_replica_between_one_start_and_one_finish():
    delivered, alive_when_read = [], []

    def source():
        for i in range(5):
            alive_when_read.append(sum(r() is not None for r in delivered))
            yield f"w{i}", torch.full((16,), float(i))  # 32 B in bf16: 2 to a 64-byte bucket

    links = [RecordingLink(delivered), RecordingLink(delivered)]
    stream_weights(source(), links, torch.bfloat16, "cpu", bucket_bytes=64)
    for link in links:
        assert [info["names"] for info in link.announced] == [["w0", "w1"], ["w2", "w3"], ["w4"]]
        assert all(info["dtype_names"] == ["bfloat16"] * len(info["names"]) for info in link.announced)
        sums = [16.0 * i for i in range(5)]
        assert link.events == ["start", *(("broadcast", torch.bfloat16, s) for s in sums), "finish"]
    # The source was read once, and no copy of an earlier bucket was left while the next was read.
    assert len(alive_when_read) == 5 and max(alive_when_read) == 0


# ---- the rendezvous, bounded ----------------------------------------------------------------------
def trainer_end(port: int, rank: int = 0):
    """vLLM's rendezvous store, as its NCCL trainer_init opens it before creating the NCCL group."""
    from vllm.distributed.utils import StatelessProcessGroup

    return lambda: StatelessProcessGroup.create(host="127.0.0.1", port=port, rank=rank, world_size=2)


def test_a_rendezvous_no_replica_joins_is_an_error_naming_the_address_and_port():
    port, never = free_port(), threading.Event()
    start = time.monotonic()
    try:
        with pytest.raises(WeightSyncError, match=rf"at 127\.0\.0\.1:{port} did not complete within 1 s"):
            rendezvous(trainer_end(port), never.wait, 1.0, f"replica http://r:1 and this trainer at 127.0.0.1:{port}")
    finally:
        never.set()
    assert time.monotonic() - start < 15


def test_a_replica_that_refuses_the_rendezvous_fails_it_at_once():
    def refuse():
        raise RolloutServerError("rollout server http://r:1: /init_weight_transfer_engine answered 400: no engine")

    start = time.monotonic()
    with pytest.raises(RolloutServerError, match="/init_weight_transfer_engine answered 400"):
        rendezvous(trainer_end(free_port()), refuse, 60.0, "replica http://r:1")
    assert time.monotonic() - start < 15  # not after the 60 s bound


def test_a_rendezvous_both_ends_join_returns_the_trainers_end():
    port = free_port()
    group = rendezvous(trainer_end(port), trainer_end(port, rank=1), 60.0, "replica http://r:1")
    assert (group.rank, group.world_size) == (0, 2)


# ---- the routes' requests -----------------------------------------------------------------------
def test_the_nccl_routes_take_the_engines_request_timeout(slow_server):
    """`update_weights` and the other routes go through the engine's HTTP client, with
    `rollout.servers.request_timeout_s`, not a fixed client timeout."""
    link = ReplicaLink(ServerClient(request_timeout_s=0.5), slow_server)
    with pytest.raises(RolloutServerError, match=rf"{slow_server}: /update_weights got no answer within 0.5 s"):
        link.update_weights({"names": [], "dtype_names": [], "shapes": []})
    with pytest.raises(RolloutServerError, match=rf"{slow_server}: /start_weight_update got no answer"):
        link.start_weight_update()
