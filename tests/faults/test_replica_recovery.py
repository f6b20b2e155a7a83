"""Recovery from replicas that drop a connection, refuse, freeze or all stop answering (`ReplicaSet.request`,
`ReplicaWatch`), against stand-in HTTP replicas attached by URL: every wait ends within its bound, with the
replica named."""

from __future__ import annotations

import time

import pytest

from rlvr_lightning.rollout.server_client import RolloutServerRefused, ServerClient
from rlvr_lightning.rollout.server_process import RolloutServerLost, ServerSpec
from rlvr_lightning.rollout.server_replicas import ReplicaSet


def attached(fakes, unresponsive_s: float | None = 2.0) -> ReplicaSet:
    replicas = ReplicaSet(ServerClient(30.0), ServerSpec("unused", 64), 0, [f.url for f in fakes], (0, 1), None,
                          unresponsive_s=unresponsive_s)  # fmt: skip
    replicas.start()
    return replicas


def test_a_dropped_connection_is_sent_again_to_the_same_replica(fake_replicas):
    (fake,) = fake_replicas("drop-once")
    replicas = attached([fake])
    try:
        answer, index = replicas.request(0, "/inference/v1/generate", json={"seed": 7})
        assert (answer, index) == ({"route": "/inference/v1/generate"}, 0)
        assert fake.posts == ["/inference/v1/generate"] * 2
        assert (replicas.reissued_total, replicas.restarts_total) == (1, 0)
    finally:
        replicas.stop()


def test_a_refusal_by_a_healthy_replica_is_raised_not_sent_again(fake_replicas):
    (fake,) = fake_replicas("refuse")
    replicas = attached([fake])
    try:
        with pytest.raises(RolloutServerRefused, match=rf"{fake.url}: /inference/v1/generate answered 500"):
            replicas.request(0, "/inference/v1/generate", json={})
        assert len(fake.posts) == 1 and replicas.reissued_total == 0
    finally:
        replicas.stop()


def test_a_frozen_attached_replica_is_dropped_and_its_request_goes_to_another(fake_replicas, caplog):
    frozen, healthy = fake_replicas("ok", "ok")
    replicas = attached([frozen, healthy], unresponsive_s=2.0)
    try:
        frozen.mode = "frozen"
        start = time.monotonic()
        answer, index = replicas.request(0, "/inference/v1/generate", json={"seed": 3})
        waited = time.monotonic() - start
        assert index == 1 and answer == {"route": "/inference/v1/generate"} and healthy.posts
        # Found frozen by the health checks (2 s silent, checked every 0.5 s, each check bounded by 1 s), not by
        # the request's own 30 s bound.
        assert waited < 10, waited
        assert replicas[0].dropped and replicas.live() == [1] and replicas.reissued_total == 1
        assert f"rollout server {frozen.url} stopped answering" in caplog.text
        assert [r.url for r in replicas] == [healthy.url]  # no sync or request goes to it any more
    finally:
        replicas.stop()


def test_when_no_replica_answers_the_run_stops_with_one_line_naming_them(fake_replicas):
    (frozen,) = fake_replicas("ok")
    replicas = attached([frozen], unresponsive_s=2.0)
    try:
        frozen.mode = "frozen"
        start = time.monotonic()
        with pytest.raises(RolloutServerLost, match=rf"no rollout server remains: {frozen.url} stopped answering.*rollout.servers.urls"):
            replicas.request(0, "/inference/v1/generate", json={})
        assert time.monotonic() - start < 10
    finally:
        replicas.stop()


def test_without_health_checks_a_frozen_replica_is_bounded_by_the_request_timeout(fake_replicas):
    frozen, healthy = fake_replicas("frozen", "ok")
    replicas = ReplicaSet(ServerClient(1.0), ServerSpec("unused", 64), 0, [frozen.url, healthy.url], (0, 1), None)
    # Not started: `start` checks an attached replica's health, which the frozen one would fail at once.
    try:
        answer, index = replicas.request(0, "/inference/v1/generate", json={})
        assert index == 1 and replicas[0].dropped
    finally:
        replicas.stop()
