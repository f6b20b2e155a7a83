"""What every gpu-check JSON holds besides its figures (card, versions, commit, date), and the checks on them."""

from __future__ import annotations

import json
import math
import platform
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def git_commit() -> str:
    """The checkout's commit, `+dirty` when it has uncommitted changes; `unknown` outside a git checkout (the
    device machine gets a copy of the working tree, maybe without its `.git`)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()  # fmt: skip
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def card() -> str:
    """The accelerator's name, or the CPU's platform when there is none."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def header(tiny: bool) -> dict:
    import transformers

    return {
        "card": card(), "device": "cuda" if torch.cuda.is_available() else "cpu", "tiny_shapes": tiny,
        "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
        "commit": git_commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }  # fmt: skip


def write(out: Path, step: str, payload: dict) -> Path:
    path = Path(out) / f"{step}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


def non_finite(tree, prefix: str = "") -> list[str]:
    """The dotted keys of every float in `tree` that is NaN or infinite."""
    if isinstance(tree, dict):
        return [k for key, value in tree.items() for k in non_finite(value, f"{prefix}{key}.")]
    if isinstance(tree, list):
        return [k for i, value in enumerate(tree) for k in non_finite(value, f"{prefix}{i}.")]
    if isinstance(tree, float) and not math.isfinite(tree):
        return [prefix.rstrip(".")]
    return []


class Deadline:
    """A step's time budget: the parts of a step ask it before they start, so that a slow part skips the
    later ones (recorded as skipped) instead of the whole step being killed."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    @property
    def left(self) -> float:
        return self.end - time.monotonic()

    def spent(self, reserve: float = 0.0) -> bool:
        return self.left <= reserve


def error_text(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[-1] if lines else ''}".rstrip(": ")


def attempt(results: dict, key: str, deadline: Deadline, fn, *args, reserve: float = 0.0, **kwargs):
    """`results[key] = fn(*args, **kwargs)`; its failure, or a budget spent before it starts, is recorded in its
    place (`{"error": …}`, `{"skipped": …}`) and the step goes on."""
    if deadline.spent(reserve):
        results[key] = {"skipped": "the step's time budget is spent"}
        return None
    t0 = time.perf_counter()
    try:
        results[key] = fn(*args, **kwargs)
    except (Exception, SystemExit) as err:  # noqa: BLE001 - one part's failure is a figure of the check, not its end
        results[key] = {"error": error_text(err)}  # (SystemExit: the CLI's parser exits on a configuration error)
    finally:
        print(f"gpu-check:   {key}: {time.perf_counter() - t0:.1f} s", flush=True)
        free_device_memory()
    return results[key]


def free_device_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextmanager
def one_rank_group(workdir: Path):
    """A process group of this one process (NCCL on CUDA, gloo on the CPU) and its device mesh, as the trainer's
    FSDP2 strategy has on one device."""
    import tempfile

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    store = Path(tempfile.mkdtemp(dir=workdir)) / "store"
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=f"file://{store}", rank=0,
                            world_size=1)  # fmt: skip
    try:
        yield init_device_mesh(device_type, (1,))
    finally:
        dist.destroy_process_group()
