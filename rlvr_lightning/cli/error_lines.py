"""User errors as one line: a parse error's dotted option and innermost reason, a configured constructor's
ValueError with where it was raised, and the user error (ours) behind any exception."""

from __future__ import annotations

import re
import traceback
from argparse import ArgumentError

from rlvr_lightning.data.sources import DataSourceError
from rlvr_lightning.environments.base import EnvironmentFailed
from rlvr_lightning.errors import ConfigError, RunStalled, error_chain
from rlvr_lightning.rewards.pool import VerifierUnavailable
from rlvr_lightning.rollout.server_process import RolloutServerError
from rlvr_lightning.tracking import TrackingStoreUnavailable
from rlvr_lightning.training.dynamic_sampling import DynamicSamplingExhausted


def parse_error_line(err: ArgumentError) -> str:
    """One line for a parse error: our own ConfigError's message if one caused it (an unknown or unimportable
    piece), else the dotted option jsonargparse names at each level ('Parser key "model"', 'Parser key "lr"')
    and the innermost reason it gives, whitespace collapsed (no usage, no list of union members)."""
    user_error = user_error_behind(err)
    if user_error is not None:
        return " ".join(str(user_error).split())
    keys, reason, previous = [], str(err), None
    for e in error_chain(err):
        text = str(e)
        if text != previous:  # jsonargparse re-raises one message in several wrappers
            key = re.match(r'Parser key "([^"]+)"', text)
            keys += [key.group(1)] if key else []
            reason = text
        previous = text
    reason = " ".join(re.sub(r'^Parser key "[^"]+":', "", reason).split())
    return f"{'.'.join(keys)}: {reason}" if keys else reason


def constructor_error_line(err: ValueError) -> str:
    """One line for a ValueError a configured class's constructor raised (a user's own algorithm or piece
    check): its message and where it was raised."""
    cause = list(error_chain(err))[-1]
    message = " ".join(str(cause).split())
    frames = traceback.extract_tb(cause.__traceback__)
    if not frames:
        return message
    return f"{message} ({type(cause).__name__} at {frames[-1].filename}:{frames[-1].lineno}, in {frames[-1].name})"


def user_error_behind(err: BaseException) -> BaseException | None:
    """The ConfigError, DataSourceError, RolloutServerError, DynamicSamplingExhausted, VerifierUnavailable,
    EnvironmentFailed, RunStalled or TrackingStoreUnavailable that caused `err`, if any:
    jsonargparse re-raises a class's constructor error as its own ValueError while instantiating the
    config. (A run that stops on exhausted dynamic sampling resumes from its last checkpoint.)"""
    user_errors = (ConfigError, DataSourceError, RolloutServerError, DynamicSamplingExhausted, VerifierUnavailable,
                   EnvironmentFailed, RunStalled, TrackingStoreUnavailable)  # fmt: skip
    return next((e for e in error_chain(err) if isinstance(e, user_errors)), None)
