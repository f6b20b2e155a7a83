"""A LoRA policy synced as an adapter to a launched `vllm serve` replica: `--enable-lora`, vLLM's runtime
adapter route, and every request naming the current adapter."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from rlvr_lightning.models.forward import sequence_logprobs
from rlvr_lightning.models.lora import LoraSettings
from rlvr_lightning.models.weights import load_into_engine
from rlvr_lightning.rollout.server_process import ServerSpec
from rlvr_lightning.rollout.sync import FP32_SYNC_TOL
from rlvr_lightning.rollout.types import SamplingConfig
from rlvr_lightning.rollout.vllm_server import VLLMServerEngine
from tests.models.test_lora import COMPLETION, PROMPT, trained_lora_policy

pytestmark = pytest.mark.e2e


def test_adapter_sync_to_a_server_serves_each_new_adapter_by_name(tiny_policy_dir):
    settings = LoraSettings(rank=4, sync="adapter")
    spec = ServerSpec(str(tiny_policy_dir), max_model_len=128, dtype="float32", lora_max_rank=settings.engine_max_rank)
    servers = VLLMServerEngine(spec, replicas=1)
    try:
        base = servers.logprobs(PROMPT, COMPLETION)
        for version, seed in ((1, 0), (2, 1)):  # a second adapter replaces the first, under a new name
            policy, _ = trained_lora_policy(tiny_policy_dir, settings, seed=seed)
            load_into_engine(servers, policy, version, settings, str(tiny_policy_dir))
            assert servers.adapter == f"policy-v{version}" and servers.replicas.weight_versions() == [str(version)]
            trainer = sequence_logprobs(policy, PROMPT, COMPLETION)
            served = servers.logprobs(PROMPT, COMPLETION)
            assert max(abs(a - b) for a, b in zip(served, trainer)) < FP32_SYNC_TOL
            assert max(abs(a - b) for a, b in zip(served, base)) > 100 * FP32_SYNC_TOL  # the adapter is applied
            (group,) = servers.generate([PROMPT], SamplingConfig(group_size=3, max_tokens=8, seed=version))
            for c in group:  # samples come from the adapter too, and carry the synced version
                lp = sequence_logprobs(policy, PROMPT, c.token_ids)
                assert max(abs(a - b) for a, b in zip(c.logprobs, lp)) < 1e-3
        listed = servers.client.session.get(f"{servers.replicas[0].url}/v1/models", timeout=30).json()["data"]
        assert "policy-v1" not in {m["id"] for m in listed}  # the previous adapter was unloaded
        assert len(list(servers.adapters.root.iterdir())) == 1  # and its directory removed
        # The replica dies: it restarts from the base checkpoint, which an adapter sync never changed, and gets
        # the current adapter back without the weight transport (NCCL's cannot restore a replica mid-step).
        def no_transport(replica):
            raise RuntimeError("an adapter sync's recovery used the weight transport")

        servers.transport.restore = no_transport
        victim = servers.replicas[0].process
        os.killpg(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait()
        (group,) = servers.generate([PROMPT], SamplingConfig(group_size=2, max_tokens=8, seed=3))
        assert len(group) == 2 and victim.alive() and servers.replicas.weight_versions() == ["2"]
        assert max(abs(a - b) for a, b in zip(servers.logprobs(PROMPT, COMPLETION), trainer)) < FP32_SYNC_TOL
        # A run resumed at version 2 on the same (now attached) server: vLLM refuses a name it still holds, so
        # the new engine unloads what the last run left, and unloads its own adapter when it closes.
        url = servers.replicas[0].url
        resumed = VLLMServerEngine(spec, urls=[url])
        try:
            load_into_engine(resumed, policy, 2, settings, str(tiny_policy_dir))
            assert max(abs(a - b) for a, b in zip(resumed.logprobs(PROMPT, COMPLETION), trainer)) < FP32_SYNC_TOL
        finally:
            resumed.close()
        listed = servers.client.session.get(f"{url}/v1/models", timeout=30).json()["data"]
        assert not [m["id"] for m in listed if m["id"].startswith("policy-")]
    finally:
        servers.close()
    assert not servers.adapters.root.exists()


def test_a_server_launched_without_lora_refuses_an_adapter(tiny_policy_dir):
    class NoServers(VLLMServerEngine):  # the refusal comes before any request: no server needed
        def __init__(self):
            self.adapters = None

    with pytest.raises(RuntimeError, match="without LoRA"):
        NoServers().load_adapter(iter([("x", torch.zeros(1))]), {}, version=1)
