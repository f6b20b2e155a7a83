"""RolloutDataModule: prompt batches for RL, the held-out problems, the tokenizer and the rollout engine.

The dataloader yields *prompts* only. Completions are generated inside the training step
(`rlvr_lightning.training.generation`): Lightning fetches the next batch before the current step runs, so generating in a
dataset iterator would sample from stale weights.
"""

from __future__ import annotations

import logging
import warnings
from functools import partial
from typing import Literal

import lightning as L
import torch
from torch.utils.data import DataLoader

from rlvr_lightning.data.batches import ResumableBatches
from rlvr_lightning.data.sources import ProblemRecord, embedded_records, load_problems
from rlvr_lightning.errors import ConfigError, check_choice
from rlvr_lightning.models.policy import load_tokenizer
from rlvr_lightning.models.warm_start import EMBEDDED, resolve_policy_path
from rlvr_lightning.rollout.engine import RolloutEngine
from rlvr_lightning.rollout.types import PromptBatch, SamplingConfig

log = logging.getLogger(__name__)


class RolloutDataModule(L.LightningDataModule):
    def __init__(
        self,
        model_name_or_path: str = EMBEDDED,
        train_data: str = EMBEDDED,
        val_data: str | None = EMBEDDED,
        train_split: str = "train",
        val_split: str = "test",
        problem_field: str | None = None,
        answer_field: str | None = None,
        id_field: str | None = None,
        prompt_template: str = "{problem}",
        use_chat_template: bool = False,
        batch_size: int = 16,
        group_size: int = 8,
        max_prompt_length: int = 64,
        max_response_length: int = 32,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        val_size: int | None = 200,
        engine: Literal["vllm", "vllm-server", "hf"] = "vllm",
        dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32",
        kv_cache_gib: float = 1.0,
        gpu_memory_utilization: float = 0.3,
        enforce_eager: bool = True,
        sleep_level: Literal[0, 1, 2] = 0,
        seed: int = 0,
        server_replicas: int = 1,
        server_urls: list[str] | None = None,
        server_cuda_devices: list[str] | None = None,
        server_start_timeout_s: float = 600.0,
        server_args: list[str] | None = None,
        weight_transfer: Literal["auto", "snapshot", "nccl"] = "auto",
        async_rollouts: Literal[0, 1] = 0,
    ) -> None:
        """
        Args:
            model_name_or_path: `embedded` (the built-in tiny model, warm-started on first use;
                `embedded-balanced`: its warm start with about half the samples correct), an
                HF model id, or a local HF model directory. The trainer and the engine both load it.
            train_data: `embedded` (the built-in arithmetic task), a .jsonl/.json/.parquet file, or
                an HF dataset name.
            val_data: held-out problems for `val/accuracy` (same forms), or null for none.
            problem_field / answer_field / id_field: column names; auto-detected when null.
            prompt_template: Python format string applied to each problem (`{problem}`).
            use_chat_template: wrap the templated prompt in the tokenizer's chat template.
            batch_size: prompts per rollout batch (B). Each prompt gets `group_size` completions (G).
            max_prompt_length: prompts longer than this (in tokens) are dropped, with a count.
            max_response_length: generation limit; completions that hit it count as truncated.
            engine: `vllm` (default: an in-process engine on the trainer's device), `vllm-server` (`vllm serve`
                replicas, launched on loopback or attached to `server_urls`) or `hf` (the transformers
                `generate` fallback).
            dtype: the vLLM engine's weights and compute (`auto`: the checkpoint's).
            kv_cache_gib: vLLM KV cache on CPU, in GiB (`VLLM_CPU_KVCACHE_SPACE`).
            gpu_memory_utilization: vLLM's share of GPU memory when colocated with training.
            sleep_level: vLLM sleep mode during the policy update (CUDA only; ignored with a warning on
                CPU): 0 off, 1 weights copied to host memory and KV cache freed, 2 both freed (the
                weight sync reloads them). The engine wakes itself for the sync and for generation.
            server_replicas: `vllm serve` processes the trainer launches (engine `vllm-server`); prompts are
                spread over them. On CPU each gets its own share of the cores.
            server_urls: attach to servers already running at these URLs (started with
                `VLLM_SERVER_DEV_MODE=1` and the flags in docs/servers.md) instead of launching any.
            server_cuda_devices: CUDA_VISIBLE_DEVICES of each launched replica (e.g. ["2", "3"]), so rollouts
                run on GPUs the trainer does not use; with several trainer ranks per machine, one entry per
                replica of every rank, rank after rank (2 ranks × 1 replica: ["2", "3"]).
            server_start_timeout_s: how long a launched server may take to become healthy.
            server_args: extra `vllm serve` flags for every launched replica.
            weight_transfer: `snapshot` (safetensors in shared memory, loaded with vLLM's `reload_weights`;
                servers on this machine), `nccl` (vLLM's NCCL weight transfer; GPU, untested here) or
                `auto` (nccl on CUDA, else snapshot).
            async_rollouts: 1 generates rollout batch k+1 while the trainer updates on batch k (one step
                off policy, engine `vllm-server`); 0 alternates generation and update.
        """
        super().__init__()
        self.save_hyperparameters()
        check_choice("data.engine", engine, ("vllm", "vllm-server", "hf"))
        check_choice("data.weight_transfer", weight_transfer, ("auto", "snapshot", "nccl"))
        check_choice("data.async_rollouts", async_rollouts, (0, 1))
        if async_rollouts and engine != "vllm-server":
            raise ConfigError(
                f"data.async_rollouts=1 needs data.engine=vllm-server (got {engine}): the rollouts of the next "
                "batch run on the servers while this process updates the policy"
            )
        if engine == "vllm-server" and not server_urls and server_replicas < 1:
            raise ConfigError(f"data.server_replicas must be ≥ 1, got {server_replicas}")
        check_choice("data.dtype", dtype, ("float32", "bfloat16", "float16", "auto"))
        check_choice("data.sleep_level", sleep_level, (0, 1, 2))
        if group_size < 2:
            raise ConfigError(f"data.group_size must be ≥ 2 (group-relative advantages), got {group_size}")
        if temperature <= 0:
            raise ConfigError(f"data.temperature must be > 0 for RL sampling, got {temperature}")
        self.tokenizer = None
        self.policy_path: str | None = None
        self.train_records: list[ProblemRecord] = []
        self.val_records: list[ProblemRecord] = []
        self._engine: RolloutEngine | None = None
        self.train_batches: ResumableBatches | None = None  # the stream behind train_dataloader
        # Position in the stream of extra prompts (DAPO's dynamic sampling); part of the state dict.
        self._extra_epoch = 0
        self._extra_pos = 0

    # ---- setup -------------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        if self.tokenizer is not None:
            return
        self.policy_path = resolve_policy_path(self.hparams.model_name_or_path)
        self.tokenizer = load_tokenizer(self.policy_path)
        self._check_context_length()
        self.train_records = self._load(self.hparams.train_data, self.hparams.train_split, train=True)
        self.val_records = (
            self._load(self.hparams.val_data, self.hparams.val_split, train=False)[: self.hparams.val_size]
            if self.hparams.val_data
            else []
        )
        if len(self.train_records) < self.hparams.batch_size:
            raise ConfigError(
                f"data.train_data has {len(self.train_records)} usable problems, fewer than data.batch_size="
                f"{self.hparams.batch_size}"
            )

    def _check_context_length(self) -> None:
        """Prompt + response must fit the model's positions; vLLM would refuse deep inside otherwise."""
        from transformers import AutoConfig

        limit = getattr(AutoConfig.from_pretrained(self.policy_path), "max_position_embeddings", None)
        h = self.hparams
        if limit is not None and h.max_prompt_length + h.max_response_length > limit:
            raise ConfigError(
                f"data.max_prompt_length={h.max_prompt_length} + data.max_response_length={h.max_response_length} "
                f"exceeds the {limit} positions of {h.model_name_or_path}; lower one of them"
            )

    def _load(self, source: str, split: str, train: bool) -> list[ProblemRecord]:
        h = self.hparams
        return self.load_records(
            source, split, problem_field=h.problem_field, answer_field=h.answer_field, id_field=h.id_field,
            max_prompt_tokens=h.max_prompt_length, embedded_part="train" if train else "test",
        )  # fmt: skip

    def load_records(
        self, source: str, split: str = "test", max_prompt_tokens: int | None = None,
        embedded_part: str | None = None, limit: int | None = None, **fields: str | None,
    ) -> list[ProblemRecord]:  # fmt: skip
        """Problems from `embedded` (its train or test part: `embedded_part`, else `split`), a file or an
        HF dataset (`fields`: `problem_field`, `answer_field`, `id_field` of `load_problems`), without
        those whose templated prompt is longer than `max_prompt_tokens` (counted)."""
        if source == EMBEDDED:
            records = embedded_records(embedded_part or split)[:limit]
        else:
            records = load_problems(source, split=split, limit=limit, **fields)
        if max_prompt_tokens is None:
            return records
        kept = [r for r in records if len(self.prompt_ids(r.problem)) <= max_prompt_tokens]
        if len(kept) < len(records):
            log.warning(
                "%s: dropped %d of %d problems whose prompt is longer than %d tokens",
                source, len(records) - len(kept), len(records), max_prompt_tokens,
            )  # fmt: skip
        return kept

    def format_prompt(self, problem: str) -> str:
        text = self.hparams.prompt_template.format(problem=problem)
        if self.hparams.use_chat_template:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
        return text

    def prompt_ids(self, problem: str) -> list[int]:
        return self.tokenizer(self.format_prompt(problem), add_special_tokens=False).input_ids

    # ---- dataloaders -------------------------------------------------------------------------
    def collate(self, records: list[ProblemRecord]) -> PromptBatch:
        return PromptBatch(
            ids=[r.id for r in records],
            prompts=[self.format_prompt(r.problem) for r in records],
            answers=[r.answer for r in records],
        )

    def train_dataloader(self) -> DataLoader:
        """Seeded, shuffled prompt batches, one per rollout batch; a resumed run continues where the
        checkpoint was taken (`ResumableBatches`), and each rank gets its own slice of every batch."""
        trainer = self.trainer
        module = trainer.lightning_module if trainer is not None else None
        start = getattr(module, "rollout_batches", 0)
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        try:
            self.train_batches = ResumableBatches(
                self.train_records, self.hparams.batch_size, self.hparams.seed, self.collate, start, rank, world
            )
        except ValueError as err:
            raise ConfigError(f"data.train_data / data.batch_size: {err}") from None
        # Lightning warns that __len__ may be wrong with several loader workers; there are none here.
        warnings.filterwarnings("ignore", message=r".*`IterableDataset` has `__len__` defined")
        return DataLoader(self.train_batches, batch_size=None)  # the dataset yields whole batches

    def train_batch_at(self, index: int) -> PromptBatch:
        """This rank's training batch number `index`: the one the dataloader yields at that step."""
        return self.train_batches.batch_at(index)

    def extra_prompts(self, n: int) -> PromptBatch:
        """`n` more training prompts, for algorithms that sample beyond the dataloader's batch.

        A separate, seeded, reshuffled-every-pass stream over the training problems, so the
        dataloader's own order (and its resume position) is untouched. Every rank advances the same
        stream by n × world size and takes its own n of them, so ranks never draw the same prompts.
        """
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self.trainer is not None else (0, 1)
        picked = self._next_extra(n * world)
        return self.collate(picked[rank * n : (rank + 1) * n])

    def _next_extra(self, n: int) -> list[ProblemRecord]:
        picked: list[ProblemRecord] = []
        while len(picked) < n:
            order = torch.randperm(
                len(self.train_records), generator=torch.Generator().manual_seed(self.hparams.seed + 7919 * (self._extra_epoch + 1))
            )  # fmt: skip
            take = order[self._extra_pos : self._extra_pos + n - len(picked)].tolist()
            picked += [self.train_records[i] for i in take]
            self._extra_pos += len(take)
            if self._extra_pos >= len(order):
                self._extra_epoch, self._extra_pos = self._extra_epoch + 1, 0
        return picked

    def state_dict(self) -> dict:
        return {"extra_epoch": self._extra_epoch, "extra_pos": self._extra_pos}

    def load_state_dict(self, state: dict) -> None:
        self._extra_epoch = state.get("extra_epoch", 0)
        self._extra_pos = state.get("extra_pos", 0)

    def max_model_len(self) -> int:
        """Prompt + response tokens the engine is built for."""
        return self.hparams.max_prompt_length + self.hparams.max_response_length

    # ---- sampling and the engine -------------------------------------------------------------
    def sampling(self, **overrides) -> SamplingConfig:
        h = self.hparams
        base = dict(
            n=h.group_size, temperature=h.temperature, top_p=h.top_p, top_k=h.top_k, max_tokens=h.max_response_length
        )
        return SamplingConfig(**{**base, **overrides})

    def engine(self, policy: torch.nn.Module) -> RolloutEngine:
        """The rollout engine, built on first use (the HF fallback samples with `policy` itself)."""
        if self._engine is None:
            self._engine = self._build_engine(policy)
        return self._engine

    def _build_engine(self, policy: torch.nn.Module) -> RolloutEngine:
        h = self.hparams
        if h.engine == "hf":
            from rlvr_lightning.models.forward import sequence_logprobs
            from rlvr_lightning.rollout.hf_engine import HFGenerateEngine

            if h.sleep_level:
                log.warning("data.sleep_level=%d is ignored: data.engine=hf has no memory of its own", h.sleep_level)
            scorer = partial(sequence_logprobs, policy)
            return HFGenerateEngine(policy, self.tokenizer.pad_token_id, self.tokenizer.eos_token_id, scorer)
        # Each rank gets its own engine and its own seed, so ranks do not sample identical completions.
        rank = self.trainer.global_rank if self.trainer is not None else 0
        if h.engine == "vllm-server":
            return self._build_server_engine(rank)
        from rlvr_lightning.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(
            self.policy_path,
            max_model_len=self.max_model_len(),
            dtype=h.dtype,
            seed=h.seed + rank,
            kv_cache_gib=h.kv_cache_gib,
            gpu_memory_utilization=h.gpu_memory_utilization,
            enforce_eager=h.enforce_eager,
            sleep_level=h.sleep_level,
        )

    def _build_server_engine(self, rank: int) -> RolloutEngine:
        from rlvr_lightning.rollout.server_process import ServerSpec
        from rlvr_lightning.rollout.vllm_server import VLLMServerEngine

        h = self.hparams
        spec = ServerSpec(
            self.policy_path, max_model_len=self.max_model_len(), dtype=h.dtype, seed=h.seed + rank,
            kv_cache_gib=h.kv_cache_gib, gpu_memory_utilization=h.gpu_memory_utilization,
            enforce_eager=h.enforce_eager, extra_args=list(h.server_args or []),
            start_timeout_s=h.server_start_timeout_s,
        )  # fmt: skip
        world = self.trainer.world_size if self.trainer is not None else 1
        # Launched servers belong to their rank; attached ones are shared, and rank 0 alone writes the weights.
        role = "only" if world == 1 or not h.server_urls else ("leader" if rank == 0 else "follower")
        return VLLMServerEngine(
            spec, replicas=h.server_replicas, urls=h.server_urls, transport=h.weight_transfer,
            cuda_devices=h.server_cuda_devices, sync_role=role, node_slot=self._node_slot(),
        )  # fmt: skip

    def _node_slot(self) -> tuple[int, int]:
        """(this rank's index on its machine, the trainer ranks per machine)."""
        if self.trainer is None:
            return 0, 1
        return self.trainer.local_rank, self.trainer.num_devices

    def teardown(self, stage: str) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None
