"""`python -m rlvr_lightning.doctor [make train's --config files and flags] [--checks sync,engine]`
(`make doctor`): checks, on the machine at hand and in a few minutes, each part of the run's GPU/CPU path
with a tiny model in the run's precision, and prints one table row per check. Exit code 0 when every check
that can run here passes, 1 when one fails, 2 for a configuration error. docs/doctor.md lists the checks.

It parses exactly what `make train` parses (`rlvr_lightning.plan.parse`, nothing instantiated).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

from rlvr_lightning.errors import ConfigError

BUDGET_S = 300.0  # past it, the remaining checks are skipped: the doctor must stay a quick pre-flight


def first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def run_checks(setup, checks, budget_s: float = BUDGET_S) -> list:
    """The rows of `checks` ((name, check, fix) triples); a check that raises is one FAIL row with the
    error's first line and the fix, so that one broken part never hides the others' results."""
    from rlvr_lightning.doctor.checks import FAIL, SKIP, Row

    rows, t0 = [], time.perf_counter()
    for name, check, fix in checks:
        if time.perf_counter() - t0 > budget_s:
            rows.append(Row(name, SKIP, note=f"the doctor's {budget_s:.0f} s budget is spent"))
            continue
        try:
            result = check(setup)
        except Exception as err:  # noqa: BLE001 - every failure becomes a row of the table
            result = Row(name, FAIL, note=f"{first_line(err)} — {fix}")
        rows.extend(result if isinstance(result, list) else [result])
    return rows


def as_table(rows) -> str:
    header = ("check", "result", "figure", "what to do / why skipped")
    cells = [header] + [(r.check, r.result, r.figure, r.note) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(3)]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(3)) + "  " + c[3] for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * len(header[3]))
    return "\n".join(line.rstrip() for line in lines)


def main(argv: list[str] | None = None) -> None:
    from rlvr_lightning.cli.accelerator_defaults import sandbox_line
    from rlvr_lightning.doctor.checks import CHECKS, FAIL, Setup
    from rlvr_lightning.plan import parse

    argv = sys.argv[1:] if argv is None else argv
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--checks", help="comma-separated words: run only the checks whose names contain one")
    opts, rest = own.parse_known_args(argv)
    checks = CHECKS
    if opts.checks:
        wanted = [w.strip().lower() for w in opts.checks.split(",")]
        checks = [c for c in CHECKS if any(w in c[0].lower() for w in wanted)]
    t0 = time.perf_counter()
    # The doctor hands LightningCLI its arguments explicitly, as `make plan` does: not a mistake to warn of.
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
    try:
        cfg, _ = parse(rest)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    with tempfile.TemporaryDirectory(prefix="rlvr-doctor-") as tmp:
        setup = Setup(cfg, Path(tmp))
        print(setup.device_defaults.block())
        if (line := sandbox_line(cfg)) is not None:
            print(line)
        print(
            f"device {setup.device}, trainer {setup.trainer_dtype}{' (FSDP2)' if setup.fsdp else ''}, "
            f"rollout.engine={setup.rollout.engine} ({setup.engine_dtype})\n"
        )
        try:
            rows = run_checks(setup, checks)
        finally:
            setup.close()
    print(as_table(rows))
    failed = [r.check for r in rows if r.result == FAIL]
    print(
        f"\n{len(rows) - len(failed)} of {len(rows)} rows pass or are skipped; "
        f"{len(failed)} failed{': ' + ', '.join(failed) if failed else ''} ({time.perf_counter() - t0:.0f} s)"
    )
    sys.exit(1 if failed else 0)
