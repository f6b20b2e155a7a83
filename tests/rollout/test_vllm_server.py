"""`vllm serve` replicas as the rollout engine, for real on CPU: token-id generation against the
in-process engine and the trainer, weight sync through vLLM's RL routes, a killed replica, a server that
does not come up, and no process left behind."""

from __future__ import annotations

import os
import shutil
import signal
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlvr_lightning.models.forward import sequence_logprobs
from rlvr_lightning.models.weights import full_weights
from rlvr_lightning.rollout.engine import WeightSyncError
from rlvr_lightning.rollout.server_process import RolloutServerError, RolloutServerLost, ServerSpec
from rlvr_lightning.rollout.settings import EngineSite, RolloutSettings, ServerSettings
from rlvr_lightning.rollout.sync import FP32_SYNC_TOL, WeightSyncProbe
from rlvr_lightning.rollout.types import SamplingConfig
from rlvr_lightning.rollout.vllm_server import VLLMServerEngine
from tests.support.tool_args import FIRST_RESULT_AS_CALL

pytestmark = pytest.mark.e2e

PROMPTS = ["What is 1+2-3?\n", "What is 17+20+9?\n", "Hi\n"]


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, from /proc."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(pid))
    return out


@pytest.fixture(scope="module")
def servers(tiny_policy_dir):
    spec = ServerSpec(str(tiny_policy_dir), max_model_len=128, dtype="float32")
    engine = VLLMServerEngine(spec, replicas=2, unresponsive_s=6.0)
    groups = [r.process.proc.pid for r in engine.replicas]
    yield engine
    engine.close()
    # Nothing left behind: every process of every server's group is gone (API server, engine core, worker).
    deadline = time.monotonic() + 30
    while any(group_members(g) for g in groups) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(group_members(g) for g in groups), [group_members(g) for g in groups]


