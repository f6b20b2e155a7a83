"""Whether a Hugging Face hub name can be used from this machine before any work: a copy in the local cache, or a
reachable hub. Asked while the configuration is parsed (`cli.input_checks`), so that an offline machine and a hub
name it has never downloaded are one line, not a failure minutes into a run deep inside `transformers`."""

from __future__ import annotations

import os
import re
from functools import cache
from pathlib import Path
from typing import Literal

RepoType = Literal["model", "dataset"]
PROBE_TIMEOUT_S = 3.0  # an unreachable hub answers in this time or is taken as offline

# Endings that only a file name has: such a string is never a hub name, so when it does not exist we report "not
# found" rather than making a (slow, confusing, possibly offline) hub request.
FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".tsv", ".txt", ".arrow", ".gz", ".zst", ".bz2", ".xz")
# Hub names are "name" or "owner/name". On POSIX os.sep is "/", so one "/" alone cannot mean "path".
HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def looks_like_path(name: str) -> bool:
    """Whether `name` can only be a local path (so a missing one is "not found", never a hub request)."""
    if Path(name).suffix.lower() in FILE_SUFFIXES:
        return True
    if name.startswith((".", "~", "/")) or "\\" in name:  # relative/absolute/home, or a Windows path
        return True
    return name.count("/") > 1 or not HUB_NAME.fullmatch(name)


def in_local_cache(repo_id: str, repo_type: RepoType) -> bool:
    """A copy of `repo_id` in the hub's cache (a snapshot `huggingface_hub` downloaded), or, for a dataset, in the
    `datasets` library's own cache."""
    from huggingface_hub import constants

    owner_name = repo_id.replace("/", "--")
    if (Path(constants.HF_HUB_CACHE) / f"{repo_type}s--{owner_name}" / "snapshots").is_dir():
        return True
    if repo_type == "dataset":
        datasets_cache = Path(os.environ.get("HF_DATASETS_CACHE", Path(constants.HF_HOME) / "datasets"))
        return any(datasets_cache.glob(repo_id.replace("/", "___") + "*"))
    return False


@cache
def why_offline() -> str | None:
    """Why the hub cannot be reached from here (`HF_HUB_OFFLINE=1`, or no answer from its endpoint), or None when it
    answers. Asked once per process."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE=1"
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=PROBE_TIMEOUT_S)
    except urllib.error.HTTPError:
        return None  # it answered, with an error status: reachable
    except (OSError, ValueError) as err:
        return f"{constants.ENDPOINT} does not answer: {getattr(err, 'reason', err)}"
    return None


def hub_problem(repo_id: str, repo_type: RepoType) -> str | None:
    """Why the hub's `repo_id` cannot be used from here, or None: it is cached, or the hub answers."""
    if in_local_cache(repo_id, repo_type):
        return None
    why = why_offline()
    if why is None:
        return None
    return (f"{repo_id!r} is a Hugging Face {repo_type} name, and this machine is offline ({why}) with no cached copy: "
            f"download it where the hub is reachable, or give a local path")  # fmt: skip
