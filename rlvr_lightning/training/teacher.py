"""The teacher of on-policy distillation: a model that scores the student's sampled tokens, token id for token id
(no re-tokenization), in the trainer process or on `vllm serve` replicas of its own. The advantage estimator `opd`
(`pieces/distillation.py`) turns its log-probs into the learning signal.

In the trainer it is loaded like the frozen reference (fp32, sharded per decoder layer under FSDP2) and scored by the
same no-grad pass; on a replica, vLLM's prompt log-probs of the sequence give each token's log-prob under the teacher.
Either way the teacher runs at temperature 1: its distribution as it is, whatever the student sampled at.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from rlvr_lightning.errors import ConfigError
from rlvr_lightning.models.policy import load_frozen, load_tokenizer
from rlvr_lightning.models.warm_start import resolve_policy_path
from rlvr_lightning.pieces.kinds import DistillationInputs
from rlvr_lightning.rollout.types import Rollout, RolloutTensors
from rlvr_lightning.training.behaviour import separate_pass

TEACHER_TEMPERATURE = 1.0
# A replica prefills a scored sequence in chunks of this many tokens: vLLM computes prompt log-probs from the logits
# of a whole prefill step, [tokens, vocabulary] in fp32 (an 8k-token sequence at a 151,936-token vocabulary would be
# 5 GB whole; 1.2 GB at 2048). The rollout servers prefill whole (a seeded sampler cannot be split on the CPU); a
# teacher samples nothing.
TEACHER_PREFILL_TOKENS = 2048


@dataclass(frozen=True)
class TeacherSettings:
    """The teacher of on-policy distillation (`--model.init_args.teacher.<name>`), read by the advantage
    estimator `opd`.

    Args:
        model_name_or_path: an HF model directory or id, or a built-in warm start (`embedded-balanced`); its
            vocabulary must be the student's (the student's token ids are scored as they are).
        servers: 0 (default): the teacher runs in the trainer process; n > 0: on n `vllm serve` replicas launched
            for it on this machine.
        server_urls: attach to running `vllm serve` replicas of the teacher instead (served as `policy`).
        request_timeout_s: how long one scoring request to a replica may take.
        sequences_per_request: sequences in one scoring request (its answer holds a log-prob entry per token: at 8k
            tokens a sequence, 32 of them are ~16 MB of JSON); each replica has two requests in flight.
    """

    model_name_or_path: str
    servers: int = 0
    server_urls: list[str] | None = None
    request_timeout_s: float = 600.0
    sequences_per_request: int = 32

    def check(self) -> None:
        if not self.model_name_or_path:
            raise ConfigError("model.teacher.model_name_or_path is empty: name the teacher's model")
        if self.servers < 0:
            raise ConfigError(f"model.teacher.servers must be ≥ 0, got {self.servers}")
        if self.request_timeout_s <= 0:
            raise ConfigError(f"model.teacher.request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.sequences_per_request < 1:
            raise ConfigError(f"model.teacher.sequences_per_request must be ≥ 1, got {self.sequences_per_request}")

    @property
    def served(self) -> bool:
        return self.servers > 0 or bool(self.server_urls)


def check_same_vocabulary(student_tokenizer: Any, teacher_path: str, teacher_name: str) -> None:
    """A teacher whose tokenizer maps any token otherwise than the student's, or whose embedding lacks a student
    token id, is refused in one line: its log-probs of the student's ids would score other text."""
    from transformers import AutoConfig

    teacher = load_tokenizer(teacher_path).get_vocab()
    student = student_tokenizer.get_vocab()
    if teacher != student:
        differ = len(set(teacher.items()) ^ set(student.items()))
        raise ConfigError(
            f"model.teacher.model_name_or_path={teacher_name!r}: its tokenizer is not the student's ({len(teacher)} "
            f"against {len(student)} tokens, {differ} entries differ); on-policy distillation scores the student's "
            "token ids as they are, so teacher and student must share one vocabulary"
        )
    rows = AutoConfig.from_pretrained(teacher_path).vocab_size
    if rows < max(student.values()) + 1:
        raise ConfigError(
            f"model.teacher.model_name_or_path={teacher_name!r}: its embedding has {rows} rows, fewer than the "
            f"student's token ids ({max(student.values()) + 1})"
        )


