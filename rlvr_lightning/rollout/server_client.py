"""The HTTP client of the `vllm serve` replicas: one pooled session, and POSTs bounded in time whose failures
name the server, the route, the bound and the setting that sets it.

The bounds (`rollout.servers.request_timeout_s` replaces both when set): a generation request may take
`GENERATION_BASE_S` plus `GENERATION_S_PER_TOKEN` for each token it asks for per sequence (its sequences decode
side by side, so the longest bounds it; the base covers its wait behind other requests); any other route
(weight loads, pauses, version stamps) `ROUTE_TIMEOUT_S`. A replica that stops answering is noticed sooner,
by its health checks (`replica_watch.py`)."""

from __future__ import annotations

from rlvr_lightning.rollout.server_process import RolloutServerError

GENERATION_BASE_S = 600.0
GENERATION_S_PER_TOKEN = 0.5  # a sequence decoding slower than 2 tokens/s is stuck on any hardware we run
ROUTE_TIMEOUT_S = 600.0


class RolloutServerRefused(RolloutServerError):
    """The server answered, with an error status: the request itself was refused (not a lost server)."""


def post(session, url: str, route: str, timeout: float, bound_by: str, **kwargs) -> dict:
    """POST to `route` of the server at `url`; a refusal, a lost connection or no answer within `timeout`
    seconds is a `RolloutServerError` naming the server and the route (`bound_by`: what set the bound)."""
    import requests

    try:
        resp = session.post(f"{url}{route}", timeout=timeout, **kwargs)
    except requests.Timeout as e:
        raise RolloutServerError(f"rollout server {url}: {route} got no answer within {timeout:g} s ({bound_by})") from e
    except requests.ConnectionError as e:
        raise RolloutServerError(f"rollout server {url}: {route} failed: {e}") from e
    if resp.status_code != 200:
        raise RolloutServerRefused(f"rollout server {url}: {route} answered {resp.status_code}: {resp.text[:2000]}")
    if not resp.content:
        return {}
    try:
        return resp.json()
    except ValueError:  # a route that answers in plain text (vLLM's /v1/load_lora_adapter: "Success: …")
        return {"text": resp.text}


class ServerClient:
    def __init__(self, request_timeout_s: float | None = None, setting: str = "rollout.servers.request_timeout_s") -> None:
        """`request_timeout_s`: how long any one request to a server may take; None: the bounds above. `setting`:
        the option that sets it, for the errors."""
        import requests

        self.request_timeout_s, self.setting = request_timeout_s, setting
        self.session = requests.Session()
        # One connection per concurrent request (the client pool's threads, a throughput stream's), not 10.
        self.session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=256))

    @property
    def route_timeout_s(self) -> float:
        """The bound on a request other than a generation."""
        return self.request_timeout_s or ROUTE_TIMEOUT_S

    def generation_timeout_s(self, max_tokens: int) -> float:
        """The bound on a generation request asking for up to `max_tokens` tokens per sequence."""
        return self.request_timeout_s or GENERATION_BASE_S + GENERATION_S_PER_TOKEN * max_tokens

    def post(self, url: str, route: str, timeout: float | None = None, **kwargs) -> dict:
        if timeout is None:
            timeout = self.route_timeout_s
        bound_by = self.setting if self.request_timeout_s else f"this request's default bound; {self.setting} sets one"
        return post(self.session, url, route, timeout, bound_by, **kwargs)
