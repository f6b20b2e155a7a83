"""The pieces an algorithm's hyper-parameters select, every knob they run with, and the check of
`piece_args` against them: a key no selected piece reads is a misspelling or a leftover, and a key that
is an argument of the algorithm would lose to it (pieces read the algorithm's arguments first). An argument of
the algorithm that switches a piece's feature on (a knob whose default is None: `dual_clip_c`) while none of the
selected pieces reads it would change nothing: it is refused the same way. (An argument with a value of its own,
a clip range or τ, serves whichever selected piece reads it; presets set them for several losses.)"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from rlvr_lightning.errors import ConfigError
from rlvr_lightning.pieces.kinds import KINDS
from rlvr_lightning.pieces.registry import Piece, sets


def selected_pieces(values: Mapping[str, Any]) -> dict[str, Piece]:
    """The piece of each kind, by its config key (`policy_loss`), and each piece one of them wraps, by the knob
    that names it (`opd_reward`): it runs, and is checked, as a selected piece."""
    pieces = {registry.key: registry.selected(values) for registry in KINDS}
    for piece in list(pieces.values()):
        inner = piece.wrapped(values, values.get("piece_args"))
        if inner is not None:
            pieces[piece.traits["wraps"]] = inner
    return pieces


def check_piece_args(values: Mapping[str, Any]) -> None:
    """Refuse `piece_args` keys that no selected piece reads, or that are arguments of the algorithm."""
    piece_args = values.get("piece_args") or {}
    if not isinstance(piece_args, Mapping):
        raise ConfigError(f"model.piece_args takes a mapping of knob names to values, got {piece_args!r}")
    pieces = selected_pieces(values)
    read = {knob: piece for piece in pieces.values() for knob in piece.knobs}
    knob_of: dict[str, Piece] = {}  # a piece that reads each knob: the first registered
    for piece in (piece for registry in KINDS for piece in registry.pieces()):
        for knob in piece.knobs:
            knob_of.setdefault(knob, piece)
    for name in values:
        off_by_default = name in getattr(values, "defaults", {}) and values.defaults[name] is None
        if name in knob_of and name not in read and off_by_default and sets(values, name):
            pieces_named = ", ".join(f"{k}={p.name}" for k, p in pieces.items())
            raise ConfigError(
                f"--model.init_args.{name}={values[name]!r} is read by none of the selected pieces ({pieces_named}): "
                f"it changes nothing here ({knob_of[name].what} reads it, for one); drop it or select such a piece"
            )
    for key, value in piece_args.items():
        if key in values:
            raise ConfigError(
                f"piece_args.{key}: {key} is an argument of the algorithm, which the pieces read instead "
                f"(now {values[key]!r}); set --model.init_args.{key} {value} and drop it from piece_args"
            )
        if key not in read:
            knobs = sorted(k for k in read if k not in values)
            pieces_named = ", ".join(f"{k}={p.name}" for k, p in pieces.items())
            close = difflib.get_close_matches(key, [*knobs, *(k for k in read if k in values)], n=1)
            hint = f"did you mean {close[0]}{' (--model.init_args.' + close[0] + ')' if close[0] in values else ''}? " if close else ""
            raise ConfigError(
                f"piece_args.{key} is read by none of the selected pieces ({pieces_named}); {hint}their piece_args "
                f"knobs are: {', '.join(knobs) or 'none'} (a preset's piece_args are cleared with --model.init_args.piece_args '{{}}')"
            )


def piece_args_run_with(values: Mapping[str, Any]) -> dict[str, Any]:
    """The knobs the selected pieces run with that are not arguments of the algorithm, defaults included:
    what `piece_args` holds in effect (the run's parameters record it)."""
    knobs: dict[str, Any] = {}
    for piece in selected_pieces(values).values():
        knobs.update(piece.knob_values(values, values.get("piece_args")))
    return {k: v for k, v in knobs.items() if k not in values}
