"""The rollout engine of one run and what lives beside it: the engine (built on first use from an
`EngineSpec`), the weight sync with its probe and the policy version the engine holds, the rollout stream
generating ahead (`rollout.stream.max_staleness`) with the batches a checkpoint carries, and closing them.

A plain object: the module makes one and hands it the spec once its policy exists; the step's context holds
it, the planner's and the doctor's derivations build their own engines from the same functions
(`engine_setup`), and nothing here calls back into the LightningModule.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from typing import Any

from rlvr_lightning.environments.base import Environment
from rlvr_lightning.models.forward import sequence_logprobs
from rlvr_lightning.models.weights import full_weights, load_into_engine
from rlvr_lightning.rollout.engine import LogprobsFn, RolloutEngine
from rlvr_lightning.rollout.sync import FP32_SYNC_TOL, EngineSync, default_sync_tol
from rlvr_lightning.rollout.types import PromptBatch, Rollout
from rlvr_lightning.training.engine_setup import EngineSpec, build_rollout_engine
from rlvr_lightning.training.rollout_stream import RolloutStream
from rlvr_lightning.training.step_metrics import StageTimer
from rlvr_lightning.training.throughput_stream import ThroughputStream

Stream = RolloutStream | ThroughputStream
# The prompts rollout batch `index` generates, given the step's context (DAPO adds its first round's).
PromptsFn = Callable[[Any, int], PromptBatch]


class EngineSession:
    def __init__(self) -> None:
        self.sync = EngineSync(tol=FP32_SYNC_TOL)  # the run's tolerance and cadence once attached
        self.policy_version = 0  # weight syncs so far: the engine runs this version of the policy
        self.stream: Stream | None = None
        self.spec: EngineSpec | None = None
        self._stream_state: dict | None = None  # a checkpoint's batches in flight, until the stream is built
        self._engine: RolloutEngine | None = None
        self._environment: Environment | None = None
        self._making_environment = threading.Lock()

    def attach(self, spec: EngineSpec) -> None:
        """What the engine is built from and synced with (the policy exists from here on); the sync probe's
        tolerance (`rollout.sync.check_tol`; None: what the two sides' precision allows) and cadence."""
        self.spec = spec
        checked = spec.rollout.sync
        tol = default_sync_tol(spec.engine_dtype, spec.trainer_dtype) if checked.check_tol is None else checked.check_tol
        self.sync = EngineSync(tol=tol, check_every=checked.check_every)

    @property
    def engine(self) -> RolloutEngine:
        """This rank's engine, built on first use (a stage that generates nothing starts none)."""
        if self._engine is None:
            s = self.spec
            if s is None:
                raise RuntimeError("the engine session has no spec yet: attach() it once the policy is built")
            self._engine = build_rollout_engine(s, self.trainer_logprobs)
        return self._engine

    @engine.setter
    def engine(self, engine: RolloutEngine) -> None:
        """Use `engine` (one built elsewhere: a bench's, a test's stand-in server)."""
        self._engine = engine

    @property
    def environment(self) -> Environment | None:
        """The environment the answers are generated in (`data.tool`, `data.environment`), made on first use
        (the tool's sandbox starts then); None: one segment per answer."""
        with self._making_environment:  # the throughput stream's request threads may ask first, at once
            if self._environment is None and self.spec is not None:
                self._environment = self.spec.make_environment()
        return self._environment

    @property
    def trainer_logprobs(self) -> LogprobsFn:
        """The trainer's log-probs of one sequence, in the update's LM-head chunks: the probe's trainer side, and
        the HF engine's own scoring."""
        return partial(sequence_logprobs, self.spec.policy, chunk_tokens=self.spec.chunk_tokens)

    def built(self) -> dict[str, Any]:
        """What of the session exists now, by name, without building anything (the watchdog's report)."""
        return {"engine": self._engine, "rollout stream": self.stream, "environment": self._environment}

    @property
    def shared_by_ranks(self) -> bool:
        return bool(getattr(self.engine, "shared_by_ranks", False))

    def load(self, version: int) -> None:
        """Hand the policy to the engine as `version`: its full weights, or its LoRA adapter."""
        s = self.spec
        load_into_engine(self.engine, s.policy, version, s.lora, s.policy_path)

    def after_sync(self) -> None:
        """Called by every rank after it handed its weights to the engine. Servers the ranks share are
        written by rank 0 alone, so no rank samples or probes them before that write is done. (Under FSDP
        the weight gather already orders the ranks, since rank 0 pauses the servers before it and a paused
        server holds new requests; this keeps the order where no gather is needed.)"""
        if self.shared_by_ranks and self.spec.barrier is not None:
            self.spec.barrier()

    def start(self) -> None:
        """At the start of training: hand the engine the policy where it may not hold it: a resumed run (the
        engine has the base weights), attached servers (any weights), or an adapter sync (every request then
        carries one, starting from the initial zero adapter)."""
        lora = self.spec.lora
        foreign = getattr(self.engine, "holds_foreign_weights", False)
        adapter = lora is not None and lora.sync == "adapter"
        if foreign and adapter:  # the base under the adapter; every rank takes part in the gather
            self.engine.load_weights(full_weights(self.spec.policy, merged=False), version=self.policy_version)
        if self.policy_version > 0 or foreign or adapter:
            self.load(self.policy_version)
            self.after_sync()

    def sync_weights(self, rollout: Rollout, timer: StageTimer) -> None:
        """After an update: wait for the stream's segment in flight, hand the engine the next version, probe
        it against the trainer on `rollout`'s probe sequence, and let the stream generate with it."""
        if self.stream is not None:
            self.stream.wait(timer)  # the servers take new weights between segments only
        with timer("weight_sync"):
            self.sync.sync(self.engine, self.load, self.policy_version + 1, rollout, self.trainer_logprobs)
            self.after_sync()
            self.policy_version += 1
        if self.stream is not None:
            self.stream.synced(self.policy_version)

    def rollout_stream(self, rollout: Any, prompts: PromptsFn) -> Stream:
        """The stream of rollouts generated ahead (`rollout`: the `rollout:` settings), built on first use
        with a checkpoint's batches in flight."""
        if self.stream is None:
            ahead = rollout.stream
            if ahead.mode == "throughput":
                self.stream = ThroughputStream(ahead.max_staleness, ahead.partial_rollouts, ahead.stale_groups == "hold", prompts)
            else:
                self.stream = RolloutStream(ahead.max_staleness, ahead.partial_rollouts, prompts)
            if self._stream_state is not None:
                self.stream.load_state_dict(self._stream_state)
                self._stream_state = None
        return self.stream

    def close(self) -> None:
        for part in (self.stream, self._engine, self._environment):  # the batches ahead are generated on the engine: first
            if part is not None:
                part.close()
        self.stream, self._engine, self._environment = None, None, None

    def state_dict(self) -> dict:
        """The policy version, and the stream's batches in flight (a resumed run continues them)."""
        state: dict = {"policy_version": self.policy_version}
        if self.stream is not None:
            state["rollout_stream"] = self.stream.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.policy_version = state.get("policy_version", 0)
        self._stream_state = state.get("rollout_stream")
