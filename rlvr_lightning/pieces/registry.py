"""Registries of algorithm pieces: one pure function per choice, registered under a name.

An algorithm is a choice of pieces, one per kind (`KINDS`), selected by config keys on every module
(`--model.init_args.policy_loss gspo-token`). A piece's knobs are its keyword-only parameters: when
the module binds a piece it passes the algorithm's argument of the same name (`clip_eps_high`) where the
algorithm sets it (`AlgorithmArgs`: an argument left at the library's default does not override a piece's
own default), else the entry of `piece_args` (`--model.init_args.piece_args '{my_knob: 3}'`), else the
function's own default; a knob with none of these is a configuration error, and so is a value the knob's
annotation does not take (`None` for a `float`).

A user's piece lives in the user's own module and is named in the config by its dotted path:

    # my_pieces.py
    from rlvr_lightning.pieces import advantage_estimators

    @advantage_estimators.register("rank", anchor=None)
    def rank_advantage(inputs, *, rank_scale: float = 1.0): ...

    --model.init_args.advantage_estimator my_pieces.rank_advantage

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
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, Union

from rlvr_lightning.errors import ConfigError

DOCS = "docs/algorithms.md"


# Settings of the run (not knobs) that a piece's `check` may name; known at fit start.
RUN_SETTINGS = ("group_size", "max_response_length")
# The keyword a piece that wraps another (`traits["wraps"]`) is given that piece by, bound: not a knob.
WRAPPED = "wrapped"


@dataclass(frozen=True)
class Piece:
    name: str
    fn: Callable
    kind: str
    anchor: str | None  # section of docs/algorithms.md, None for a user's piece
    traits: Mapping[str, Any] = field(default_factory=dict)  # what the step must know (e.g. a loss's level)
    check: Callable | None = None  # the knobs' own check: fn(*, knobs…) raising ValueError (see the module doc)
    flag: str = ""  # the config key that selects it (`model.policy_loss`)

    @property
    def summary(self) -> str:
        return (inspect.getdoc(self.fn) or "").split("\n")[0]

    @property
    def functions(self) -> tuple[Callable, ...]:
        """Its function and its function traits (a loss's token selection): what runs with the knobs bound."""
        return (self.fn, *(v for v in self.traits.values() if callable(v)))

    @property
    def knobs(self) -> tuple[str, ...]:
        """The keyword-only parameters of its functions and of its check (less the run settings, and the
        bound piece it wraps)."""
        names: dict[str, None] = {}
        for fn in self.functions:
            names.update((name, None) for name in keyword_only(fn) if name != WRAPPED)
        if self.check is not None:
            names.update((name, None) for name in keyword_only(self.check) if name not in RUN_SETTINGS)
        return tuple(names)

    def wrapped(self, values: Mapping[str, Any], piece_args: Mapping[str, Any] | None = None) -> Piece | None:
        """The piece of its kind this one runs inside it, named by its knob `traits["wraps"]` (on-policy
        distillation's `opd_reward`), or None. That piece runs with its own knobs and checks, from the same
        `values` and `piece_args`, as if it were selected itself."""
        knob = self.traits.get("wraps")
        if knob is None:
            return None
        return self.traits["wraps_in"].get(self.knob_values(values, piece_args)[knob])

    @property
    def docs(self) -> str:
        return f"{DOCS}#{self.anchor}" if self.anchor else inspect.getmodule(self.fn).__name__

    @property
    def what(self) -> str:
        return f"{self.flag}={self.name}" if self.flag else f"{self.kind} {self.name!r}"

    def resolved_knobs(self, values: Mapping[str, Any], piece_args: Mapping[str, Any] | None = None) -> dict[str, tuple[Any, str]]:
        """Every knob of its functions with its value as the piece runs with it and where that came from
        (`resolved_knobs`): `values` (the algorithm's arguments), then `piece_args`, then the function's default."""
        knobs = {}
        for fn in self.functions:
            knobs.update(resolved_knobs(fn, self.what, values, piece_args))
        return knobs

    def knob_values(self, values: Mapping[str, Any], piece_args: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Every knob's value as the piece runs with it."""
        return {name: value for name, (value, _) in self.resolved_knobs(values, piece_args).items()}

    def bind(self, values: Mapping[str, Any], piece_args: Mapping[str, Any] | None = None) -> Callable:
        """The function with its knobs fixed from `values` (the module's hyper-parameters), then
        `piece_args`, then its own defaults; its check run on them (see `check_knobs`)."""
        self.check_knobs(values, piece_args)
        fn = bind_knobs(self.fn, self.what, values, piece_args)
        inner = self.wrapped(values, piece_args)
        return fn if inner is None else partial(fn, **{WRAPPED: inner.bind(values, piece_args)})

    def check_knobs(
        self,
        values: Mapping[str, Any],
        piece_args: Mapping[str, Any] | None = None,
        run: Mapping[str, Any] | None = None,
    ) -> None:
        """Run the piece's `check` on its knobs; one that names a run setting only when `run` gives it.
        Its ValueError becomes a one-line ConfigError naming the piece and where each value came from."""
        if self.check is None:
            return
        needs = [name for name in keyword_only(self.check) if name in RUN_SETTINGS]
        if any(name not in (run or {}) for name in needs):
            return  # at fit start, when the run settings are known
        own = self.resolved_knobs(values, piece_args)
        resolved = {**{k: v for k, (v, _) in own.items()}, **{k: run[k] for k in needs}}  # the function's defaults too
        knobs = knob_values(self.check, self.what, resolved, piece_args)
        try:
            self.check(**knobs)
        except ValueError as err:
            source = {**{k: s for k, (_, s) in own.items()}, **dict.fromkeys(needs, "the run")}
            sources = ", ".join(f"{k}={v!r} ({source.get(k, 'its default')})" for k, v in knobs.items())
            raise ConfigError(f"{self.what}: {err} [{sources}]") from None

    def __getitem__(self, trait: str) -> Any:
        return self.traits[trait]


def keyword_only(fn: Callable) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]


class AlgorithmArgs(dict):
    """An algorithm's arguments, with the library's default of each (`defaults`): an argument still at its
    default is not set on purpose, so it feeds only the knobs that have no default of their own. A researcher's
    loss with `dual_clip_c: float = 3.0` then runs with 3.0 until the user sets `--model.init_args.dual_clip_c`."""

    def __init__(self, values: Mapping[str, Any], defaults: Mapping[str, Any]) -> None:
        super().__init__(values)
        self.defaults = dict(defaults)


def sets(values: Mapping[str, Any], name: str) -> bool:
    """Whether `values` sets `name` on purpose: it holds it, at another value than the library's default
    (a plain mapping sets everything it holds)."""
    defaults = getattr(values, "defaults", {})
    return name in values and (name not in defaults or values[name] != defaults[name])


def resolved_knobs(
    fn: Callable, what: str, values: Mapping[str, Any], piece_args: Mapping[str, Any] | None
) -> dict[str, tuple[Any, str]]:
    """Each keyword-only parameter of `fn` with its value and where it came from (as the user would set it): the
    algorithm's argument where it sets it, or where the knob has no default; else `piece_args`; else the
    knob's default. A value the knob's annotation does not take is a ConfigError."""
    piece_args = piece_args or {}
    hints = annotations_of(fn)
    knobs = {}
    for p in inspect.signature(fn).parameters.values():
        if p.kind is not inspect.Parameter.KEYWORD_ONLY:
            continue
        own = p.default is not inspect.Parameter.empty
        if p.name in values and (sets(values, p.name) or not own):
            value, source = values[p.name], f"--model.init_args.{p.name}"
        elif p.name in piece_args:
            value, source = piece_args[p.name], "from piece_args"
        elif own:
            value, source = p.default, "its default"
        else:
            raise ConfigError(f"{what} needs the knob {p.name!r}: set it with --model.init_args.piece_args '{{{p.name}: …}}'")
        if p.name in hints and not accepts(hints[p.name], value):
            raise ConfigError(f"{what}: its knob {p.name} takes {type_name(hints[p.name])}, got {value!r} ({source})")
        knobs[p.name] = (value, source)
    return knobs


def knob_values(fn: Callable, what: str, values: Mapping[str, Any], piece_args: Mapping[str, Any] | None) -> dict[str, Any]:
    """Each keyword-only parameter of `fn` as it runs (`resolved_knobs` without the sources)."""
    return {name: value for name, (value, _) in resolved_knobs(fn, what, values, piece_args).items()}


def bind_knobs(fn: Callable, what: str, values: Mapping[str, Any], piece_args: Mapping[str, Any] | None) -> Callable:
    """`fn` with each knob fixed from the algorithm's arguments or `piece_args`; defaults stay the function's."""
    knobs = resolved_knobs(fn, what, values, piece_args)
    return partial(fn, **{k: v for k, (v, source) in knobs.items() if source != "its default"})


def annotations_of(fn: Callable) -> dict[str, Any]:
    """`fn`'s resolved annotations; none where they cannot be resolved (a user's piece may name types it
    imports only for checkers)."""
    try:
        return typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 (any failure to resolve: the knobs then go unchecked, as before)
        return {}


def accepts(annotation: Any, value: Any) -> bool:
    """Whether a knob annotated `annotation` takes `value`: None, unions, literals and the scalar types are
    checked; anything else (containers, classes) is left to the piece's own `check`. Written here because
    jsonargparse's type checker is private and pydantic is not on every machine the trainer runs on."""
    origin = typing.get_origin(annotation)
    if annotation is Any:
        return True
    if annotation is None or annotation is type(None):
        return value is None
    if origin in (Union, types.UnionType):
        return any(accepts(arg, value) for arg in typing.get_args(annotation))
    if origin is Literal:
        return value in typing.get_args(annotation)
    if annotation is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation in (bool, str):
        return isinstance(value, annotation)
    return True


def type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


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
            self._pieces[name] = Piece(name, fn, self.kind, anchor, {**self.default_traits, **traits}, check, self.flag)
            return fn

        return add

    @property
    def key(self) -> str:
        """The hyper-parameter that selects the piece (`policy_loss` of `model.policy_loss`)."""
        return self.flag.rpartition(".")[2]

    def selected(self, values: Mapping[str, Any]) -> Piece:
        """The piece `values` (an algorithm's hyper-parameters) select."""
        return self.get(values[self.key])

    def bound(self, values: Mapping[str, Any]) -> Callable:
        """The selected piece with its knobs from `values` (and `values["piece_args"]`)."""
        return self.selected(values).bind(values, values.get("piece_args"))

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
