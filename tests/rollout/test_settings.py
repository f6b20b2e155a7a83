"""The `rollout:` config section reaches the data module and the logged params; a lost server stops the
run with how to resume; the data module's split option is honoured; rollouts ahead (`max_staleness`) are refused
where they cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlvr_lightning.algos import DAPO
from rlvr_lightning.data.datamodule import RolloutDataModule
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.rollout.server_process import RolloutServerLost
from rlvr_lightning.rollout.settings import RolloutSettings, ServerSettings, StreamSettings, SyncSettings
from tests.entry_points.test_presets_config import make_cli
from tests.support.settings import checked
from tests.support.update_harness import attach

REPO = Path(__file__).resolve().parents[2]


def test_the_rollout_section_reaches_the_data_module_and_the_logged_params(tmp_path, monkeypatch):
    from rlvr_lightning.cli.config_logging import logged_params

    monkeypatch.chdir(tmp_path)
    cli = make_cli("grpo", REPO / "configs/algo/grpo.yaml", overrides=("--rollout.group_size", "4", "--rollout.top_k", "5"))
    rollout = cli.datamodule.rollout
    assert (rollout.group_size, rollout.top_k, rollout.max_response_length) == (4, 5, 40)  # 40: base.yaml
    assert rollout.sampling(seed=3).group_size == 4 and cli.datamodule.max_model_len() == 32 + 40
    params = logged_params(cli.config.as_dict(), cli.model)
    assert params["rollout.group_size"] == 4 and params["rollout.engine"] == "vllm"
    assert not any(k.startswith("data.rollout") for k in params)


def test_the_groups_reach_the_settings_as_dataclasses_or_dicts_and_check_their_own_values(tmp_path, monkeypatch):
    """`--rollout.servers.*`, `--rollout.stream.*`, `--rollout.sync.*`: from the command line, or in Python as
    dataclasses or plain dicts (the same settings); an unknown key names the group's fields."""
    monkeypatch.chdir(tmp_path)
    cli = make_cli("grpo", REPO / "configs/algo/grpo.yaml", overrides=("--rollout.engine", "vllm-server",
                   "--rollout.stream.max_staleness", "2", "--rollout.servers.urls", "[http://h:1]", "--rollout.sync.check_every", "3"))  # fmt: skip
    parsed = cli.datamodule.rollout
    assert parsed.stream == StreamSettings(max_staleness=2) and parsed.servers == ServerSettings(urls=["http://h:1"])
    assert parsed.sync == SyncSettings(check_every=3) and parsed.servers.elsewhere
    as_dicts = RolloutSettings(engine="vllm-server", stream={"max_staleness": 2}, servers={"urls": ["http://h:1"]},
                               sync={"check_every": 3})  # fmt: skip
    assert (as_dicts.stream, as_dicts.servers, as_dicts.sync) == (parsed.stream, parsed.servers, parsed.sync)
    with pytest.raises(ConfigError, match="rollout.stream: .*'stream_mode'; its settings are max_staleness, partial_rollouts, mode, "):
        RolloutSettings(stream={"stream_mode": "throughput"})
    with pytest.raises(ConfigError, match="rollout.servers.unresponsive_s must be > 0 seconds"):
        ServerSettings(unresponsive_s=0).check()
    with pytest.raises(ConfigError, match="rollout.stream.mode=throughput generates ahead of the trainer"):
        StreamSettings(mode="throughput").check()
    with pytest.raises(ConfigError, match="rollout.sync.check_every must be ≥ 1"):
        SyncSettings(check_every=0).check()
    with pytest.raises(ConfigError, match="rollout.servers.replicas must be ≥ 1"):
        RolloutSettings(engine="vllm-server", servers={"replicas": 0})
    RolloutSettings(engine="vllm", servers={"replicas": 0})  # checked only where servers are launched, as before


def test_a_lost_rollout_server_stops_with_how_to_resume(capsys, monkeypatch):
    import rlvr_lightning.cli as cli

    def lost(*args, **kwargs):
        raise RuntimeError("fit failed") from RolloutServerLost("rollout server http://h:1 failed twice")

    monkeypatch.setattr(cli, "RLVRCLI", lost)
    with pytest.raises(SystemExit):
        cli.main(["fit"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "failed twice" in err[0] and "make train RESUME=checkpoints/<run id>/last.ckpt" in err[0]


def test_train_split_picks_the_split_of_a_dataset_directory(tmp_path, tiny_policy_dir):
    for split, offset in (("train", 0), ("test", 100)):
        rows = [{"problem": f"What is {offset + i}+1?", "answer": str(offset + i + 1)} for i in range(4)]
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    dm = RolloutDataModule(model_name_or_path=str(tiny_policy_dir), train_data=str(tmp_path), train_split="test",
                           val_data=None, batch_size=2)  # fmt: skip
    dm.setup("fit")
    assert [r.answer for r in dm.train_records] == ["101", "102", "103", "104"]


def test_rollouts_ahead_are_refused_where_they_cannot_run(tiny_policy_dir):
    with pytest.raises(ConfigError, match="max_staleness=2 needs rollout.engine=vllm-server"):
        RolloutSettings(stream={"max_staleness": 2})
    with pytest.raises(ConfigError, match="partial_rollouts continues sequences across weight syncs"):
        RolloutSettings(engine="vllm-server", stream={"partial_rollouts": True})
    with pytest.raises(ConfigError, match="max_staleness must be an integer ≥ 0"):
        RolloutSettings(engine="vllm-server", stream={"max_staleness": -1})
    ahead = {"engine": "vllm-server", "stream": {"max_staleness": 2}}  # no server starts: the engine is built on first use
    checked(attach(DAPO, tiny_policy_dir, ahead))  # dynamic sampling refills from the stream
