"""What a run prints: by default only what a user can act on; `-v`/`--verbose` (or RLVR_VERBOSE=1)
prints everything, as the libraries would.

The quiet default silences third-party messages that are harmless on every setup we run and that
the user cannot act on. Each is named below. Several libraries read their log level from the
environment when they are imported, so `quiet_libraries` runs before torch, Lightning or vLLM is
imported (`python -m rlvr_lightning` calls it first).
"""

from __future__ import annotations

import logging
import os
import warnings

VERBOSE_FLAGS = ("-v", "--verbose")

ENVIRONMENT = {
    # vLLM's engine-start notes (Triton missing on CPU, eager mode, NUMA and LD_PRELOAD performance
    # hints) and its per-call "CPU backend doesn't allow torch.set_num_threads" warning. Errors still print.
    "VLLM_LOGGING_LEVEL": "ERROR",
    # c10's "NUMA binding: Using MEMBIND policy" notice, printed when vLLM's CPU worker binds its threads.
    "TORCH_CPP_LOG_LEVEL": "ERROR",
    # transformers' "Loading weights" / "Writing model shards" bars and its notes on every load.
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}

WARNINGS = [  # (message regex, why it is harmless)
    (r"`torch\.distributed\.reduce_op` is deprecated", "vLLM's kernel dispatcher touches a deprecated torch alias"),
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", "Lightning's own pytree helper, on every step"),
]

LOGGERS = {  # logger → the lowest level still printed
    "vllm": logging.ERROR,  # its Triton notes at import, before vLLM applies VLLM_LOGGING_LEVEL to its handler
    "mlflow.store.db.utils": logging.WARNING,  # "Creating initial MLflow database tables" on a new store
    "mlflow.system_metrics": logging.WARNING,  # "Started monitoring system metrics" and its stop messages
    "lightning.pytorch.utilities.rank_zero": logging.WARNING,  # "GPU available: False", "TPU available", the tip
    "lightning.fabric.utilities.seed": logging.WARNING,  # "Seed set to 0" (the seed is in the logged config)
    "lightning.pytorch.trainer.connectors.checkpoint_connector": logging.WARNING,  # "`weights_only` was not set"
}


def verbose() -> bool:
    """Whether this process prints everything (RLVR_VERBOSE=1, which `-v` sets)."""
    return os.environ.get("RLVR_VERBOSE", "") not in ("", "0")


def quiet_libraries(argv: list[str]) -> list[str]:
    """Unless verbose output is asked for (`-v`, `--verbose`, RLVR_VERBOSE=1), silence the messages above.
    Returns `argv` without the verbose flags (which are ours, not LightningCLI's)."""
    if any(a in VERBOSE_FLAGS for a in argv):
        os.environ["RLVR_VERBOSE"] = "1"  # also for the ranks and workers this process starts
    if not verbose():
        for key, value in ENVIRONMENT.items():
            os.environ.setdefault(key, value)  # a value the user set wins
        for message, _why in WARNINGS:
            warnings.filterwarnings("ignore", message=message)
        for name, level in LOGGERS.items():
            logging.getLogger(name).setLevel(level)
    return [a for a in argv if a not in VERBOSE_FLAGS]
