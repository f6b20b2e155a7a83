"""The `shapers` section of an algorithm (`--model.init_args.shapers.<shaper>.<option>`): the stages that reweight
token advantages before the update, each off unless given.

    shapers:
      thr: {p: 0.2}                                      # --model.init_args.shapers.thr.p 0.2
      oar: {method: gradient}                            # --model.init_args.shapers.oar.method gradient
      custom: [{name: my_pkg.MyShaper, knobs: {a: 1}}]   # your `AdvantageShaper` subclass and its arguments

`--model.init_args.shapers '{thr: null}'` turns a preset's THR off (the section's mapping form: once a config file has
set THR, jsonargparse reads `--model.init_args.shapers.thr null` as a class path). The shapers' weights multiply
(docs/algorithms.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from rlvr_lightning.attribution.oar import DEFAULT_CONCLUDE, Readout, SaliencyBaseline
from rlvr_lightning.attribution.thr import ReweightMode, ThresholdMode
from rlvr_lightning.errors import ConfigError, check_choice


@dataclass(frozen=True)
class THRSettings:
    """Token Hidden Reward reweighting (arXiv 2510.03669, docs/algorithms.md#thr): Â' = Â·(1 + p·sign(THR)) on
    dominant tokens (`--model.init_args.shapers.thr.<option>`).

    p: reweighting strength in [−1, 1]; > 0 amplifies THR > 0 tokens (exploitation), < 0 amplifies THR < 0 tokens
        (exploration); 0 with mode=reweight is the base algorithm, exactly.
    threshold: which tokens are dominant: `anchor` (|s| > β·min over correct rollouts of their mean score),
        `quantile` (|THR| ≥ its `quantile` within the group), `absolute` (|THR| > `thr_abs`) or `all`.
    beta_anchor: β of the anchor threshold.
    quantile: quantile of the `quantile` threshold.
    thr_abs: threshold of the `absolute` mode.
    mode: `reweight` keeps non-dominant tokens at Â; `only` zeroes them ("THR-only").
    chunk_size: tokens per LM-head call when rebuilding π_old (bounds memory).
    """

    p: float = 0.0
    threshold: ThresholdMode = "anchor"
    beta_anchor: float = 1.0
    quantile: float = 0.8
    thr_abs: float | None = None
    mode: ReweightMode = "reweight"
    chunk_size: int = 1024

    def check(self) -> None:
        if not -1.0 <= self.p <= 1.0:
            raise ConfigError(f"model.shapers.thr.p={self.p} must lie in [-1, 1], or advantage signs would flip")
        check_choice("model.shapers.thr.threshold", self.threshold, ThresholdMode)
        if self.threshold == "absolute" and self.thr_abs is None:
            raise ConfigError("model.shapers.thr.threshold=absolute needs model.shapers.thr.thr_abs")
        if not 0.0 < self.quantile < 1.0:
            raise ConfigError(f"model.shapers.thr.quantile={self.quantile} must lie in (0, 1)")
        check_choice("model.shapers.thr.mode", self.mode, ReweightMode)
        if self.chunk_size < 1:
            raise ConfigError("model.shapers.thr.chunk_size must be ≥ 1")


@dataclass(frozen=True)
class OARSettings:
    """Outcome-grounded advantage reshaping (arXiv 2601.07408, docs/algorithms.md#oar): reasoning tokens' advantages
    reshaped by how much each moves the model's own final answer (`--model.init_args.shapers.oar.<option>`).

    method: `perturbation` (OAR-P: one forward per reasoning token, from that token on, the quality ceiling) or
        `gradient` (OAR-G: one clean forward and one noisy forward/backward to the embeddings).
    readout: `last`, `answer_mean` or `answer_joint`; null = `last` for P, `answer_mean` for G.
    q: quantile threshold between suppression and boost.
    beta: maximum boost (weights up to 1 + beta before renormalisation).
    floor: minimum weight of suppressed tokens before renormalisation (> 0: every weight stays positive).
    sum_to_len: renormalise so the mean weight over reasoning tokens is 1.
    sigma: OAR-G embedding noise (the KL's gradient is 0 without it).
    chunk_size: sequences per scoring forward (perturbed copies for P, rollouts for G).
    conclude_template: text joining the truncated reasoning to the answer.
    saliency_baseline: OAR-G's gradient × (input − baseline): `zero` (authors) or `pad` (the pad token's embedding:
        a first-order estimate of OAR-P's substitution).
    """

    method: Literal["perturbation", "gradient"] = "gradient"
    readout: Readout | None = None
    q: float = 0.25
    beta: float = 1.0
    floor: float = 0.1
    sum_to_len: bool = True
    sigma: float = 1e-3
    chunk_size: int = 32
    conclude_template: str = DEFAULT_CONCLUDE
    saliency_baseline: SaliencyBaseline = "zero"

    @property
    def readout_used(self) -> Readout:
        return self.readout or ("last" if self.method == "perturbation" else "answer_mean")

    def check(self) -> None:
        check_choice("model.shapers.oar.method", self.method, ("perturbation", "gradient"))
        check_choice("model.shapers.oar.readout", self.readout_used, Readout)
        check_choice("model.shapers.oar.saliency_baseline", self.saliency_baseline, SaliencyBaseline)
        # floor > 0: with floor = 0 the least important reasoning token gets weight exactly 0, and the
        # reshaping must keep every weight positive (it rescales advantages, never removes a token).
        if not 0.0 < self.q < 1.0 or self.beta < 0 or not 0.0 < self.floor <= 1.0 or self.sigma <= 0 or self.chunk_size < 1:
            raise ConfigError("model.shapers.oar needs 0 < q < 1, beta ≥ 0, 0 < floor ≤ 1, sigma > 0, chunk_size ≥ 1")


@dataclass(frozen=True)
class CustomShaper:
    """name: the dotted path of your `rlvr_lightning.context.AdvantageShaper` subclass; knobs: its keyword arguments."""

    name: str
    knobs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ShaperSettings:
    """thr: THR's options, or null (off); oar: OAR's, or null (off); custom: your shapers, each
    `{name: module.Class, knobs: {…}}`."""

    thr: THRSettings | None = None
    oar: OARSettings | None = None
    custom: list[CustomShaper] = field(default_factory=list)

    def check(self) -> None:
        for given in (self.thr, self.oar):
            if given is not None:
                given.check()
        for shaper in self.custom:
            if "." not in shaper.name:
                raise ConfigError(f"model.shapers.custom: name={shaper.name!r} is not the dotted path of a class")

    def names(self) -> tuple[str, ...]:
        """How messages name the shapers given: `model.shapers.thr`, `model.shapers.custom=my_pkg.MyShaper`."""
        given = [f"model.shapers.{key}" for key in ("thr", "oar") if getattr(self, key) is not None]
        return (*given, *(f"model.shapers.custom={c.name}" for c in self.custom))

    @classmethod
    def of(cls, value: ShaperSettings | Mapping[str, Any] | None) -> ShaperSettings:
        """The section from what a config or a checkpoint's hyper-parameters hold (nested dicts)."""
        if value is None or isinstance(value, cls):
            return value or cls()
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"model.shapers: unknown shaper {unknown[0]!r}; valid: {', '.join(sorted(known))}")
        return cls(
            thr=section_of(THRSettings, value.get("thr"), "model.shapers.thr"),
            oar=section_of(OARSettings, value.get("oar"), "model.shapers.oar"),
            custom=[c if isinstance(c, CustomShaper) else CustomShaper(**c) for c in value.get("custom") or []],
        )


def section_of(cls: type, value: Any, where: str) -> Any:
    """One shaper's options from a dataclass, a dict or None (off); an unknown option is one error line."""
    if value is None or isinstance(value, cls):
        return value
    try:
        return cls(**dict(value))
    except TypeError as e:
        raise ConfigError(f"{where}: {e}; its options are {', '.join(f.name for f in fields(cls))}") from None
