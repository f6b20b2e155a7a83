"""The pieces an algorithm's arguments select, each with the knobs its choice gives, and every knob they run with."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlvr_lightning.pieces.kinds import KINDS
from rlvr_lightning.pieces.registry import Piece, chosen_knobs, chosen_name


def selected_pieces(values: Mapping[str, Any]) -> dict[str, tuple[Piece, Mapping[str, Any]]]:
    """The piece of each kind and the knobs the config gives it, by its config key (`policy_loss`), and each piece
    one of them wraps, by the knob that names it (`opd_reward`), with the knobs given for it (`opd_reward_knobs`): it
    runs, and is checked, as a selected piece."""
    pieces = {registry.key: (registry.selected(values), chosen_knobs(values[registry.key])) for registry in KINDS}
    for piece, knobs in list(pieces.values()):
        inner = piece.wrapped(knobs)
        if inner is not None:
            pieces[piece.traits["wraps"]] = (inner, piece.wrapped_knobs(knobs))
    return pieces


def knobs_run_with(values: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Each kind's choice as the run runs it, every knob with its value, defaults included: what the run's
    parameters record, the names as given (`{policy_loss: {name: ppo-clip, knobs: {clip_eps_low: 0.2, …}}}`)."""
    return {
        registry.key: {"name": str(chosen_name(values[registry.key])), "knobs": piece.knob_values(chosen_knobs(values[registry.key]))}
        for registry in KINDS
        for piece in (registry.selected(values),)
    }
