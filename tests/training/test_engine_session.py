"""The engine session (`training.engine_session`): the engine and the environment made on first use (once, however
many threads ask), what exists reported without building anything, the state a checkpoint keeps, and closing the
stream before the engine it generates on."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from rlvr_lightning.training.engine_session import EngineSession


class Part:
    """An engine, stream or environment that records when it is closed."""

    def __init__(self, name: str, closed: list[str]) -> None:
        self.name, self.closed = name, closed

    def close(self) -> None:
        self.closed.append(self.name)


def test_the_engine_is_built_on_first_use_and_not_before_a_spec():
    session = EngineSession()
    assert session.built() == {"engine": None, "rollout stream": None, "environment": None}
    with pytest.raises(RuntimeError, match="no spec yet: attach"):
        session.engine  # noqa: B018
    assert session.built()["engine"] is None  # asking to report builds nothing


def test_the_environment_is_made_once_when_request_threads_ask_for_it_at_once():
    """The throughput stream's request threads may be the first to ask for the run's environment: one is made (a
    second would start a sandbox nothing closes)."""
    made = []

    def make_environment():
        time.sleep(0.05)  # as a sandbox takes its time to start
        made.append(object())
        return made[-1]

    session = EngineSession()
    session.spec = SimpleNamespace(make_environment=make_environment)
    with ThreadPoolExecutor(8) as pool:
        seen = list(pool.map(lambda _: session.environment, range(8)))
    assert len(made) == 1 and all(e is made[0] for e in seen)


def test_close_stops_the_stream_before_the_engine_and_forgets_every_part():
    closed: list[str] = []
    session = EngineSession()
    session.engine = Part("engine", closed)
    session.stream, session._environment = Part("stream", closed), Part("environment", closed)
    session.close()
    assert closed == ["stream", "engine", "environment"]  # the batches ahead are generated on the engine
    assert session.built() == {"engine": None, "rollout stream": None, "environment": None}
    session.close()  # twice is harmless
    assert closed == ["stream", "engine", "environment"]


def test_a_checkpoint_keeps_the_policy_version_and_the_streams_batches_in_flight():
    session = EngineSession()
    session.policy_version = 7
    assert session.state_dict() == {"policy_version": 7}
    session.stream = SimpleNamespace(state_dict=lambda: {"groups": [1, 2]})
    state = session.state_dict()
    resumed = EngineSession()
    resumed.load_state_dict(state)
    assert resumed.policy_version == 7 and resumed._stream_state == {"groups": [1, 2]}
