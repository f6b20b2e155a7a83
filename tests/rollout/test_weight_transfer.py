"""The choice of weight transport (`rollout.sync.weight_transfer`), and the transfer settings on their way to the
server engine."""

from __future__ import annotations

import pytest
import torch

from rlvr_lightning.errors import ConfigError
from rlvr_lightning.rollout.nccl_transport import NCCLTransport
from rlvr_lightning.rollout.settings import EngineSite, RolloutSettings
from rlvr_lightning.rollout.snapshot_transport import SnapshotTransport
from rlvr_lightning.rollout.weight_transfer import TRANSPORTS, resolve, server_args


def test_each_transport_is_chosen_by_its_name_and_auto_by_cuda():
    assert TRANSPORTS == {"snapshot": SnapshotTransport, "nccl": NCCLTransport}
    assert resolve("auto") == ("nccl" if torch.cuda.is_available() else "snapshot")
    assert server_args("nccl") == ["--weight-transfer-config", '{"backend": "nccl"}'] and server_args("snapshot") == []
    with pytest.raises(ValueError, match="rollout.sync.weight_transfer='ipc'; valid: auto, snapshot, nccl"):
        resolve("ipc")


def test_the_timeouts_and_the_address_settings_reach_the_server_engine(monkeypatch):
    import rlvr_lightning.rollout.vllm_server as vllm_server

    built = {}
    monkeypatch.setattr(vllm_server, "VLLMServerEngine", lambda spec, **kwargs: built.update(kwargs))
    settings = RolloutSettings(engine="vllm-server", servers={"request_timeout_s": 42.0},
                               sync={"weight_transfer": "nccl", "weight_transfer_host": "10.0.0.5",
                                     "weight_transfer_timeout_s": 7.0})  # fmt: skip
    settings.build_engine(EngineSite("policy", max_model_len=64, seed=0))
    assert (built["request_timeout_s"], built["transfer_host"], built["transfer_timeout_s"]) == (42.0, "10.0.0.5", 7.0)
    assert built["transport"] == "nccl"
    for bad in ({"servers": {"request_timeout_s": 0}}, {"sync": {"weight_transfer_timeout_s": -1}}):
        with pytest.raises(ConfigError, match="must be > 0 seconds"):
            RolloutSettings(engine="vllm-server", **bad)
