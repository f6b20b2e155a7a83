"""The HTTP client of the `vllm serve` replicas: one pooled session, and POSTs bounded by the request timeout
(`rollout.server_request_timeout_s`) whose failures name the server and the route."""

from __future__ import annotations

from rlvr_lightning.rollout.server_process import RolloutServerError


def post(session, url: str, route: str, timeout: float, **kwargs) -> dict:
    """POST to `route` of the server at `url`; a refusal, a lost connection or no answer within `timeout`
    seconds is a `RolloutServerError` naming the server and the route."""
    import requests

    try:
        resp = session.post(f"{url}{route}", timeout=timeout, **kwargs)
    except requests.Timeout as e:
        raise RolloutServerError(
            f"rollout server {url}: {route} got no answer within {timeout:g} s (rollout.server_request_timeout_s)"
        ) from e
    except requests.ConnectionError as e:
        raise RolloutServerError(f"rollout server {url}: {route} failed: {e}") from e
    if resp.status_code != 200:
        raise RolloutServerError(f"rollout server {url}: {route} answered {resp.status_code}: {resp.text[:2000]}")
    if not resp.content:
        return {}
    try:
        return resp.json()
    except ValueError:  # a route that answers in plain text (vLLM's /v1/load_lora_adapter: "Success: …")
        return {"text": resp.text}


class ServerClient:
    def __init__(self, request_timeout_s: float) -> None:
        """`request_timeout_s`: how long any one request to a server may take, unless a call says otherwise."""
        import requests

        self.request_timeout_s = request_timeout_s
        self.session = requests.Session()
        # One connection per concurrent request (the client pool's threads, a throughput stream's), not 10.
        self.session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=256))

    def post(self, url: str, route: str, timeout: float | None = None, **kwargs) -> dict:
        return post(self.session, url, route, timeout or self.request_timeout_s, **kwargs)
