"""Fetch into `.whl/` exactly the wheels the GPU machine lacks for `make gpu-check` (docs/gpu.md), for its
Python 3.12 on x86-64 Linux, and copy the embedded default's warm start beside them when this machine has it.

That machine has PyTorch, transformers, Lightning, PEFT, torchmetrics, sympy, PyYAML, requests, psutil, scipy
and matplotlib, and none of: jsonargparse (the CLI's parser, with the `signatures` extra's docstring-parser
and typeshed-client), pebble and math-verify (the reward verifier, with latex2sympy2_extended and its ANTLR
runtime), nor liger-kernel (the gpu extra's fused kernels, which the check's fast-path step measures). vLLM,
MLflow and datasets are left out on purpose: the check runs without them.

The pins are the versions this project's test environment runs (`make setup`), each checked here against
pyproject.toml's requirement for it. `.whl/` is git-ignored; the device call carries it and
`scripts/gpu_check.sh` installs it (`pip install --no-index --no-deps --target`).

    python scripts/fetch_gpu_wheels.py [--list] [--dest .whl] [--no-warm-start]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]
WHEELS = {  # distribution → version (what `make setup` installs today)
    "jsonargparse": "4.53.0",
    "docstring-parser": "0.18.0",  # jsonargparse[signatures]
    "typeshed-client": "2.15.0",  # jsonargparse[signatures]
    "pebble": "5.2.3",
    "math-verify": "0.9.0",
    "latex2sympy2_extended": "1.11.0",  # math-verify's
    "antlr4-python3-runtime": "4.13.2",  # latex2sympy2_extended's
    "liger-kernel": "0.8.5",  # the gpu extra's: the fast paths' fused kernels (bench/gpu_check/fast_paths.py)
}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"]
LIMIT_MIB = 64  # everything a device call carries, the working tree included


def check_pins() -> None:
    """Each pin inside pyproject.toml's range for its package (where pyproject names it)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    ranges = {canonicalize_name(r.name): r.specifier for r in map(Requirement, project["dependencies"])}
    for name, version in WHEELS.items():
        spec = ranges.get(canonicalize_name(name))
        if spec is not None and version not in spec:
            sys.exit(f"error: {name}=={version} is outside pyproject.toml's {name}{spec}")


def warm_start_dir() -> Path | None:
    """The embedded default's warm start in this machine's cache, if it was built here (no build: it takes minutes)."""
    from rlvr_lightning.models.warm_start import WarmStartConfig, cache_root

    path = cache_root() / f"embedded-{WarmStartConfig().key()}"
    return path if (path / "warm_start.json").exists() else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--list", action="store_true", help="print what would be fetched, fetch nothing")
    p.add_argument("--dest", type=Path, default=REPO / ".whl")
    p.add_argument("--no-warm-start", action="store_true", help="do not copy the embedded warm start")
    args = p.parse_args()
    check_pins()
    warm = None if args.no_warm_start else warm_start_dir()
    if args.list:
        for name, version in WHEELS.items():
            print(f"{name}=={version}")
        print(f"warm start: {warm or 'none in this cache (the check builds it there)'}")
        return
    args.dest.mkdir(parents=True, exist_ok=True)
    for old in args.dest.glob("*.whl"):  # one version of each: two stop the whole install there
        old.unlink()
    platforms = [f"--platform={p}" for p in PLATFORMS]
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", *platforms, "--dest", str(args.dest), *(f"{n}=={v}" for n, v in WHEELS.items())]  # fmt: skip
    subprocess.run(cmd, check=True)
    if warm is not None:
        shutil.copytree(warm, args.dest / "rlvr_cache" / warm.name, dirs_exist_ok=True)
    files = [f for f in args.dest.rglob("*") if f.is_file()]
    total = sum(f.stat().st_size for f in files) / 2**20
    for f in sorted(args.dest.glob("*.whl")):
        print(f"{f.stat().st_size / 2**20:7.2f} MiB  {f.name}")
    if warm is not None:
        print(f"warm start: {warm.name}")
    print(f"{total:.1f} MiB in {args.dest} ({len(files)} files; a device call carries {LIMIT_MIB} MiB in all)")
    if total > LIMIT_MIB / 2:
        sys.exit(f"error: {total:.1f} MiB leaves too little of the {LIMIT_MIB} MiB for the working tree")


if __name__ == "__main__":
    main()
