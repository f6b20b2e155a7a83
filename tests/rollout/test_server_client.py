"""The HTTP client of the rollout servers: a request not answered in time, or refused, is an error naming the
server and the route (against a local HTTP server, `slow_server`)."""

from __future__ import annotations

import pytest
import requests

from rlvr_lightning.rollout.server_client import post
from rlvr_lightning.rollout.server_process import RolloutServerError


def test_a_request_not_answered_in_time_names_the_server_and_the_route(slow_server):
    session = requests.Session()
    with pytest.raises(RolloutServerError, match=rf"rollout server {slow_server}: /update_weights got no answer "
                       r"within 0.5 s \(rollout.servers.request_timeout_s\)"):  # fmt: skip
        post(session, slow_server, "/update_weights", 0.5, "rollout.servers.request_timeout_s", json={})
    with pytest.raises(RolloutServerError, match=rf"rollout server {slow_server}: /fail answered 500: boom"):
        post(session, slow_server, "/fail", 5.0, "rollout.servers.request_timeout_s")
