"""FSDP2 on 2 CPU ranks (gloo) through the CLI: the policy is sharded (each rank holds about
half), the weights gathered after training equal a single-process replay of the same rollouts, and each
rank's rollout engine runs them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from rlvr_lightning.algos.grpo import GRPO
from rlvr_lightning.data.datamodule import RolloutDataModule
from rlvr_lightning.models.lora import LoraSettings, load_adapter_weights
from rlvr_lightning.models.weights import full_weights
from rlvr_lightning.rollout.settings import RolloutSettings
from rlvr_lightning.rollout.types import PromptBatch, Rollout
from rlvr_lightning.standalone import standalone
from rlvr_lightning.training.step import StepAlgorithm
from tests.support.cli import REPO, run_cli
from tests.support.fsdp_probe import EVEN_LENGTH
from tests.support.tool_args import BOXED_AS_CALLS

STEPS, PROMPTS_PER_RANK, G, RESPONSE = 3, 2, 8, 40
# The module's options by their CLI names (a group's as `group.option`); micro-batches: accumulation is exercised too.
HPARAMS = {"optim.lr": 1e-4, "kl_coef": 0.001, "compute.micro_batch_size": 8}


def module_args(options: dict) -> dict:
    """The module's keyword arguments for options by their CLI names (`optim.lr` → `optim={"lr": …}`)."""
    args: dict = {}
    for name, value in options.items():
        group, _, option = name.rpartition(".")
        (args.setdefault(group, {}) if group else args)[option] = value
    return args


def fsdp_args(tmp_path: Path, model_dir: Path, algo: str = "grpo") -> list[str]:
    (tmp_path / "probe.yaml").write_text(
        "trainer:\n  callbacks+:\n    - class_path: tests.support.fsdp_probe.ShardProbe\n"
        f"      init_args: {{out: {tmp_path / 'probe'}}}\n"
    )
    return [
        "fit", "--config", str(REPO / "configs/base.yaml"), "--config", str(REPO / f"configs/algo/{algo}.yaml"),
        "--config", str(REPO / "configs/strategy/fsdp.yaml"), "--config", str(tmp_path / "probe.yaml"),
        "--trainer.devices", "2", "--trainer.accelerator", "cpu", "--rollout_batches", str(STEPS),
        "--trainer.logger.init_args.tracking_uri", f"sqlite:///{tmp_path}/mlflow.db",
        "--trainer.logger.init_args.artifact_location", str(tmp_path / "artifacts"),
        "--data.model_name_or_path", str(model_dir), "--data.batch_size", str(PROMPTS_PER_RANK),
        "--rollout.group_size", str(G), "--data.val_size", "8", "--rollout.max_response_length", str(RESPONSE),
        *[f"--model.init_args.{k}={v}" for k, v in HPARAMS.items()], f"--model.init_args.rewards.correctness={EVEN_LENGTH}",
    ]  # fmt: skip


class Recorded(StepAlgorithm):
    """The step trains on the recorded rollouts, in the order they are queued, instead of generating them."""

    def __init__(self) -> None:
        self.queued: list[Rollout] = []

    def collect(self, step, batch, timer, stream) -> Rollout:
        return self.queued.pop(0)


def replay(
    model_dir: Path, probe: Path, lora: LoraSettings | None = None, hparams: dict = HPARAMS, **algorithm
) -> dict[str, torch.Tensor]:
    """The same steps in one process: both ranks' rollouts of a step form one rollout batch (a LoRA policy
    from the run's initial adapter); the final weights as the engine gets them (a LoRA policy's merged).
    `algorithm`: more of the module's arguments (a teacher)."""
    dm = RolloutDataModule(model_name_or_path=str(model_dir), batch_size=2 * PROMPTS_PER_RANK, val_data=None, rollout=RolloutSettings(group_size=G, max_response_length=RESPONSE, engine="hf"))  # fmt: skip
    module = standalone(GRPO(**module_args(hparams), lora=lora, **algorithm), dm)
    recorded = Recorded()
    module.step_algorithm = lambda *_: recorded  # before the step is first built
    if lora is not None:
        load_adapter_weights(module.policy, torch.load(probe / "initial_adapter.pt", weights_only=True))
    try:
        for step in range(STEPS):
            parts = [torch.load(probe / f"rank{r}_step{step}.pt", weights_only=False) for r in (0, 1)]
            rollout = Rollout(
                batch=PromptBatch.concat([p["batch"] for p in parts]), group_size=G,
                prompt_ids=[x for p in parts for x in p["prompt_ids"]],
                completions=[c for p in parts for c in p["completions"]], sampling=parts[0]["sampling"],
                policy_version=module.session.policy_version, texts=[t for p in parts for t in p["texts"]],
                correct=torch.cat([p["correct"] for p in parts]),
            )  # fmt: skip
            recorded.queued.append(rollout)
            module.train_on_batch(rollout.batch)
            module.rollout_batches += 1
        return {k: v.detach().clone() for k, v in full_weights(module.policy)}
    finally:
        module.teardown("fit")


