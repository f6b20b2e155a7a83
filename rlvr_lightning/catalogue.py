"""`python -m rlvr_lightning list [--imports my_pieces] [--config my.yaml]` (`make list [ARGS=…]`): every
preset, algorithm class, registered piece and environment, each with the first sentence of its description (whole,
wrapped) and where it is documented. Read from the code itself (the registries, the classes' signatures
and docstrings, the preset files), so it cannot drift. A user's pieces are listed too: those of the
modules `--imports` (or a `--config` file's `imports:`) names and of installed packages' entry points."""

from __future__ import annotations

import inspect
import re
import sys
import textwrap
from pathlib import Path

import rlvr_lightning.algos as algos
from rlvr_lightning.environments.base import Environment
from rlvr_lightning.environments.python_tool import PythonTool
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.pieces import KINDS
from rlvr_lightning.pieces.knobs import REQUIRED
from rlvr_lightning.pieces.loading import load_piece_modules

NO_OWN_KNOBS = "(none: RLVRModule's, listed by --model.help)"
PRESETS = Path(__file__).resolve().parents[1] / "configs" / "algo"
WIDTH = 120  # preset and algorithm descriptions are wrapped here, never cut
# Words whose period does not end a sentence ("Dr. GRPO", "Cui et al. 2025").
ABBREVIATIONS = ("Dr.", "al.", "e.g.", "i.e.", "vs.", "cf.", "Fig.", "Eq.", "approx.")
# K, and why the clipped losses need K > 1: the presets of gspo, gmpo, sapo, cispo take K = 4 for it.
K_LINE = (
    "K = num_mini_batches × ppo_epochs optimizer steps per rollout batch. With K = 1 every step is exactly "
    "on policy (π_θ = π_old: each ratio is 1), so a ratio-based loss's clipping never acts; the presets of the "
    "losses that differ only off policy (gspo, gmpo, sapo, cispo) take K = 4."
)


def first_sentence(text: str) -> str:
    """The first sentence of the first paragraph, whole, on one line."""
    words = " ".join(text.strip().split("\n\n")[0].split()).split(" ")
    for i, word in enumerate(words):
        if re.search(r"[.!?][)\"']?$", word) and not word.endswith(ABBREVIATIONS) and i + 1 < len(words):
            return " ".join(words[: i + 1])
    return " ".join(words)


def wrapped(first: str, text: str, indent: int) -> list[str]:
    """`first` then `text`, wrapped at WIDTH, continuation lines indented to `indent` columns."""
    return textwrap.wrap(
        f"{first}{text}", WIDTH, subsequent_indent=" " * indent, break_on_hyphens=False, break_long_words=False
    ) or [first.rstrip()]


def leading_comment(text: str) -> str:
    """A YAML file's leading `#` block, as prose."""
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return " ".join(lines)


def preset_lines(directory: Path = PRESETS) -> list[str]:
    lines = []
    for path in sorted(directory.glob("*.yaml")):
        text = path.read_text()
        cls = re.search(r"class_path:\s*\S+\.(\w+)", text)
        head = f"  {path.stem:<20} {cls.group(1) if cls else '?':<8} "
        lines += wrapped(head, first_sentence(leading_comment(text)), len(head))
    return lines


def piece_text(registry, choice: dict) -> str:
    """`ppo-clip` or `ppo-clip(clip_eps_high=0.28)`: a recorded choice's name and the knobs it sets off the piece's
    own defaults."""
    defaults = registry.get(choice["name"]).knob_values()
    changed = ", ".join(f"{k}={v!r}" for k, v in choice["knobs"].items() if defaults.get(k) != v)
    return f"{choice['name']}({changed})" if changed else choice["name"]


def algorithm_lines() -> list[str]:
    lines = []
    for name in algos.__all__:
        cls = getattr(algos, name)
        if cls is algos.RLVRModule:
            continue
        module = cls()  # cheap: no model is loaded before fit
        own = [] if cls.__init__ is algos.RLVRModule.__init__ else inspect.signature(cls.__init__).parameters
        kinds = {r.key for r in KINDS}  # its pieces, with the knobs it sets, are the line above
        knobs = ", ".join(f"{k}={module.hparams[k]!r}" for k in own if k not in ("self", "kwargs", *kinds))
        pieces = ", ".join(f"{r.key}={piece_text(r, module.hparams[r.key])}" for r in KINDS)
        summary = first_sentence(inspect.getdoc(inspect.getmodule(cls)) or "")
        lines += [
            *wrapped(f"  {name:<8} ", summary, 11),
            *wrapped("           pieces: ", pieces, 19),
            *wrapped("           own knobs: ", knobs or NO_OWN_KNOBS, 22),
            f"           docs: {cls.docs}",
        ]
    return lines


def knob_list(piece) -> str:
    """A piece's knobs with their defaults, as the config gives them (`….knobs.<knob>`)."""
    return ", ".join(k.name if k.default is REQUIRED else f"{k.name}={k.default!r}" for k in piece.declared.declared.values())


def piece_lines() -> list[str]:
    lines = []
    for registry in KINDS:
        lines += wrapped(f"  {registry.plural} (--model.init_args.{registry.key}.name): ", registry.description, 6)
        for piece in registry.pieces():
            summary = first_sentence(inspect.getdoc(piece.fn) or "")
            knobs = f" [knobs: {knob_list(piece)}]" if piece.knobs else ""
            lines.append(f"    {piece.name:<24} {summary}{knobs}  ({piece.docs})")  # one line: `make list | grep`
    return lines


def environment_lines() -> list[str]:
    """The built-in environments and every `Environment` subclass the imported modules define."""
    lines = ["  (none)           one segment per answer, scored by the verifier (the default)"]
    found, todo = [], list(Environment.__subclasses__())
    while todo:
        cls = todo.pop(0)
        found.append(cls)
        todo += cls.__subclasses__()
    for cls in found:
        flag = "--data.tool.*" if cls is PythonTool else f"--data.environment {cls.__module__}.{cls.__qualname__}"
        lines += wrapped(f"  {cls.__name__:<16} ", f"{first_sentence(inspect.getdoc(cls) or '')} ({flag})", 19)
    return lines


def main(argv: list[str] | None = None) -> None:
    try:
        load_piece_modules(sys.argv[1:] if argv is None else argv)  # a user's pieces are listed too
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    out = [
        "Presets (make train ALGO=<name>, or ALGO=path/to/your_preset.yaml; configs/algo/):",
        *preset_lines(),
        "",
        "Algorithms (--model <Name>; rlvr_lightning.algos):",
        *wrapped("  ", K_LINE, 2),
        *algorithm_lines(),
        "",
        "Registered pieces (yours: by dotted path, or by name with --imports <module>; README, 'Adding an algorithm'):",
        *piece_lines(),
        "",
        "Environments (yours: a subclass of rlvr_lightning.environments.base.Environment; docs/environments.md):",
        *environment_lines(),
    ]
    print("\n".join(out))


if __name__ == "__main__":
    main(sys.argv[1:])
