"""`python -m rlvr_lightning list` (`make list`): every preset, algorithm class and registered piece,
each with one line of description and where it is documented. Read from the code itself (the
registries, the classes' signatures and docstrings, the preset files), so it cannot drift."""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

import rlvr_lightning.algos as algos
from rlvr_lightning.pieces import KINDS

NO_OWN_KNOBS = "(none: RLVRModule's, listed by --model.help)"
PRESETS = Path(__file__).resolve().parents[1] / "configs" / "algo"


def _first_sentence(text: str) -> str:
    line = " ".join(text.strip().split("\n\n")[0].split())
    return line if len(line) <= 110 else line[:107] + "…"


def preset_lines(directory: Path = PRESETS) -> list[str]:
    lines = []
    for path in sorted(directory.glob("*.yaml")):
        text = path.read_text()
        comment = next((ln.lstrip("# ").strip() for ln in text.splitlines() if ln.startswith("#")), "")
        cls = re.search(r"class_path:\s*\S+\.(\w+)", text)
        lines.append(f"  {path.stem:<20} {cls.group(1) if cls else '?':<8} {_first_sentence(comment)}")
    return lines


def algorithm_lines() -> list[str]:
    lines = []
    for name in algos.__all__:
        cls = getattr(algos, name)
        if cls is algos.RLVRModule:
            continue
        module = cls()  # cheap: no model is loaded before fit
        own = [] if cls.__init__ is algos.RLVRModule.__init__ else inspect.signature(cls.__init__).parameters
        knobs = ", ".join(f"{k}={module.hparams[k]!r}" for k in own if k not in ("self", "kwargs"))
        pieces = ", ".join(f"{r.flag.split('.')[-1]}={module.hparams[r.flag.split('.')[-1]]}" for r in KINDS)
        summary = _first_sentence(inspect.getdoc(inspect.getmodule(cls)) or "")
        lines += [f"  {name:<8} {summary}", f"           pieces: {pieces}", f"           own knobs: {knobs or NO_OWN_KNOBS}",
                  f"           docs: {cls.docs}"]  # fmt: skip
    return lines


def piece_lines() -> list[str]:
    lines = []
    for registry in KINDS:
        lines.append(f"  {registry.plural} (--model.init_args.{registry.flag.split('.')[-1]}): {registry.description}")
        for piece in registry.pieces():
            knobs = f" [knobs: {', '.join(piece.knobs)}]" if piece.knobs else ""
            lines.append(f"    {piece.name:<24} {piece.summary}{knobs}  ({piece.docs})")
    return lines


def main(argv: list[str] | None = None) -> None:
    out = ["Presets (make train ALGO=<name>; configs/algo/):", *preset_lines(), "",
           "Algorithms (--model <Name>; rlvr_lightning.algos):", *algorithm_lines(), "",
           "Registered pieces (a dotted path to your own works too; see README, 'Adding an algorithm'):",
           *piece_lines()]  # fmt: skip
    print("\n".join(out))


if __name__ == "__main__":
    main(sys.argv[1:])
