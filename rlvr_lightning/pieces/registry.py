"""Registries of algorithm pieces: one pure function per choice, registered under a name.

An algorithm is a choice of pieces, one per kind (`KINDS`), each named in the config with its knobs
(`rlvr_lightning.pieces.choices`): `--model.init_args.policy_loss.name gspo-token`. A piece's knobs are its
functions' keyword-only parameters, declared when it is registered (`rlvr_lightning.pieces.knobs`); the config gives
them in the piece's own section (`--model.init_args.policy_loss.knobs.clip_eps_high 0.28`), and a knob it does not
give runs at the function's default. A knob the piece does not declare, a knob without a default that is not given,
and a value the knob's annotation does not take (`None` for a `float`) are configuration errors.

A user's piece lives in the user's own module and is named in the config by its dotted path:

    # my_pieces.py
    from rlvr_lightning.pieces import advantage_estimators

    @advantage_estimators.register("rank", anchor=None)
    def rank_advantage(inputs, *, rank_scale: float = 1.0): ...

    --model.init_args.advantage_estimator.name my_pieces.rank_advantage
    --model.init_args.advantage_estimator.knobs.rank_scale 2.0

Importing `my_pieces` registers it; the name `rank` then works too. An unknown name is an error
that lists the registered ones, raised while the config is parsed (`PieceName` types).

A piece checks its own knobs with `check=`: a function of the same keyword-only knobs (any subset) that
raises `ValueError` saying what is wrong. It runs when the piece is bound (the module's construction),
so a bad value is a one-line `ConfigError` naming the piece and where the value came from. A check
that also names a run setting of `RUN_SETTINGS` (`group_size`) runs at fit start, once it is known:

    def check_rank_scale(*, rank_scale: float) -> None:
        if rank_scale <= 0:
            raise ValueError(f"rank_scale must be > 0, got {rank_scale}")

    @advantage_estimators.register("rank", anchor=None, check=check_rank_scale)
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from rlvr_lightning.errors import ConfigError
from rlvr_lightning.pieces.knobs import WRAPPED, Knobs

DOCS = "docs/algorithms.md"


@dataclass(frozen=True)
class Piece:
    name: str
    fn: Callable
    kind: str
    anchor: str | None  # section of docs/algorithms.md, None for a user's piece
    traits: Mapping[str, Any] = field(default_factory=dict)  # what the step must know (e.g. a loss's level)
    check: Callable | None = None  # the knobs' own check: fn(*, knobs…) raising ValueError (see the module doc)
    flag: str = ""  # the config key that selects it (`model.policy_loss`)
    declared: Knobs = field(default_factory=lambda: Knobs({}, {}))  # its knobs, read from its functions at registration

    @property
    def summary(self) -> str:
        return (inspect.getdoc(self.fn) or "").split("\n")[0]

    @property
    def functions(self) -> tuple[Callable, ...]:
        """Its function and its function traits (a loss's token selection): what runs with the knobs bound."""
        return (self.fn, *(v for v in self.traits.values() if callable(v)))

    @property
    def knobs(self) -> tuple[str, ...]:
        """The names of its knobs (its functions' and its check's keyword-only parameters, less the run settings
        and the bound piece it wraps)."""
        return self.declared.names

    @property
    def docs(self) -> str:
        return f"{DOCS}#{self.anchor}" if self.anchor else inspect.getmodule(self.fn).__name__

    @property
    def what(self) -> str:
        return f"{self.flag}={self.name}" if self.flag else f"{self.kind} {self.name!r}"

    def knob_values(self, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Every knob's value as the piece runs with it: `given`'s (the config's), else its default."""
        return self.declared.values(given, self.what, self.flag.replace("model.", "model.init_args.", 1))

    def wrapped(self, given: Mapping[str, Any] | None = None) -> Piece | None:
        """The piece of its kind this one runs inside it, named by its knob `traits["wraps"]` (on-policy
        distillation's `opd_reward`), or None. That piece runs, and is checked, with `wrapped_knobs`."""
        knob = self.traits.get("wraps")
        if knob is None:
            return None
        return self.traits["wraps_in"].get(self.knob_values(given)[knob])

    def wrapped_knobs(self, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The knobs of the piece it wraps, from its knob `traits["wraps_knobs"]` (`opd_reward_knobs`); {} (that
        piece's defaults) when none are given."""
        knob = self.traits.get("wraps_knobs")
        return dict(self.knob_values(given).get(knob) or {}) if knob else {}

    def bind(self, given: Mapping[str, Any] | None = None, fn: Callable | None = None) -> Callable:
        """Its function (or `fn`, one of its function traits) with its knobs fixed from `given` (the config's
        knobs of this piece) and its own defaults, after its check ran on them (see `check_knobs`)."""
        self.check_knobs(given)
        values = self.knob_values(given)
        target = self.fn if fn is None else fn
        bound = partial(target, **self.declared.of_function(target, values))
        inner = self.wrapped(given) if fn is None else None
        return bound if inner is None else partial(bound, **{WRAPPED: inner.bind(self.wrapped_knobs(given))})

    def check_knobs(self, given: Mapping[str, Any] | None = None, run: Mapping[str, Any] | None = None) -> None:
        """Run the piece's `check` on its knobs; one that names a run setting only when `run` gives it.
        Its ValueError becomes a one-line ConfigError naming the piece and where each value came from."""
        if self.check is None:
            return
        needs = self.declared.run_settings
        if any(name not in (run or {}) for name in needs):
            return  # at fit start, when the run settings are known
        values = self.knob_values(given)
        knobs = {**self.declared.of_function(self.check, values), **{k: run[k] for k in needs}}
        try:
            self.check(**knobs)
        except ValueError as err:
            given = given or {}
            source = {k: ("given" if k in given else "its default") for k in values} | dict.fromkeys(needs, "the run")
            sources = ", ".join(f"{k}={v!r} ({source[k]})" for k, v in knobs.items())
            raise ConfigError(f"{self.what}: {err} [{sources}]") from None

    def __getitem__(self, trait: str) -> Any:
        return self.traits[trait]


class Registry:
    """The pieces of one kind, by name."""

    def __init__(self, kind: str, flag: str, description: str, traits: Mapping[str, Any] | None = None) -> None:
        self.kind, self.flag, self.description = kind, flag, description
        self.default_traits = dict(traits or {})
        self._pieces: dict[str, Piece] = {}

    def register(
        self, name: str, *, anchor: str | None, check: Callable | None = None, **traits: Any
    ) -> Callable[[Callable], Callable]:
        """Decorator: register `fn` under `name` (a name may be registered once); `check`: the knobs' own check."""
        unknown = set(traits) - set(self.default_traits)
        if unknown:
            raise TypeError(f"{self.kind} traits are {sorted(self.default_traits)}, not {sorted(unknown)}")

        def add(fn: Callable) -> Callable:
            existing = self._pieces.get(name)
            if existing is not None and existing.fn is not fn:
                raise ValueError(f"{self.kind} {name!r} is registered already ({existing.fn.__module__})")
            piece = Piece(name, fn, self.kind, anchor, {**self.default_traits, **traits}, check, self.flag)
            self._pieces[name] = replace(piece, declared=Knobs.of(piece.functions, check))  # read once, here
            return fn

        return add

    @property
    def key(self) -> str:
        """The hyper-parameter that selects the piece (`policy_loss` of `model.policy_loss`)."""
        return self.flag.rpartition(".")[2]

    def selected(self, values: Mapping[str, Any]) -> Piece:
        """The piece `values` (an algorithm's arguments: `values[key]` a choice, a name or a mapping) select."""
        return self.get(chosen_name(values[self.key]))

    def bound(self, values: Mapping[str, Any]) -> Callable:
        """The selected piece with the knobs its choice gives."""
        return self.selected(values).bind(chosen_knobs(values[self.key]))

    def names(self) -> list[str]:
        return list(self._pieces)

    def pieces(self) -> list[Piece]:
        return list(self._pieces.values())

    def get(self, name: str) -> Piece:
        """The piece registered as `name`, or the function at the dotted path `name` (whose module is
        imported, which registers it)."""
        if name in self._pieces:
            return self._pieces[name]
        if "." in name:
            module_name, _, attr = name.rpartition(".")
            try:
                fn = getattr(importlib.import_module(module_name), attr)
            except (ImportError, AttributeError) as err:
                hint = (f"; put the directory that holds {module_name.split('.')[0]!r} on PYTHONPATH"
                        if isinstance(err, ModuleNotFoundError) and err.name == module_name.split(".")[0] else "")
                raise ConfigError(f"{self.flag}={name!r}: cannot import it ({type(err).__name__}: {err}){hint}") from None
            for piece in self._pieces.values():
                if piece.fn is fn:
                    return piece
            raise ConfigError(
                f"{self.flag}={name!r} is not a registered {self.kind}: decorate it with "
                f"rlvr_lightning.pieces.{self.registry_name}.register(name, anchor=…)"
            )
        raise ConfigError(f"{self.flag}={name!r}; registered: {', '.join(self.names())} (or a dotted path to your own)")

    @property
    def plural(self) -> str:
        if self.kind.endswith("y"):  # proximal policy → proximal policies
            return self.kind[:-1] + "ies"
        return self.kind + ("es" if self.kind.endswith("s") else "s")

    @property
    def registry_name(self) -> str:
        """The registry's name in `rlvr_lightning.pieces` (`policy_losses`)."""
        return self.plural.lower().replace(" ", "_")


def chosen_name(value: Any) -> str:
    """The piece name of a choice (`pieces.choices.PieceChoice` or its mapping) or of a bare name."""
    if value is None or isinstance(value, str):
        return value
    return value.get("name") if isinstance(value, Mapping) else value.name


def chosen_knobs(value: Any) -> Mapping[str, Any]:
    """The knobs a choice (or its mapping) gives; a bare name gives none."""
    if value is None or isinstance(value, str):
        return {}
    return (value.get("knobs") if isinstance(value, Mapping) else value.knobs) or {}


def name_type(registry: Registry, type_name: str, module: str) -> type[str]:
    """A `str` subtype for a signature's annotation: LightningCLI checks its values against
    `registry` while parsing the config, so an unknown name fails before anything is built. Assign
    it to `type_name` in `module` (so that it pickles)."""
    from jsonargparse.typing import register_type

    doc = f"The name (or dotted path) of a registered {registry.kind}."
    cls = type(type_name, (str,), {"__doc__": doc, "__module__": module, "__qualname__": type_name})

    def parse(value: str) -> str:
        if not isinstance(value, str):
            raise ValueError(f"{registry.flag} takes a name, got {value!r}")
        registry.get(value)
        return cls(value)

    register_type(cls, serializer=str, deserializer=parse)
    return cls
