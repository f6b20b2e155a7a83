"""Whether a hub name can be used before any work (`models.hub`): a local path is never taken for a hub name, a
cached copy is found without the network, and an offline machine says why."""

from __future__ import annotations

import pytest

from rlvr_lightning.models import hub


@pytest.mark.parametrize(
    ("name", "path"),
    [("Qwen/Qwen2.5-0.5B", False), ("gpt2", False), ("HuggingFaceH4/MATH-500", False), ("./model", True),
     ("/data/model", True), ("~/model", True), ("a/b/c", True), ("train.jsonl", True), ("my data", True)],
)  # fmt: skip
def test_a_local_path_is_never_taken_for_a_hub_name(name, path):
    assert hub.looks_like_path(name) is path


def test_a_cached_copy_is_usable_offline_and_an_uncached_one_says_why(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    hub.why_offline.cache_clear()
    try:
        (tmp_path / "hub" / "models--Qwen--Qwen2.5-0.5B" / "snapshots").mkdir(parents=True)
        (tmp_path / "datasets" / "HuggingFaceH4___math-500").mkdir(parents=True)
        assert hub.hub_problem("Qwen/Qwen2.5-0.5B", "model") is None
        assert hub.hub_problem("HuggingFaceH4/math-500", "dataset") is None  # the `datasets` library's own cache
        problem = hub.hub_problem("Qwen/Qwen2.5-7B", "model")
        assert problem is not None and "offline (HF_HUB_OFFLINE=1) with no cached copy" in problem
    finally:
        hub.why_offline.cache_clear()
