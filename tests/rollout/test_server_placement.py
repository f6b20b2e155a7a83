"""Where launched rollout servers run: every replica of every trainer rank on a machine gets cores (CPU)
or a GPU of its own."""

from __future__ import annotations

import pytest

from rlvr_lightning.rollout.server_process import RolloutServerError, placement

CPU_ONLY = {"cuda_available": False}  # the machine described, whatever machine runs the test


def test_replicas_of_one_rank_split_the_cores():
    assert placement(2, cores=[0, 1, 2, 3, 4], **CPU_ONLY) == [("0,1", None), ("2,3", None)]


def test_ranks_on_one_machine_do_not_share_cores():
    cores = list(range(8))
    rank0, rank1 = placement(2, 0, 2, cores=cores, **CPU_ONLY), placement(2, 1, 2, cores=cores, **CPU_ONLY)
    assert [b for b, _ in rank0 + rank1] == ["0,1", "2,3", "4,5", "6,7"]


def test_fewer_cores_than_replicas_leaves_binding_to_vllm():
    assert placement(2, 1, 2, cores=[0, 1, 2], **CPU_ONLY) == [(None, None), (None, None)]


def test_a_gpu_machine_without_listed_devices_shares_the_trainers_gpu(caplog):
    with caplog.at_level("WARNING"):
        assert placement(2, 0, 1, cores=list(range(8)), cuda_available=True) == [(None, None), (None, None)]
    assert "share the trainer's GPU" in caplog.text


def test_cuda_devices_are_taken_rank_after_rank():
    devices = ["2", "3", "4", "5"]
    assert placement(2, 0, 2, devices) == [(None, "2"), (None, "3")]
    assert placement(2, 1, 2, devices) == [(None, "4"), (None, "5")]


def test_too_few_cuda_devices_for_every_rank_is_a_clear_error():
    with pytest.raises(RolloutServerError, match=r"2 trainer rank\(s\) on this machine × 2 replicas each need 4"):
        placement(2, 0, 2, ["2", "3"])
