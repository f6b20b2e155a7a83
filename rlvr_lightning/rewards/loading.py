"""A user's function (or class) named by its dotted path, imported with one error line when it cannot be."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from rlvr_lightning.errors import ConfigError


def load_function(path: str, who: str = "model.rewards.functions") -> Callable:
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
