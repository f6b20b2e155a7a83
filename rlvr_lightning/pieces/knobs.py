"""A piece's knobs: declared once, when the piece is registered, by its functions' keyword-only parameters (name,
type, default), and given per piece in the config, in the piece's own section:

    policy_loss:
      name: ppo-clip
      knobs: {clip_eps_high: 0.28}      # --model.init_args.policy_loss.knobs.clip_eps_high 0.28

`Knobs.values` checks what the config gives against the declaration (a knob the piece does not read, a value its
type does not take, a knob without a default that is not given: one error line each) and returns every knob's value
as the piece runs with it; the piece's functions are then called with their own knobs as keyword arguments.
Nothing else feeds a knob: not an argument of the algorithm, not a knob of another piece.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Union

from rlvr_lightning.errors import ConfigError

# Settings of the run (not knobs) that a piece's `check` may name; known at fit start.
RUN_SETTINGS = ("group_size", "max_response_length")
# The keyword a piece that wraps another (`traits["wraps"]`) is given that piece by, bound: not a knob.
WRAPPED = "wrapped"
REQUIRED = inspect.Parameter.empty


@dataclass(frozen=True)
class Knob:
    name: str
    default: Any  # REQUIRED: the config must give it
    annotation: Any  # the resolved type hint, or Any where it cannot be resolved


@dataclass(frozen=True)
class Knobs:
    """The knobs a piece declares, read once at registration, and which of them each of its functions takes."""

    declared: Mapping[str, Knob]
    taken_by: Mapping[Callable, tuple[str, ...]]  # each function (and the check) → the knobs it takes, in order
    run_settings: tuple[str, ...] = ()  # the run settings its check names (`group_size`)

    @classmethod
    def of(cls, functions: tuple[Callable, ...], check: Callable | None) -> Knobs:
        declared: dict[str, Knob] = {}
        taken_by: dict[Callable, tuple[str, ...]] = {}
        for fn in (*functions, *([check] if check is not None else [])):
            hints = annotations_of(fn)
            params = [p for p in keyword_only(fn) if p.name not in (WRAPPED, *RUN_SETTINGS)]
            for p in params:
                knob = declared.setdefault(p.name, Knob(p.name, p.default, hints.get(p.name, Any)))
                if p.default is not REQUIRED and knob.default is not REQUIRED and p.default != knob.default:
                    raise TypeError(f"{fn.__qualname__}: the knob {p.name} defaults to {p.default!r}, and to "
                                    f"{knob.default!r} in another function of the same piece; give them one default")
                if knob.default is REQUIRED and p.default is not REQUIRED:  # the check may declare it without one
                    declared[p.name] = Knob(p.name, p.default, knob.annotation)
            taken_by[fn] = tuple(p.name for p in params)
        run_settings = () if check is None else tuple(p.name for p in keyword_only(check) if p.name in RUN_SETTINGS)
        return cls(declared, taken_by, run_settings)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.declared)

    def values(self, given: Mapping[str, Any] | None, what: str, flag: str) -> dict[str, Any]:
        """Every declared knob's value: `given`'s (the config's, `flag`.knobs), else its default. A key the piece
        does not declare, a missing knob without a default and a value its type does not take are ConfigErrors."""
        given = dict(given or {})
        unknown = [k for k in given if k not in self.declared]
        if unknown:
            theirs = ", ".join(self.names) or "none"
            raise ConfigError(
                f"{what} does not read the knob {unknown[0]!r}; its knobs: {theirs} (set them with "
                f"--{flag}.knobs.<knob>; --{flag}.knobs '{{}}' clears a preset's)"
            )
        values = {}
        for knob in self.declared.values():
            if knob.name in given:
                value, source = given[knob.name], f"--{flag}.knobs.{knob.name}"
            elif knob.default is not REQUIRED:
                value, source = knob.default, "its default"
            else:
                raise ConfigError(f"{what} needs the knob {knob.name!r}: set it with --{flag}.knobs.{knob.name}")
            if not accepts(knob.annotation, value):
                raise ConfigError(f"{what}: its knob {knob.name} takes {type_name(knob.annotation)}, got {value!r} ({source})")
            values[knob.name] = value
        return values

    def of_function(self, fn: Callable, values: Mapping[str, Any]) -> dict[str, Any]:
        """The keyword arguments `fn` (one of the piece's functions, or its check) takes from `values`."""
        return {name: values[name] for name in self.taken_by[fn]}


def keyword_only(fn: Callable) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(fn).parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]


def annotations_of(fn: Callable) -> dict[str, Any]:
    """`fn`'s resolved annotations; none where they cannot be resolved (a user's piece may name types it
    imports only for checkers)."""
    try:
        return typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 (any failure to resolve: the knobs then go unchecked)
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
