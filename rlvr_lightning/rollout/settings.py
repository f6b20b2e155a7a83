"""The `rollout:` config section: how completions are sampled, and the engine that samples them.

The data module keeps the data (problems, prompts, batches); this section is everything about
generation. LightningCLI builds it from `rollout:` and hands it to the data module, whose prompt
lengths bound the engine's context; the training module builds the engine from it on first use.

The sampling and the engine's own settings stay flat, `--rollout.<name>`; the servers of engine `vllm-server`, the
stream generating ahead of the trainer and the weight sync are groups: `--rollout.servers.urls`,
`--rollout.stream.max_staleness`, `--rollout.sync.check_tol`. Each group checks its own values (`check`);
`RolloutSettings` checks how they combine with the engine.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch

from rlvr_lightning.device_defaults import detect_accelerator, resolve_device_defaults
from rlvr_lightning.errors import ConfigError, check_choice
from rlvr_lightning.rollout.engine import LogprobsFn, RolloutEngine
from rlvr_lightning.rollout.types import SamplingConfig

log = logging.getLogger(__name__)

ENGINES = ("vllm", "vllm-server", "hf")


def vllm_auto_dtype(checkpoint_dtype: str, on_cuda: bool, bf16_supported: bool = True) -> str:
    """What vLLM computes in for `dtype: auto`: the checkpoint's, except that it downcasts an fp32 checkpoint on
    a GPU (to bf16, or fp16 on GPUs without bf16); on CPU it keeps fp32."""
    if checkpoint_dtype == "float32" and on_cuda:
        return "bfloat16" if bf16_supported else "float16"
    return checkpoint_dtype


@dataclass(frozen=True)
class EngineSite:
    """Where an engine is built: the policy it serves and this trainer rank's place among the others."""

    policy_path: str
    max_model_len: int  # prompt + response tokens
    seed: int  # the run's data seed; each rank samples with seed + rank
    policy: torch.nn.Module | None = None  # the trainer's policy (the `hf` engine samples with it)
    policy_logprobs: LogprobsFn | None = None  # the trainer's log-probs of a completion (the `hf` engine's `logprobs`)
    tokenizer: Any = None
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0  # this rank's index among the trainer ranks on its machine
    ranks_per_node: int = 1
    lora_max_rank: int | None = None  # a LoRA policy synced as an adapter: the engine serves adapters up to this rank


Group = TypeVar("Group")


def group_of(cls: type[Group], value: Group | Mapping[str, Any] | None, section: str) -> Group:
    """A group of the section from the CLI's dataclass, a parsed namespace (`make plan`, `make doctor`), a plain
    dict (Python) or None (its defaults)."""
    if isinstance(value, cls):
        return value
    if hasattr(value, "as_dict"):  # jsonargparse's Namespace
        value = value.as_dict()
    try:
        return cls(**dict(value or {}))
    except TypeError as e:  # an unknown key: one line naming the group's fields
        fields = ", ".join(f.name for f in dataclasses.fields(cls))
        raise ConfigError(f"{section}: {e}; its settings are {fields}") from None


def _positive_seconds(section: str, **seconds: float | None) -> None:
    for name, value in seconds.items():
        if value is not None and value <= 0:
            raise ConfigError(f"{section}.{name} must be > 0 seconds, got {value}")


@dataclass(frozen=True)
class ServerSettings:
    """The `vllm serve` replicas of engine `vllm-server` (`--rollout.servers.<name>`; docs/servers.md).

    Args:
        replicas: `vllm serve` processes the trainer launches; prompts are spread over them. On CPU each gets
            its own share of the cores.
        urls: attach to servers already running at these URLs (started with `VLLM_SERVER_DEV_MODE=1` and the
            flags in docs/servers.md) instead of launching any.
        cuda_devices: CUDA_VISIBLE_DEVICES of each launched replica (e.g. ["2", "3"]), so rollouts run on GPUs
            the trainer does not use; with several trainer ranks per machine, one entry per replica of every
            rank, rank after rank (2 ranks × 1 replica: ["2", "3"]).
        start_timeout_s: how long a launched server may take to become healthy.
        args: extra `vllm serve` flags for every launched replica.
        request_timeout_s: how long one request to a server may take (a prompt's generation, a weight load or
            update); past it, the error names the server and the request. Default: a generation 600 s plus
            0.5 s per token asked for, any other request 600 s.
        unresponsive_s: a replica that answers no health check for this long is taken for frozen: a launched
            one is killed and restarted from the current weights, an attached one dropped, and their requests
            sent again (with their seeds); the run stops when no replica remains.
    """

    replicas: int = 1
    urls: list[str] | None = None
    cuda_devices: list[str] | None = None
    start_timeout_s: float = 600.0
    args: list[str] | None = None
    request_timeout_s: float | None = None
    unresponsive_s: float = 60.0

    def check(self) -> None:
        _positive_seconds("rollout.servers", request_timeout_s=self.request_timeout_s, unresponsive_s=self.unresponsive_s)

    @property
    def elsewhere(self) -> bool:
        """Whether the engine runs on GPUs the trainer does not use (attached servers, or launched on devices
        of their own)."""
        return bool(self.urls or self.cuda_devices)


