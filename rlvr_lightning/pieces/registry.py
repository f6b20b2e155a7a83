"""Registries of algorithm pieces: one pure function per choice, registered under a name.

An algorithm is a choice of pieces, one per kind (`KINDS`), selected by config keys on every module
(`--model.init_args.policy_loss gspo-token`). A piece's knobs are its keyword-only parameters: when
the module binds a piece it passes the module's hyper-parameter of the same name (`clip_eps_high`),
else the entry of `piece_args` (`--model.init_args.piece_args '{my_knob: 3}'`), else the
function's own default; a knob with none of these is a configuration error.

A user's piece lives in the user's own module and is named in the config by its dotted path:

    # my_pieces.py
    from rlvr_lightning.pieces import advantage_estimators

    @advantage_estimators.register("rank", anchor=None)
    def rank_advantage(inputs, *, rank_scale: float = 1.0): ...

    --model.init_args.advantage_estimator my_pieces.rank_advantage

Importing `my_pieces` registers it; the name `rank` then works too. An unknown name is an error
that lists the registered ones, raised while the config is parsed (`PieceName` types).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from rlvr_lightning.errors import ConfigError

DOCS = "docs/algorithms.md"


@dataclass(frozen=True)
class Piece:
    name: str
    fn: Callable
    kind: str
    anchor: str | None  # section of docs/algorithms.md, None for a user's piece
    traits: Mapping[str, Any] = field(default_factory=dict)  # what the step must know (e.g. a loss's level)

    @property
    def summary(self) -> str:
        return (inspect.getdoc(self.fn) or "").split("\n")[0]

    @property
    def knobs(self) -> tuple[str, ...]:
        """The keyword-only parameters of its function and of its function traits (a loss's token selection)."""
        names: dict[str, None] = {}
        for fn in (self.fn, *(v for v in self.traits.values() if callable(v))):
            params = inspect.signature(fn).parameters.values()
            names.update((p.name, None) for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)
        return tuple(names)

    @property
    def docs(self) -> str:
        return f"{DOCS}#{self.anchor}" if self.anchor else inspect.getmodule(self.fn).__name__

    def bind(self, values: Mapping[str, Any], piece_args: Mapping[str, Any] | None = None) -> Callable:
        """The function with its knobs fixed from `values` (the module's hyper-parameters), then
        `piece_args`, then its own defaults."""
        return bind_knobs(self.fn, f"{self.kind} {self.name!r}", values, piece_args)

    def __getitem__(self, trait: str) -> Any:
        return self.traits[trait]


def bind_knobs(fn: Callable, what: str, values: Mapping[str, Any], piece_args: Mapping[str, Any] | None) -> Callable:
    """`fn` with each keyword-only parameter fixed from `values`, else `piece_args`, else its default."""
    piece_args = piece_args or {}
    knobs = {}
    for p in inspect.signature(fn).parameters.values():
        if p.kind is not inspect.Parameter.KEYWORD_ONLY:
            continue
        if p.name in values:
            knobs[p.name] = values[p.name]
        elif p.name in piece_args:
            knobs[p.name] = piece_args[p.name]
        elif p.default is inspect.Parameter.empty:
            raise ConfigError(f"{what} needs the knob {p.name!r}: set it with --model.init_args.piece_args '{{{p.name}: …}}'")
    return partial(fn, **knobs)


class Registry:
    """The pieces of one kind, by name."""

    def __init__(self, kind: str, flag: str, description: str, traits: Mapping[str, Any] | None = None) -> None:
        self.kind, self.flag, self.description = kind, flag, description
        self.default_traits = dict(traits or {})
        self._pieces: dict[str, Piece] = {}

    def register(self, name: str, *, anchor: str | None, **traits: Any) -> Callable[[Callable], Callable]:
        """Decorator: register `fn` under `name` (a name may be registered once)."""
        unknown = set(traits) - set(self.default_traits)
        if unknown:
            raise TypeError(f"{self.kind} traits are {sorted(self.default_traits)}, not {sorted(unknown)}")

        def add(fn: Callable) -> Callable:
            existing = self._pieces.get(name)
            if existing is not None and existing.fn is not fn:
                raise ValueError(f"{self.kind} {name!r} is registered already ({existing.fn.__module__})")
            self._pieces[name] = Piece(name, fn, self.kind, anchor, {**self.default_traits, **traits})
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
                raise ConfigError(f"{self.flag}={name!r}: cannot import it ({type(err).__name__}: {err})") from None
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