class TrainerTeacher:
    """The teacher in the trainer process: a frozen HF model, sharded like the policy under FSDP2."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def logprobs(self, rollout: Rollout, t: RolloutTensors, micro_batches: Callable, chunk_tokens: int,
                 lockstep: bool, packed: bool) -> torch.Tensor:
        """[N, T] log π_T of each response token of `t` (0 on padding), micro-batch by micro-batch
        (`micro_batches(rows, whole_groups)`); `lockstep`: every rank runs the same forwards (FSDP)."""
        logp, _, _ = separate_pass(
            self.model, None, t, TEACHER_TEMPERATURE, micro_batches, chunk_tokens, with_old=True, lockstep=lockstep,
            packed=packed,
        )
        return logp


class ServedTeacher:
    """The teacher on `vllm serve` replicas: each scoring request sends whole sequences as token ids and reads
    vLLM's prompt log-probs of them (the log-prob of each given token, however unlikely, at temperature 1)."""

    def __init__(self, replicas: Any, served_name: str, sequences_per_request: int = 32) -> None:
        self.replicas, self.served_name, self.per_request = replicas, served_name, sequences_per_request

    def start(self) -> None:
        self.replicas.start()

    def close(self) -> None:
        self.replicas.stop()

    def logprobs(self, rollout: Rollout, t: RolloutTensors, *_: Any, **__: Any) -> torch.Tensor:
        """[N, T] log π_T of each response token of the rollout (0 on padding): requests of `sequences_per_request`
        sequences, dealt to the replicas in turn, two in flight per replica."""
        G = rollout.group_size
        sequences = [(list(rollout.prompt_ids[n // G]), list(c.token_ids)) for n, c in enumerate(rollout.completions)]
        requests = [list(range(i, min(i + self.per_request, len(sequences)))) for i in range(0, len(sequences), self.per_request)]
        live = self.replicas.live()
        out = torch.zeros(t.response_mask.shape)
        with ThreadPoolExecutor(2 * len(live)) as pool:
            scored = pool.map(lambda k: self._score(live[k % len(live)], [sequences[n] for n in requests[k]]), range(len(requests)))
            for rows, values in zip(requests, scored):
                for n, v in zip(rows, values):
                    out[n, : len(v)] = torch.tensor(v)
        return out.to(t.response_mask.device)

    def _score(self, replica: int, sequences: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """One scoring request; a replica that dies or freezes is restarted (the teacher's weights never change,
        so there is nothing to restore) or dropped, as the rollout's are."""
        if not sequences:
            return []
        answer, _ = self.replicas.request(
            replica,
            "/v1/completions",
            json={
                "model": self.served_name,
                "prompt": [prompt + response for prompt, response in sequences],
                "max_tokens": 1,
                "temperature": 0.0,
                "prompt_logprobs": 0,
            },
        )
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        return [response_logprobs(c["prompt_logprobs"], p, r) for c, (p, r) in zip(choices, sequences)]


def response_logprobs(prompt_logprobs: list[dict | None], prompt: list[int], response: list[int]) -> list[float]:
    """The log-probs of `response`'s tokens from vLLM's prompt log-probs of prompt + response (one entry per
    position, {token id: {"logprob": …}}, holding the given token's whatever its rank)."""
    entries = prompt_logprobs[len(prompt) : len(prompt) + len(response)]
    if len(entries) != len(response):
        raise RuntimeError(f"the teacher's server scored {len(entries)} of {len(response)} response tokens")
    return [float(entry[str(token)]["logprob"]) for entry, token in zip(entries, response)]


@dataclass(frozen=True)
class ServerSite:
    """How this rank's teacher replicas run: the longest sequence, the seed, the KV cache, the dtype (the rollout
    engine's: `rollout.dtype`), and the rank's slot among the trainer's ranks on this machine (which cores or GPUs
    its replicas get)."""

    max_model_len: int
    seed: int
    kv_cache_gib: float
    node_slot: tuple[int, int]
    dtype: str = "auto"


def build_teacher(settings: TeacherSettings, student_tokenizer: Any, mesh: Any, param_dtype: str, site: ServerSite):
    """The teacher of `settings`, its vocabulary checked against the student's: in the trainer (loaded now, sharded
    on `mesh` in `param_dtype`), or on replicas at `site` (started by `start`)."""
    path = resolve_policy_path(settings.model_name_or_path)
    check_same_vocabulary(student_tokenizer, path, settings.model_name_or_path)
    if settings.served:
        return served_teacher(settings, path, site)
    return TrainerTeacher(load_frozen(path, mesh, param_dtype))


def served_teacher(settings: TeacherSettings, path: str, site: ServerSite) -> ServedTeacher:
    """Replicas of the teacher: launched for this rank (`settings.servers`) or attached (`settings.server_urls`)."""
    from rlvr_lightning.rollout.server_client import ServerClient
    from rlvr_lightning.rollout.server_process import SERVED_NAME, ServerSpec
    from rlvr_lightning.rollout.server_replicas import ReplicaSet

    chunked = ["--enable-chunked-prefill", "--max-num-batched-tokens", str(TEACHER_PREFILL_TOKENS)]  # over the spec's
    spec = ServerSpec(path, site.max_model_len + 1, site.dtype, site.seed, site.kv_cache_gib,
                      max_num_seqs=min(256, TEACHER_PREFILL_TOKENS), extra_args=chunked)
    client = ServerClient(settings.request_timeout_s, "model.teacher.request_timeout_s")
    # Frozen after a minute without a health check answered, as the rollout's replicas by default.
    replicas = ReplicaSet(client, spec, settings.servers, settings.server_urls, site.node_slot, None, unresponsive_s=60.0)
    return ServedTeacher(replicas, SERVED_NAME, settings.sequences_per_request)


def distillation_inputs(teacher: Any, step: Any, rollout: Rollout, t: RolloutTensors, layout: Any) -> DistillationInputs:
    """The teacher's and the student's log-probs of the rollout's sampled tokens (`t`: its tensors on the step's
    device; `step`: the step's context, `layout`: the update's, whose micro-batches and chunks the teacher's pass in
    the trainer uses)."""
    counts = t.token_counts
    teacher_logp = teacher.logprobs(
        rollout,
        t,
        lambda rows, whole_groups: layout.micro_batches(rows, counts, step.collectives, 1),
        layout.logprob_chunk_tokens,
        step.collectives.world_size > 1,
        layout.packing,
    )
    return DistillationInputs(t.rollout_logp, teacher_logp.to(step.device), t.sampled_mask)
