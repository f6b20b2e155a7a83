"""`python -m rlvr_lightning.plan [make train's --config files and flags] [--hardware h100] [--devices 8]
[--nodes 1] [--mean-prompt-length P] [--mean-response-length T] [--json plan.json]`: each rank's predicted memory and the step time, before renting anything.

It parses exactly what `make train` parses (the same LightningCLI, with `--plan.*` too) and builds no
weights: see `rlvr_lightning/planner/trainer_measurement.py` for how the trainer is measured.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rlvr_lightning.errors import ConfigError


def parse(argv: list[str]):
    """(the parsed `make train` configuration, the plan's own options)."""
    from rlvr_lightning.cli.rlvr_cli import RLVRCLI

    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--hardware")
    own.add_argument("--devices", type=int)
    own.add_argument("--nodes", type=int)
    own.add_argument("--mean-prompt-length")
    own.add_argument("--mean-response-length")
    own.add_argument("--json", type=Path)
    opts, rest = own.parse_known_args(argv)
    if opts.hardware:
        rest += ["--plan.hardware", opts.hardware]
    if opts.devices:
        rest += ["--trainer.devices", str(opts.devices)]
    for flag in ("mean_prompt_length", "mean_response_length"):
        if getattr(opts, flag) is not None:
            rest += [f"--plan.{flag}", getattr(opts, flag)]
    if opts.nodes:
        rest += ["--trainer.num_nodes", str(opts.nodes)]

    class ConfigOnly(RLVRCLI):  # parse and check the configuration; build nothing
        def before_instantiate_classes(self) -> None: ...
        def instantiate_classes(self) -> None: ...
        def after_instantiate_classes(self) -> None: ...

    return ConfigOnly(args=rest, run=False).config, opts


def main(argv: list[str] | None = None) -> None:
    from rlvr_lightning.planner.preflight import plan_config
    from rlvr_lightning.planner.report import as_text, write_json

    argv = sys.argv[1:] if argv is None else argv
    t0 = time.perf_counter()
    try:
        cfg, opts = parse(argv)
        plan = plan_config(cfg, with_fixes=True)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(as_text(plan))
    print(f"\n(planned in {time.perf_counter() - t0:.0f} s on this machine, from the model's configuration: no weights)")
    if opts.json:
        write_json(plan, opts.json)
        print(f"wrote {opts.json}")


if __name__ == "__main__":
    main()
