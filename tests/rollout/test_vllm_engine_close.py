"""An in-process vLLM engine, once closed, leaves the process as it found it."""

from __future__ import annotations

import torch.distributed as dist


def test_a_closed_engine_leaves_no_process_group_and_vllm_reads_its_environment_again(tiny_policy_dir, monkeypatch):
    """vLLM makes a one-rank process group for its workers in a process without one, and freezes every VLLM_*
    variable once it has started. After `close`, `make plan`'s fake ranks can start in this process (the planner
    refuses a process with a group), and a VLLM_* variable set afterwards is the one vLLM reads."""
    import vllm.envs

    from rlvr_lightning.planner.fake_world import fake_world
    from rlvr_lightning.rollout.vllm_engine import VLLMEngine

    assert not dist.is_initialized(), "an earlier test of this process left a process group behind"
    engine = VLLMEngine(str(tiny_policy_dir), max_model_len=64, dtype="float32")
    assert dist.is_initialized() and engine.owns_process_group  # what this test is about happened
    engine.close()
    assert not dist.is_initialized()
    with fake_world(2) as mesh:
        assert mesh.size() == 2
    monkeypatch.setenv("VLLM_HOST_IP", "203.0.113.5")
    assert vllm.envs.VLLM_HOST_IP == "203.0.113.5"
