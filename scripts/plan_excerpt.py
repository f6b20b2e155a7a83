"""Regenerate the `make plan` excerpts of README.md and docs/planning.md from the planner itself.

    python scripts/plan_excerpt.py

Runs the docs' 7B example (EXAMPLE, as `make plan` runs it: configs/base.yaml, the GRPO preset, the flags)
and rewrites what lies between `<!-- plan-excerpt: begin -->` and `<!-- plan-excerpt: end -->` in each
file: the whole plan in docs/planning.md, its main lines in README.md. Plan output is never edited by hand.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's package, not another installed one
# The docs' example: `make plan ALGO=grpo ARGS="..."` with these ARGS (the docs print the same command).
EXAMPLE = ["--config", "configs/strategy/fsdp.yaml", "--data.model_name_or_path", "Qwen/Qwen2.5-Math-7B", "--hardware", "h100",
           "--devices", "8", "--data.batch_size", "64", "--rollout.group_size", "16", "--rollout.max_response_length", "8192",
           "--data.max_prompt_length", "512", "--mean-response-length", "2000"]  # fmt: skip
BEGIN, END = "<!-- plan-excerpt: begin -->", "<!-- plan-excerpt: end -->"


def plan_text() -> tuple[str, float]:
    from rlvr_lightning.plan import parse
    from rlvr_lightning.planner.preflight import plan_config
    from rlvr_lightning.planner.report import as_text

    sys.argv = ["plan"]  # LightningCLI reads it
    t0 = time.perf_counter()
    cfg, _ = parse(["--config", "configs/base.yaml", "--config", "configs/algo/grpo.yaml", *EXAMPLE])
    text = as_text(plan_config(cfg, with_fixes=True))
    return text, time.perf_counter() - t0


def short(text: str) -> str:
    """README's excerpt: the header, the verdict, the step time and the expected generation, the note on
    overlap, the fixes (the stages by stage are docs/planning.md's)."""
    lines = text.splitlines()
    keep = lines[:2]
    starts = ("peak ", "step time, estimated", "generation, expected", "note:", "changes that fit", "--")
    keep += [line for line in lines[2:] if line.lstrip().startswith(starts)]
    return "\n".join(keep)


def rewrite(path: Path, body: str) -> None:
    text = path.read_text()
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{path}: no {BEGIN} … {END} markers")
    path.write_text(pattern.sub(lambda _: f"{BEGIN}\n```\n{body}\n```\n{END}", text))


def main() -> None:
    text, seconds = plan_text()
    footer = f"(planned in {seconds:.0f} s on this machine, from the model's configuration: no weights)"
    rewrite(ROOT / "docs" / "planning.md", f"{text}\n\n{footer}")
    rewrite(ROOT / "README.md", short(text))
    print(f"rewrote the excerpts of README.md and docs/planning.md ({seconds:.0f} s)")


if __name__ == "__main__":
    main()