@dataclass(frozen=True)
class StreamSettings:
    """Rollouts generated ahead of the trainer on the servers (`--rollout.stream.<name>`; engine `vllm-server`).

    Args:
        max_staleness: how many policy versions the servers may generate ahead of the trainer: rollout batch
            t + s is sampled while batch t trains, so no trained token is more than s versions older than the
            policy it trains (`training/rollout_stream.py`). 0: generation and update alternate (synchronous);
            1: one batch generated ahead by the previous version.
        partial_rollouts: with max_staleness ≥ 2, each batch is generated over the versions it has before it
            trains, in segments: sequences interrupted by a weight sync continue under the new weights from
            where they stopped, every token keeping the version and log-prob that sampled it.
        mode: with max_staleness ≥ 1, `reproducible` (what is generated under which version, and where
            sequences are interrupted, follow from the seed and the step: runs repeat and resume exactly) or
            `throughput` (groups generated continuously and trained as they finish; timing decides which, so
            runs do not repeat: `training/throughput_stream.py`).
        stale_groups: `throughput` mode, a group that would train more than max_staleness versions after it
            was issued: `hold` (steps train the groups due first, waiting for them; none is lost) or `drop`
            (dropped and its prompt issued again; logs `train/groups_dropped` and
            `train/dropped_response_length_mean`, since dropping favours short answers).
    """

    max_staleness: int = 0
    partial_rollouts: bool = False
    mode: Literal["reproducible", "throughput"] = "reproducible"
    stale_groups: Literal["hold", "drop"] = "hold"

    def check(self) -> None:
        if not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ConfigError(f"rollout.stream.max_staleness must be an integer ≥ 0, got {self.max_staleness!r}")
        check_choice("rollout.stream.mode", self.mode, ("reproducible", "throughput"))
        check_choice("rollout.stream.stale_groups", self.stale_groups, ("hold", "drop"))
        if self.mode == "throughput" and self.max_staleness < 1:
            raise ConfigError(
                "rollout.stream.mode=throughput generates ahead of the trainer: set rollout.stream.max_staleness ≥ 1"
            )
        if self.stale_groups == "drop" and self.mode != "throughput":
            raise ConfigError(
                "rollout.stream.stale_groups=drop needs rollout.stream.mode=throughput: the reproducible stream never "
                "generates a group more than max_staleness versions ahead, so it has nothing to drop"
            )
        if self.partial_rollouts and self.max_staleness < 1:
            raise ConfigError(
                "rollout.stream.partial_rollouts continues sequences across weight syncs: set "
                "rollout.stream.max_staleness ≥ 1"
            )


@dataclass(frozen=True)
class SyncSettings:
    """How the trained weights reach the engine, and how the sync is checked (`--rollout.sync.<name>`).

    Args:
        weight_transfer: to `vllm serve` replicas: `snapshot` (safetensors in shared memory, loaded with vLLM's
            `reload_weights`; servers on this machine), `nccl` (vLLM's NCCL weight transfer; GPU, not run by this
            project yet) or `auto` (nccl on CUDA, else snapshot).
        weight_transfer_host: `nccl`: the address of this machine at which the servers' workers reach the
            trainer (default: `VLLM_HOST_IP` if set, else the local address of the route to each server).
        weight_transfer_timeout_s: `nccl`: how long the rendezvous with a server's workers may take; past it,
            the error names the address and port they were to reach.
        check_tol: max |engine − trainer| log-prob on the probe sequence after a weight sync, and between
            `vllm serve` replicas; None follows the precision (`default_sync_tol` in rollout/sync.py: 1e-4 when
            the engine and the trainer both compute in fp32, else 0.05).
        check_every: probe the first weight sync and every N-th after it.
    """

    weight_transfer: Literal["auto", "snapshot", "nccl"] = "auto"
    weight_transfer_host: str | None = None
    weight_transfer_timeout_s: float = 120.0
    check_tol: float | None = None
    check_every: int = 10

    def check(self) -> None:
        check_choice("rollout.sync.weight_transfer", self.weight_transfer, ("auto", "snapshot", "nccl"))
        _positive_seconds("rollout.sync", weight_transfer_timeout_s=self.weight_transfer_timeout_s)
        if self.check_every < 1:
            raise ConfigError(f"rollout.sync.check_every must be ≥ 1, got {self.check_every}")


