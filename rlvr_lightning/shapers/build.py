"""The advantage shapers of a `shapers` section, built once with the training step: THR, then OAR, then the user's
in the order given (their weights multiply, so the order changes only the order of their metrics)."""

from __future__ import annotations

import inspect

from rlvr_lightning.context import AdvantageShaper
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.rewards.loading import load_function
from rlvr_lightning.shapers.oar import OARShaper
from rlvr_lightning.shapers.settings import CustomShaper, ShaperSettings
from rlvr_lightning.shapers.thr import THRShaper


def build_shapers(settings: ShaperSettings) -> tuple[AdvantageShaper, ...]:
    built: list[AdvantageShaper] = []
    if settings.thr is not None:
        built.append(THRShaper(settings.thr))
    if settings.oar is not None:
        built.append(OARShaper(settings.oar))
    return (*built, *(custom_shaper(c) for c in settings.custom))


def custom_shaper(given: CustomShaper) -> AdvantageShaper:
    """The user's shaper class built with its knobs; a class that is not an `AdvantageShaper`, or knobs its
    constructor does not take, is one error line."""
    who = f"model.shapers.custom={given.name}"
    cls = load_function(given.name, who)
    if not (isinstance(cls, type) and issubclass(cls, AdvantageShaper)):
        raise ConfigError(f"{who} is not a subclass of rlvr_lightning.context.AdvantageShaper")
    try:
        inspect.signature(cls).bind(**given.knobs)
    except TypeError as err:
        raise ConfigError(f"{who}: knobs {sorted(given.knobs)} do not fit {cls.__name__}{inspect.signature(cls)} ({err})") from None
    return cls(**given.knobs)
