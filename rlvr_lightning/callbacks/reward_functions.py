"""RewardFunctions: your own reward terms, added to the verifier's, with no callback of your own to write.

A reward function is any Python function `f(completion, gold, metadata) -> float` (or `(float, {metric: value})`),
in your module on PYTHONPATH:

    --trainer.callbacks+=rlvr_lightning.callbacks.reward_functions.RewardFunctions
    --trainer.callbacks.functions='[{function: my_rewards.brevity, weight: 0.1}]'

The reward is r = c + Σᵢ wᵢ·fᵢ (DAPO's shaping then applies to it); correctness c stays the verifier's (accuracy,
REAL's labels, DAPO's mixed groups). Each term is logged on its own: `train/reward_<name>_mean` (fᵢ unweighted),
and a function's own metrics as `train/reward_<name>_<metric>`. `metadata`: the problem's `id`, the `prompt`,
whether the completion was `truncated`, its `response_tokens`. A function that cannot be imported or that fails
on a completion stops the run with one line naming it (at the first rollout batch: nothing is lost).
"""

from __future__ import annotations

import importlib
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

import lightning as L
import torch

from rlvr_lightning.callbacks.rollout import RolloutCallback
from rlvr_lightning.context import StepContext
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.rollout.types import Rollout, Verdict


@dataclass(frozen=True)
class RewardFunction:
    """function: the dotted path of `f(completion, gold, metadata)`; weight: wᵢ; name: its metrics' name (default:
    the function's)."""

    function: str
    weight: float = 1.0
    name: str | None = None


def load_function(path: str, who: str = "RewardFunctions") -> Callable:
    """The function (or class) a user names by dotted path; `who` names the option in a one-line error."""
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ConfigError(f"{who}: {path!r} is not a dotted path (module.name)")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        hint = "; put its directory on PYTHONPATH" if isinstance(err, ModuleNotFoundError) else ""
        raise ConfigError(f"{who}: cannot import {path!r} ({type(err).__name__}: {err}){hint}") from None
    if not callable(fn):
        raise ConfigError(f"{who}: {path!r} is not a function")
    return fn


class RewardFunctions(RolloutCallback):
    def __init__(self, functions: list[RewardFunction]) -> None:
        """
        Args:
            functions: the reward functions, each `{function: module.name, weight: w, name: …}`.
        """
        self.functions = [f if isinstance(f, RewardFunction) else RewardFunction(**f) for f in functions]
        names = [f.name or f.function.rpartition(".")[2] for f in self.functions]
        if not self.functions or len(set(names)) < len(names):
            raise ConfigError(f"RewardFunctions.functions: give at least one, with distinct names (got {names})")
        self.names = names
        self._loaded: list[Callable] | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.loaded()  # an import error is a one-line error before anything runs

    def loaded(self) -> list[Callable]:
        if self._loaded is None:
            self._loaded = [load_function(f.function) for f in self.functions]
        return self._loaded

    def on_rollout_generated(self, step: StepContext, rollout: Rollout) -> Verdict:
        texts, golds = rollout.answer_texts, rollout.answers_per_sequence
        truncated = rollout.truncated.tolist()
        terms, metrics = {}, {}
        for spec, name, fn in zip(self.functions, self.names, self.loaded()):
            values, extra = [], {}
            for n in range(rollout.num_sequences):
                b = rollout.group_of(n)
                metadata = {"id": rollout.batch.ids[b], "prompt": rollout.batch.prompts[b], "truncated": truncated[n],
                            "response_tokens": len(rollout.completions[n].token_ids)}  # fmt: skip
                try:
                    out = fn(texts[n], golds[n], metadata)
                except Exception as err:  # the user's function, not the library: said in one line, naming it
                    raise ConfigError(f"reward function {spec.function} failed on a completion ({type(err).__name__}: {err})") from None
                value, own = out if isinstance(out, tuple) else (out, {})
                if not isinstance(value, numbers.Real) or not math.isfinite(value):
                    raise ConfigError(f"reward function {spec.function} returned {value!r}: a reward must be a finite number")
                values.append(float(value))
                for key, v in own.items():
                    extra.setdefault(key, []).append(float(v))
            raw = torch.tensor(values)
            terms[name] = spec.weight * raw
            metrics[f"reward_{name}_mean"] = raw.mean().item()
            metrics.update({f"reward_{name}_{key}": sum(v) / len(v) for key, v in extra.items()})
        return Verdict(None, metrics, terms)
