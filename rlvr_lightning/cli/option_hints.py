"""For a parse error about an unknown option, the valid options it most resembles."""

from __future__ import annotations

import re

import rlvr_lightning.algos
from rlvr_lightning.data.datamodule import RolloutDataModule
from rlvr_lightning.planner.settings import PlanSettings
from rlvr_lightning.rollout.settings import RolloutSettings


def known_options() -> dict[str, set[str]]:
    """The options of each section, read from the signatures that LightningCLI reads (`model`: every
    algorithm's arguments)."""
    import inspect

    import lightning as L

    def names(*callables) -> set[str]:
        return {p for c in callables for p in inspect.signature(c).parameters if p not in ("self", "args", "kwargs")}

    algorithms = [getattr(rlvr_lightning.algos, n) for n in rlvr_lightning.algos.__all__]
    return {"model": names(*algorithms), "data": names(RolloutDataModule), "rollout": names(RolloutSettings),
            "trainer": names(L.Trainer), "plan": names(PlanSettings)}  # fmt: skip


def option_hint(line: str) -> str:
    """For a parse error about an unknown option, the valid options it most resembles: the same name in
    another section (`data.group_size` → `rollout.group_size`), else the closest names in its own."""
    import difflib

    found = re.match(r"(\w+): Option '(\w+)' is not accepted", line) or re.search(r"unrecognized arguments: --(\w+)\.(?:init_args\.)?(\w+)", line)  # fmt: skip
    if found is None:
        return ""
    section, name = found.groups()
    options = known_options()
    if section not in options:
        return ""
    same = [f"{other}.{name}" for other, names in options.items() if other != section and name in names]
    close = same or [f"{section}.{n}" for n in difflib.get_close_matches(name, sorted(options[section]), n=3)]
    return f"; did you mean {' or '.join(close)}?" if close else "; every option with its value: --print_config"