class RolloutSettings:
    def __init__(
        self,
        group_size: int = 8,
        max_response_length: int = 32,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        engine: Literal["vllm", "vllm-server", "hf"] = "vllm",
        dtype: Literal["float32", "bfloat16", "float16", "auto"] | None = None,
        kv_cache_gib: float = 1.0,
        gpu_memory_utilization: float | None = None,
        enforce_eager: bool | None = None,
        sleep_level: Literal[0, 1, 2] = 0,
        servers: ServerSettings = ServerSettings(),
        stream: StreamSettings = StreamSettings(),
        sync: SyncSettings = SyncSettings(),
    ) -> None:
        """Every argument is a CLI flag, `--rollout.<name>` (a group's: `--rollout.stream.max_staleness`).

        Args:
            group_size: completions sampled per prompt (G), the group of group-relative advantages.
            max_response_length: generation limit in tokens; completions that hit it count as truncated.
            temperature: sampling temperature (> 0).
            top_p: nucleus sampling (1 = off).
            top_k: top-k sampling (-1 = off).
            engine: `vllm` (default: an in-process engine on the trainer's device), `vllm-server` (`vllm serve`
                replicas, launched on loopback or attached to `servers.urls`) or `hf` (the transformers
                `generate` fallback).
            dtype: the vLLM engine's weights and compute (`auto`: the checkpoint's; default: the device's,
                float32 on CPU, bfloat16 on CUDA: `rlvr_lightning.device_defaults`).
            kv_cache_gib: vLLM KV cache on CPU, in GiB (`VLLM_CPU_KVCACHE_SPACE`).
            gpu_memory_utilization: vLLM's share of GPU memory when colocated with training (default: the
                device's, 0.3 on CUDA, 0.5 with sleep_level ≥ 1, 0.9 for servers on GPUs of their own).
            enforce_eager: run vLLM without CUDA graphs (faster start-up, slower decoding; default: the
                device's, true on CPU, false on CUDA).
            sleep_level: vLLM sleep mode during the policy update (CUDA only; ignored with a warning on
                CPU): 0 off, 1 weights copied to host memory and KV cache freed, 2 both freed (the
                weight sync reloads them). The engine wakes itself for the sync and for generation.
            servers: the `vllm serve` replicas of engine `vllm-server`: launched or attached, their GPUs, time
                limits (`ServerSettings`).
            stream: rollouts generated ahead of the trainer: staleness, partial rollouts, mode (`StreamSettings`).
            sync: the weight transfer to the servers and the sync's log-prob check (`SyncSettings`).
        """
        servers = group_of(ServerSettings, servers, "rollout.servers")
        stream = group_of(StreamSettings, stream, "rollout.stream")
        sync = group_of(SyncSettings, sync, "rollout.sync")
        if None in (dtype, gpu_memory_utilization, enforce_eager):  # built in Python: this machine's defaults
            given = {
                "rollout.dtype": dtype,
                "rollout.gpu_memory_utilization": gpu_memory_utilization,
                "rollout.enforce_eager": enforce_eager,
            }
            values = resolve_device_defaults(
                detect_accelerator(), given, sleep_level=sleep_level, engine_elsewhere=servers.elsewhere
            ).values
            dtype, gpu_memory_utilization = values["rollout.dtype"], values["rollout.gpu_memory_utilization"]
            enforce_eager = values["rollout.enforce_eager"]
        check_choice("rollout.engine", engine, ENGINES)
        check_choice("rollout.dtype", dtype, ("float32", "bfloat16", "float16", "auto"))
        check_choice("rollout.sleep_level", sleep_level, (0, 1, 2))
        for group in (servers, stream, sync):
            group.check()
        if stream.max_staleness and engine != "vllm-server":
            raise ConfigError(
                f"rollout.stream.max_staleness={stream.max_staleness} needs rollout.engine=vllm-server (got {engine}): "
                "the rollouts ahead run on the servers while this process updates the policy"
            )
        if engine == "vllm-server" and not servers.urls and servers.replicas < 1:
            raise ConfigError(f"rollout.servers.replicas must be ≥ 1, got {servers.replicas}")
        if group_size < 2:
            raise ConfigError(f"rollout.group_size must be ≥ 2 (group-relative advantages), got {group_size}")
        if max_response_length < 1:
            raise ConfigError(f"rollout.max_response_length must be ≥ 1, got {max_response_length}")
        if temperature <= 0:
            raise ConfigError(f"rollout.temperature must be > 0 for RL sampling, got {temperature}")
        self.group_size, self.max_response_length = group_size, max_response_length
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.engine, self.dtype, self.kv_cache_gib = engine, dtype, kv_cache_gib
        self.gpu_memory_utilization, self.enforce_eager = gpu_memory_utilization, enforce_eager
        self.sleep_level = sleep_level
        self.servers, self.stream, self.sync = servers, stream, sync

    def __repr__(self) -> str:
        return f"RolloutSettings({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"

    @property
    def samples_truncated_distribution(self) -> bool:
        """Top-p/top-k sampling: the engine's log-probs are those of the truncated distribution."""
        return self.top_p < 1 or self.top_k > 0

    def sampling(self, **overrides: Any) -> SamplingConfig:
        """The training sampling settings, with `overrides` (evaluation's, a per-batch seed)."""
        base = dict(
            group_size=self.group_size,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=self.max_response_length,
        )
        return SamplingConfig(**{**base, **overrides})

    def build_engine(self, site: EngineSite) -> RolloutEngine:
        if self.engine == "hf":
            from rlvr_lightning.rollout.hf_engine import HFGenerateEngine

            if self.sleep_level:
                log.warning(
                    "rollout.sleep_level=%d is ignored: rollout.engine=hf has no memory of its own", self.sleep_level
                )
            tok = site.tokenizer
            return HFGenerateEngine(site.policy, tok.pad_token_id, tok.eos_token_id, site.policy_logprobs)
        if self.engine == "vllm-server":
            return self._build_server_engine(site)
        from rlvr_lightning.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(site.policy_path, **self.vllm_args(site), sleep_level=self.sleep_level)

    def vllm_args(self, site: EngineSite) -> dict[str, Any]:
        """What a vLLM engine of this rank runs with, in process or as a `vllm serve` replica. Each rank gets its
        own seed, so ranks do not sample identical completions."""
        return dict(
            max_model_len=site.max_model_len,
            dtype=self.dtype,
            seed=site.seed + site.rank,
            kv_cache_gib=self.kv_cache_gib,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enforce_eager=self.enforce_eager,
            lora_max_rank=site.lora_max_rank,
        )

    def server_spec(self, site: EngineSite):
        """What every launched `vllm serve` replica of this rank runs."""
        from rlvr_lightning.rollout.server_process import ServerSpec

        return ServerSpec(
            site.policy_path,
            **self.vllm_args(site),
            extra_args=list(self.servers.args or []),
            start_timeout_s=self.servers.start_timeout_s,
        )

    def _build_server_engine(self, site: EngineSite) -> RolloutEngine:
        from rlvr_lightning.rollout.vllm_server import VLLMServerEngine

        if self.stream.mode == "throughput" and self.stream.partial_rollouts and site.lora_max_rank is not None:
            raise ConfigError(
                "rollout.stream.mode=throughput with rollout.stream.partial_rollouts does not run a LoRA policy: its "
                "adapter sync unloads the adapter that the requests frozen across it name. Set "
                "rollout.stream.partial_rollouts false (each sync waits for the requests in flight) or "
                "rollout.stream.mode reproducible"
            )
        # Launched servers belong to their rank; attached ones are shared, and rank 0 alone writes the weights.
        role = "only" if site.world_size == 1 or not self.servers.urls else ("leader" if site.rank == 0 else "follower")
        return VLLMServerEngine(
            self.server_spec(site),
            replicas=self.servers.replicas,
            urls=self.servers.urls,
            transport=self.sync.weight_transfer,
            cuda_devices=self.servers.cuda_devices,
            sync_role=role,
            node_slot=(site.local_rank, site.ranks_per_node),
            request_timeout_s=self.servers.request_timeout_s,
            unresponsive_s=self.servers.unresponsive_s,
            transfer_host=self.sync.weight_transfer_host,
            transfer_timeout_s=self.sync.weight_transfer_timeout_s,
        )
