"""Loading a user's piece modules before the configuration is parsed, so that the names they register
(`rank` of `@advantage_estimators.register("rank", ...)`) work as values and `make list` shows them.

Two ways, both read by `python -m rlvr_lightning fit|list`, `make plan` and `make doctor`:
  * `--imports my_pieces` (or `imports: [my_pieces]` in a `--config` file): modules imported before the
    parser reads any value. It is also a real option of the command line, so the run's saved config
    names the modules it needs;
  * an installed package's entry points in the group `rlvr_lightning.pieces` (pyproject.toml:
    `[project.entry-points."rlvr_lightning.pieces"] my_pieces = "my_package.pieces"`), imported always.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from pathlib import Path

from rlvr_lightning.errors import ConfigError

ENTRY_POINT_GROUP = "rlvr_lightning.pieces"
OPTION = "imports"


def import_piece_module(name: str, given_by: str) -> None:
    """Import `name`, whose pieces register themselves. A module that is not found is a one-line error
    saying where to put it; an error raised inside the module is the module's own (its traceback shows it)."""
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name is None or not (name == err.name or name.startswith(err.name + ".")):
            raise ConfigError(f"{given_by}: importing {name!r} failed: {err}") from None  # one of its own imports
        raise ConfigError(
            f"{given_by}: cannot import {name!r} ({err}): put the directory that holds it on PYTHONPATH "
            f"(PYTHONPATH=path/to/dir make train …) or install it"
        ) from None
    except ImportError as err:
        raise ConfigError(f"{given_by}: importing {name!r} failed: {err}") from None


def load_entry_points() -> list[str]:
    """Import every installed package's piece modules (entry-point group `rlvr_lightning.pieces`)."""
    loaded = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        where = f"entry point {ep.name!r} of {ep.dist.name if ep.dist else 'an installed package'} ({ENTRY_POINT_GROUP})"
        import_piece_module(ep.module, where)
        if ep.attr:
            ep.load()  # `module:attr`: the module is imported already; the attribute must exist
        loaded.append(ep.value)
    return loaded


def imports_given(argv: list[str]) -> list[str]:
    """The modules `--imports` names in `argv` (`--imports m`, `--imports=m`, `--imports '[m, n]'`,
    `--imports+ m`) and the top-level `imports:` of each `--config` file, in order."""
    names: list[str] = []
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        if flag in (f"--{OPTION}", f"--{OPTION}+"):
            names += _module_names(_yaml(value), f"--{OPTION}")
        elif flag == "--config" and Path(value).is_file():
            cfg = _yaml(Path(value).read_text())
            if isinstance(cfg, dict) and cfg.get(OPTION) is not None:
                names += _module_names(cfg[OPTION], f"{OPTION}: in {value}")
    return list(dict.fromkeys(names))


def load_piece_modules(argv: list[str]) -> list[str]:
    """Import the entry points' modules and those `argv` names (see `imports_given`); the modules named."""
    load_entry_points()
    names = imports_given(argv)
    for name in names:
        import_piece_module(name, f"--{OPTION}")
    return names


def _yaml(text: str):
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return None  # the parser reports a malformed value or file


def _module_names(value, given_by: str) -> list[str]:
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, str) and v for v in values):
        raise ConfigError(f"{given_by} takes module names (`my_pieces` or `[my_pieces, other]`), got {value!r}")
    return values