def perturbed(model, scale: float = 0.05):
    """A copy of `model` with every weight moved by noise: other weights, visibly other log-probs."""
    moved = AutoModelForCausalLM.from_pretrained(model.name_or_path, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(scale * torch.randn_like(p))
    return moved


@pytest.fixture(scope="module")
def policy(tiny_policy_dir):
    tok = AutoTokenizer.from_pretrained(tiny_policy_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_policy_dir, dtype=torch.float32).eval()
    return tok, model


def test_token_id_generation_matches_the_trainer_and_the_in_process_engine(servers, policy, tiny_policy_dir):
    tok, model = policy
    prompt_ids = [tok(p).input_ids for p in PROMPTS]
    groups = servers.generate(prompt_ids, SamplingConfig(group_size=4, temperature=1.0, max_tokens=12, seed=7))
    assert [len(g) for g in groups] == [4, 4, 4]
    from rlvr_lightning.rollout.vllm_engine import VLLMEngine

    in_process = VLLMEngine(str(tiny_policy_dir), max_model_len=128, dtype="float32")
    try:
        for prompt, group in zip(prompt_ids, groups):
            for c in group:
                assert len(c.token_ids) == len(c.logprobs) > 0 and c.finish_reason in ("stop", "length")
                trainer = sequence_logprobs(model, prompt, c.token_ids)
                engine = in_process.logprobs(prompt, c.token_ids)
                assert max(abs(a - b) for a, b in zip(c.logprobs, engine)) < 1e-3
                assert max(abs(a - b) for a, b in zip(c.logprobs, trainer)) < 1e-3
    finally:
        in_process.close()
    # Per-request seeds: the same request gives the same samples, whatever else the servers ran.
    again = servers.generate(prompt_ids, SamplingConfig(group_size=4, temperature=1.0, max_tokens=12, seed=7))
    assert [[c.token_ids for c in g] for g in again] == [[c.token_ids for c in g] for g in groups]


def test_weight_sync_reaches_every_replica(servers, policy):
    tok, model = policy
    prompt, completion = tok("What is 2+2?\n").input_ids, tok("4\n").input_ids
    moved = perturbed(model)
    before = servers.logprobs(prompt, completion)
    servers.load_weights(full_weights(moved), version=3)
    assert servers.replicas.weight_versions() == ["3", "3"]
    after = servers.logprobs(prompt, completion)  # checks that both replicas agree, too
    trainer = sequence_logprobs(moved, prompt, completion)
    assert max(abs(a - b) for a, b in zip(after, trainer)) < 1e-3
    assert max(abs(a - b) for a, b in zip(before, after)) > 1e-2  # the perturbation is visible
    # Every generated sample carries the synced version (checked against the engine's own count).
    groups = servers.generate([prompt], SamplingConfig(group_size=2, max_tokens=4))
    assert len(groups[0]) == 2
    servers.load_weights(full_weights(model), version=4)  # back to the base weights for the other tests


def seeded_samples(servers, tok, seed: int) -> list[list[list[int]]]:
    """The token ids of two seeded samples of each of PROMPTS (one prompt per replica, in turn)."""
    groups = servers.generate([tok(p).input_ids for p in PROMPTS], SamplingConfig(group_size=2, max_tokens=8, seed=seed))
    return [[c.token_ids for c in g] for g in groups]


def test_a_killed_replica_is_restarted_with_the_current_weights(servers, policy):
    tok, model = policy
    prompt, completion = tok("What is 3+4?\n").input_ids, tok("7\n").input_ids
    expected = sequence_logprobs(model, prompt, completion)
    victim = servers.replicas[1].process
    old_group = victim.proc.pid
    before = servers.fault_counts()
    unharmed = seeded_samples(servers, tok, seed=5)
    os.killpg(old_group, signal.SIGKILL)
    victim.proc.wait()
    # Prompt 1 went to the dead replica: restarted, sent again with its seed, it sampled what it would have.
    assert seeded_samples(servers, tok, seed=5) == unharmed
    assert victim.alive() and victim.proc.pid != old_group
    after = servers.fault_counts()
    assert after["replica_restarts"] == before["replica_restarts"] + 1
    assert after["requests_reissued"] >= before["requests_reissued"] + 1
    assert servers.replicas.weight_versions() == ["4", "4"]
    assert max(abs(a - b) for a, b in zip(servers.logprobs(prompt, completion), expected)) < 1e-3


def test_a_frozen_replica_is_found_by_its_health_checks_restarted_and_its_requests_sent_again(servers, policy):
    """SIGSTOP freezes the whole server (API server, engine core, worker): it answers neither the request nor
    `/health`. The fixture's replicas count as frozen after 6 s without a health check answered."""
    tok, _ = policy
    victim = servers.replicas[1].process
    frozen_group = victim.proc.pid
    before = servers.fault_counts()
    unharmed = seeded_samples(servers, tok, seed=9)
    os.killpg(frozen_group, signal.SIGSTOP)
    try:
        start = time.monotonic()
        samples = seeded_samples(servers, tok, seed=9)
        waited = time.monotonic() - start
    finally:
        try:  # whatever of the frozen group is left (the restart killed it)
            os.killpg(frozen_group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert samples == unharmed
    assert victim.alive() and victim.proc.pid != frozen_group
    assert servers.fault_counts()["replica_restarts"] == before["replica_restarts"] + 1
    assert servers.replicas.weight_versions() == ["4", "4"]
    assert waited < 120, waited  # 6 s to notice, then a restart; not the request's own bound (over 600 s)


def test_a_replica_holding_other_weights_fails_the_probe(servers, policy):
    tok, model = policy
    prompt, completion = tok("What is 1+1?\n").input_ids, tok("2\n").input_ids
    moved = perturbed(model)
    path = servers.transport.write(full_weights(moved), version=99)
    servers.transport.load(servers.replicas[1], path)  # behind the engine's back: replica 1 only
    try:
        with pytest.raises(WeightSyncError, match="disagrees"):
            servers.logprobs(prompt, completion)
    finally:
        servers.load_weights(full_weights(model), version=5)


def test_a_failing_transport_is_named_with_the_way_to_choose_another(servers, policy, tmp_path):
    """The snapshot transport cannot write its shards (its directory is a file): the error names the
    transport and the setting that picks another, and the replicas keep their weights and serve."""
    tok, model = policy
    root, blocked = servers.transport.root, tmp_path / "not-a-directory"
    blocked.write_text("")
    servers.transport.root = blocked
    try:
        with pytest.raises(WeightSyncError, match=r"by the snapshot transport .*--rollout.sync.weight_transfer nccl"):
            servers.load_weights(full_weights(model), version=9)
    finally:
        servers.transport.root = root
    groups = servers.generate([tok("What is 1+2?\n").input_ids], SamplingConfig(group_size=2, max_tokens=4))
    assert len(groups[0]) == 2  # resumed after the failed sync
    servers.load_weights(full_weights(model), version=10)


def test_the_replicas_agree_within_the_probes_tolerance(servers, policy):
    """A replica a little off (between fp32's default tolerance and the former fixed 1e-3) fails a probe at
    fp32's tolerance: the replicas are held to the probe's tolerance, not a fixed one."""
    tok, model = policy
    prompt, completion = tok("What is 2+5?\n").input_ids, tok("7\n").input_ids
    moved = perturbed(model, scale=2e-5)
    off = max(
        abs(a - b)
        for a, b in zip(sequence_logprobs(model, prompt, completion), sequence_logprobs(moved, prompt, completion))
    )
    assert FP32_SYNC_TOL < off < 1e-3, off
    servers.transport.load(servers.replicas[1], servers.transport.write(full_weights(moved), version=98))
    probe = WeightSyncProbe(tol=FP32_SYNC_TOL)
    probe.probe = (prompt, completion)
    try:
        with pytest.raises(WeightSyncError, match="disagrees"):
            probe.check(servers, lambda p, c: sequence_logprobs(model, p, c), rollout=None)
    finally:
        servers.load_weights(full_weights(model), version=8)


def test_attaching_to_running_servers_leaves_them_running(servers, policy):
    tok, model = policy
    attached = VLLMServerEngine(servers.spec, urls=[r.url + "/" for r in servers.replicas])
    try:
        assert attached.holds_foreign_weights  # the trainer syncs its weights before the first rollout
        groups = attached.generate([tok(p).input_ids for p in PROMPTS], SamplingConfig(group_size=2, max_tokens=6))
        assert [len(g) for g in groups] == [2, 2, 2]
    finally:
        attached.close()
    assert all(r.process.alive() for r in servers.replicas)  # someone else's servers: not stopped
    servers.load_weights(full_weights(model), version=6)  # the launching engine's versions again


def test_a_server_that_does_not_start_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # not a model
    spec = ServerSpec(str(tmp_path), max_model_len=64, start_timeout_s=300)
    with pytest.raises(RolloutServerError, match=r"exited with code .* while starting; last lines of"):
        VLLMServerEngine(spec, replicas=1)


def test_server_args_and_start_timeout_reach_the_launched_servers(tiny_policy_dir):
    """`rollout.servers.args` go on every replica's command line (vLLM refuses an unknown flag, and the
    error's log tail shows it), and `rollout.servers.start_timeout_s` bounds the wait for health."""
    site = EngineSite(str(tiny_policy_dir), max_model_len=64, seed=0)
    running = set(serve_processes(tiny_policy_dir))  # the other tests' shared servers
    bad_flag = RolloutSettings(engine="vllm-server", servers={"args": ["--not-a-vllm-flag"]})
    with pytest.raises(RolloutServerError, match=r"(?s)while starting.*not-a-vllm-flag"):
        bad_flag.build_engine(site)
    impatient = RolloutSettings(engine="vllm-server", servers=ServerSettings(start_timeout_s=0.5))
    start = time.monotonic()
    with pytest.raises(RolloutServerError, match=r"not healthy after 0 s \(rollout.servers.start_timeout_s\)"):
        impatient.build_engine(site)
    assert time.monotonic() - start < 60  # it did not wait for vLLM to come up
    assert set(serve_processes(tiny_policy_dir)) <= running  # neither attempt left a server behind


def serve_processes(model_dir) -> list[int]:
    """Live `vllm serve` processes of this model, from /proc."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "serve" in cmd and str(model_dir) in cmd:
            out.append(int(pid))
    return out


def server_cli_run(tmp_path, tiny_policy_dir, steps: int, *flags: str):
    """A small CLI run on `vllm serve` replicas (with `flags`) probing every sync: the policy's own copy (its
    servers are told apart by path), the MLflow run, and `history(key)`, a metric's (step, value) pairs."""
    import shutil

    import mlflow

    from tests.support.cli import run_cli, small_run_args

    model_dir = shutil.copytree(tiny_policy_dir, tmp_path / "policy")
    args = [*small_run_args(tmp_path, model_dir), "--rollout_batches", str(steps), "--rollout.engine", "vllm-server",
            *flags, "--rollout.sync.check_every", "1"]  # fmt: skip
    proc = run_cli(args, tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs(client.get_experiment_by_name("rlvr_lightning").experiment_id)

    def history(key):
        return [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]

    return model_dir, run, history


def generated_tokens(engine: VLLMServerEngine) -> float:
    """Tokens the replicas have generated so far (vLLM's Prometheus counter)."""
    total = 0.0
    for r in engine.replicas:
        for line in engine.client.session.get(f"{r.url}/metrics", timeout=30).text.splitlines():
            if line.startswith("vllm:generation_tokens_total"):
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_requests_frozen_across_a_sync_continue_under_the_new_weights_with_each_tokens_version(servers, policy):
    """The throughput stream's partial rollouts: a sync during a request freezes it (`/pause?mode=keep`), and
    its later tokens come from the new weights; vLLM's weight-version spans give each token's version."""
    import threading

    tok, model = policy
    servers.load_weights(full_weights(model), version=6)
    servers.stream_across_syncs(keep_partial=True)
    try:
        out = {}
        sampling = SamplingConfig(group_size=256, temperature=1.0, max_tokens=100, seed=5)
        request = threading.Thread(target=lambda: out.update(g=servers.generate([tok("Hi\n").input_ids], sampling)))
        moved = full_weights(perturbed(model))  # before the request: loading it takes longer than generating
        before = generated_tokens(servers)
        request.start()
        deadline = time.monotonic() + 60
        while generated_tokens(servers) == before and time.monotonic() < deadline:  # until decoding has begun
            time.sleep(0.01)
        servers.load_weights(moved, version=7)  # 256 × 100 tokens take seconds on CPU, even on a quiet machine
        request.join()
        (group,) = out["g"]
        versions = [c.versions for c in group]
        assert all(len(v) == len(c.token_ids) == len(c.logprobs) for v, c in zip(versions, group))
        assert all(v == sorted(v) and set(v) <= {6, 7} for v in versions)  # version 6 until the sync, then 7
        assert any(6 in v and 7 in v for v in versions), "no sequence was interrupted by the sync"
    finally:
        servers.across_syncs, servers.pause_mode = False, "wait"
        servers.load_weights(full_weights(model), version=8)


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
def test_cli_run_in_throughput_mode_trains_groups_as_they_finish_within_the_staleness(tmp_path, quick_warm_start):
    """GRPO in the throughput mode (k = 2, partial rollouts, late groups dropped) on a `vllm serve` replica the
    trainer launches, probed after every sync, with answers that call the Python tool: a group's turns are
    requests of their own, and a sync may fall between two (or freeze one); each token keeps its version. (Two
    launched replicas streaming ahead through the CLI are tests/e2e/test_stream_resume.py's run; one version
    ahead, tests/training/test_rollout_stream.py's.)"""
    model_dir, run, history = server_cli_run(tmp_path, quick_warm_start[1], 5, "--rollout.stream.max_staleness", "2",
                                           "--rollout.stream.partial_rollouts", "true", "--rollout.stream.mode", "throughput",
                                           "--rollout.stream.stale_groups", "drop", *FIRST_RESULT_AS_CALL)  # fmt: skip
    assert [s for s, _ in history("train/groups_dropped")] == [0, 1, 2, 3, 4]
    assert all(0 <= v <= 2 for _, v in history("train/staleness_max"))
    assert max(v for _, v in history("train/sync_probe_max_abs_diff")) < 1e-3  # probed after every sync
    assert min(v for _, v in history("train/tool_calls_per_answer")) > 0
    assert run.data.tags["engine"] == "vllm-server"
    assert serve_processes(model_dir) == []  # the trainer took its servers down with it


def test_an_attached_server_that_dies_stops_the_run_with_how_to_resume(servers, policy):
    """Last of the tests on the shared servers: it kills one."""
    tok, _ = policy
    attached = VLLMServerEngine(servers.spec, urls=[servers.replicas[0].url])
    try:
        victim = servers.replicas[0].process
        os.killpg(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait()
        with pytest.raises(RolloutServerLost, match=rf"no rollout server remains: {attached.replicas[0].url} stopped answering.*rollout.servers.urls"):
            attached.generate([tok(PROMPTS[0]).input_ids], SamplingConfig(group_size=2, max_tokens=4))
    finally:
        attached.close()


def test_two_fsdp_ranks_share_attached_servers(tmp_path, quick_warm_start):
    """Two trainer ranks (FSDP2 on CPU) sharing one attached server, each streaming two versions ahead with
    partial rollouts: rank 0 alone writes the weights, every rank gathers them and waits for the sync (and its
    own segments) before it samples or probes again."""
    import json

    import mlflow

    from tests.e2e.test_fsdp import STEPS, fsdp_args
    from tests.support.cli import run_cli

    _, model_dir = quick_warm_start
    launcher = VLLMServerEngine(ServerSpec(str(model_dir), max_model_len=256, dtype="float32"), replicas=1)
    try:
        url = launcher.replicas[0].url
        args = [*fsdp_args(tmp_path, model_dir), "--rollout.engine", "vllm-server", "--rollout.servers.urls", f"[{url}]",
                "--rollout.stream.max_staleness", "2", "--rollout.stream.partial_rollouts", "true",
                "--rollout.sync.check_every", "1"]  # fmt: skip
        proc = run_cli(args, tmp_path, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert launcher.replicas[0].process.alive()  # attached: the trainer left it running
        # One write per sync (versions 1..STEPS; the attach sync at start is version 0), by rank 0.
        assert launcher.replicas.weight_versions() == [str(STEPS)]
        for r in (0, 1):  # after the last sync, the shared server runs every rank's (the same) trained weights
            assert json.loads((tmp_path / "probe" / f"rank{r}_engine.json").read_text())["max_abs_diff"] < 1e-3
        client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
        (run,) = client.search_runs(client.get_experiment_by_name("rlvr_lightning").experiment_id)
        lags = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/staleness_max"))
        assert lags == [(0, 0.0), (1, 1.0), *((s, 2.0) for s in range(2, STEPS))]  # two versions ahead
        assert max(m.value for m in client.get_metric_history(run.info.run_id, "train/sync_probe_max_abs_diff")) < 1e-3
    finally:
        launcher.close()