@pytest.mark.e2e
# Two step structures: full weights with token-budget micro-batches and THR, and a LoRA adapter with row
# micro-batches. Plain GRPO on full weights is the first without THR (its own fit was dropped: THR's p = 0
# equals its base, and that row and token-budget micro-batches give one update is training/test_update.py's).
@pytest.mark.parametrize("algo", ["thr", "grpo-opd-lora"])
def test_fsdp2_two_cpu_ranks_shard_train_like_one_process_and_sync_engines(tmp_path, quick_warm_start, tiny_policy_dir, algo):
    """`thr`: THR (p = 0.2) scores each rank's groups inside the sharded update's forward, with
    micro-batches by token budget (whole groups, sorted by length; ranks agree on their count), and the answers
    call the Python tool (its outputs inserted, out of the loss); the update must still equal the single-process
    replay with THR and row micro-batches of G = 8, and the held-out evaluation runs in the tool on both ranks.
    `grpo-opd-lora`: a LoRA policy (adapters sharded with their layers, the KL reference its base) synced to each
    rank's engine as an adapter, distilling an untrained teacher sharded in the trainer (GRPO's advantage plus the
    teacher's per-token term): the replay's teacher is whole."""
    if algo == "thr" and shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed: the tool's sandbox cannot start")
    _, model_dir = quick_warm_start
    lora = LoraSettings(rank=8, sync="adapter") if algo == "grpo-opd-lora" else None
    teacher = {"model_name_or_path": str(tiny_policy_dir)} if algo == "grpo-opd-lora" else None
    args = fsdp_args(tmp_path, model_dir, algo.removesuffix("-lora"))
    if lora is not None:  # LoRA's usual larger steps, so the adapter moves measurably in 3 steps
        args += ["--model.init_args.lora.rank=8", "--model.init_args.lora.sync=adapter", "--model.init_args.optim.lr=1e-3"]
    if teacher is not None:
        args.append(f"--model.init_args.teacher.model_name_or_path={tiny_policy_dir}")
    if algo == "thr":  # ~1 or 2 groups of ≤ 8 × 70 tokens per micro-batch, depending on their lengths
        args.append("--model.init_args.compute.max_tokens_per_micro_batch=1000")
        args += BOXED_AS_CALLS  # each rank's answers call the tool in its own sandbox; THR weighs the sampled tokens
    proc = run_cli(args, tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    probe = tmp_path / "probe"

    shards = [json.loads((probe / f"rank{r}_shard.json").read_text()) for r in (0, 1)]
    assert all(s["sharded"] and s["world"] == 2 for s in shards)
    assert sum(s["local"] for s in shards) == shards[0]["total"]
    assert all(0.4 < s["local"] / s["total"] < 0.6 for s in shards), shards  # each rank holds about half
    assert all(s.get("teacher_sharded", teacher is None) for s in shards), shards

    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs(client.get_experiment_by_name("rlvr_lightning").experiment_id)
    assert run.data.metrics["val/num_problems"] == 8  # each rank scored 4 of the 8 held-out problems
    if algo == "thr":
        assert run.data.metrics["val/tool_calls_per_answer"] > 0 and run.data.metrics["train/inserted_token_frac"] > 0

    for r in (0, 1):  # each rank's engine runs the trained weights
        assert json.loads((probe / f"rank{r}_engine.json").read_text())["max_abs_diff"] < 1e-3
    gathered = torch.load(probe / "final_weights.pt", weights_only=True)
    initial = standalone(
        GRPO(),
        RolloutDataModule(model_name_or_path=str(model_dir), val_data=None, rollout=RolloutSettings(engine="hf")),
    )
    hparams = {**HPARAMS, "optim.lr": 1e-3} if lora is not None else HPARAMS
    distils = {} if teacher is None else {"advantage_estimator": {"name": "opd", "knobs": {"opd_reward": "grpo"}}, "teacher": teacher}
    shapers = {"thr": {"p": 0.2}} if algo == "thr" else {}
    reference = replay(model_dir, probe, lora, hparams, shapers=shapers, **distils)
    moved = max((reference[k] - p).abs().max().item() for k, p in initial.policy.state_dict().items())
    assert moved > 1e-5  # the steps changed the weights, so equality below means something
    # To the rounding of two ranks' reductions against one process's: within 1e-6 on some CPUs, 3.0e-6 on a Sapphire
    # Rapids Xeon (pinned AVX2 kernels); a wrong update misses by the order of the steps' own movement (`moved`).
    for name, tensor in reference.items():
        torch.testing.assert_close(gathered[name], tensor, rtol=0, atol=5e-6, msg=name)
