"""The `rewards` section of an algorithm (`--model.init_args.rewards.<name>`): where correctness comes from, how
much it counts, the user's reward terms, and math-verify's options. The reward is

    r = w_c · c + Σᵢ wᵢ · fᵢ

(DAPO's shaping then applies to it), where correctness c stays what accuracy, REAL's labels and DAPO's mixed
groups read, whatever its weight."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from rlvr_lightning.errors import ConfigError, check_choice

MATH_VERIFY, ENVIRONMENT = "math-verify", "environment"


@dataclass(frozen=True)
class VerifierSettings:
    """math-verify's options (`--model.init_args.rewards.verifier.<name>`).

    num_workers: verifier processes (each completion has a hard wall-clock limit).
    timeout_s: a completion whose verification takes longer is killed (its worker is replaced) and retried once with
        `timeout_retry_factor` times the limit; running out of time again, it scores 0.
    timeout_retry_factor: how much longer that retry may take; 0 scores a completion 0 on its first timeout.
    truncated_is_incorrect: a completion cut at max_response_length (no EOS) scores 0, as in the Dr. GRPO authors' code.
    multiple_boxed: `wrong` requires every boxed answer of a completion to equal the gold (boxing several candidates
        is a cheap way to game a last-box reward); `last` grades the last box only.
    strict: an answer counts only if math-verify reads the whole of it as LaTeX; `false` also accepts what its
        fallbacks pick out of text it cannot parse.
    """

    num_workers: int = 2
    timeout_s: float = 5.0
    timeout_retry_factor: float = 4.0
    truncated_is_incorrect: bool = True
    multiple_boxed: Literal["wrong", "last"] = "wrong"
    strict: bool = True

    def check(self) -> None:
        check_choice("model.rewards.verifier.multiple_boxed", self.multiple_boxed, ("wrong", "last"))
        if self.timeout_retry_factor != 0 and not self.timeout_retry_factor >= 1:
            raise ConfigError(
                f"model.rewards.verifier.timeout_retry_factor={self.timeout_retry_factor!r}; valid: 0 (no retry) or at least 1"
            )
        if self.num_workers < 1 or not self.timeout_s > 0:
            raise ConfigError("model.rewards.verifier: num_workers must be ≥ 1 and timeout_s > 0")


@dataclass(frozen=True)
class RewardFunction:
    """function: the dotted path of `f(completion, gold, metadata) -> float` (or `(float, {metric: value})`);
    weight: wᵢ; name: its metrics' name (default: the function's)."""

    function: str
    weight: float = 1.0
    name: str | None = None

    @property
    def term(self) -> str:
        return self.name or self.function.rpartition(".")[2]


@dataclass(frozen=True)
class RewardSettings:
    """correctness: where c comes from: `math-verify` (the answer against the gold), `environment` (the environment's
        verdict on each answer, in [0, 1]), or the dotted path of your own `f(completion, gold, metadata) -> float`
        in [0, 1] (partial credit, another verifier).
    correctness_weight: w_c; 0 leaves the reward to the functions alone (c is still the accuracy).
    functions: your reward terms, each `{function: module.name, weight: w, name: …}`.
    verifier: math-verify's options, when it gives c.
    """

    correctness: str = MATH_VERIFY
    correctness_weight: float = 1.0
    functions: list[RewardFunction] = field(default_factory=list)
    verifier: VerifierSettings = VerifierSettings()

    def check(self) -> None:
        self.verifier.check()
        if self.correctness not in (MATH_VERIFY, ENVIRONMENT) and "." not in self.correctness:
            raise ConfigError(
                f"model.rewards.correctness={self.correctness!r}; valid: {MATH_VERIFY}, {ENVIRONMENT}, or the dotted path "
                "of your own function f(completion, gold, metadata) -> float in [0, 1]"
            )
        names = [f.term for f in self.functions]
        if len(set(names)) < len(names):
            raise ConfigError(f"model.rewards.functions: give each a distinct name (got {names})")
        if self.correctness_weight == 0 and not self.functions:
            raise ConfigError("model.rewards.correctness_weight=0 with no model.rewards.functions: the reward would be 0")

    @classmethod
    def of(cls, value: RewardSettings | Mapping[str, Any] | None) -> RewardSettings:
        """The section from what a config or a checkpoint's hyper-parameters hold (nested dicts)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"model.rewards: unknown option {unknown[0]!r}; valid: {', '.join(sorted(known))}")
        values = dict(value)
        if isinstance(values.get("verifier"), Mapping):
            values["verifier"] = VerifierSettings(**values["verifier"])
        values["functions"] = [f if isinstance(f, RewardFunction) else RewardFunction(**f) for f in values.get("functions") or []]
        return cls(**values)
