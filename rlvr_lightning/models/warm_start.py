"""Supervised warm start of the embedded policy, cached on disk and reused.

A plain PyTorch loop on purpose: it is a one-off preprocessing step of about a minute on two CPU
cores, with no logging, checkpointing or distribution needs that would justify a Trainer.
The result is keyed by everything that determines it, so changing any knob builds a new one and
concurrent processes (e.g. several ranks) build it only once (file lock).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from filelock import FileLock

from rlvr_lightning.models import multiplication_task
from rlvr_lightning.models.embedded import TinyQwen2Spec, build_char_tokenizer, build_tiny_qwen2, save_policy
from rlvr_lightning.models.embedded_task import ArithmeticProblem, flawed_demonstration
from rlvr_lightning.models.tasks import EMBEDDED_TASKS

log = logging.getLogger(__name__)
SAVE_EVERY_S = 30.0  # an interrupted warm start loses at most this much work
EMBEDDED = "embedded"
_FORMAT_VERSION = 2  # bump when the builder or task changes in a way the key cannot see
SHIPPED = Path(__file__).parent / "shipped"  # warm-start weights the package ships, by their key


@dataclass(frozen=True)
class WarmStartConfig:
    steps: int = 500
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 50
    wrong_format_prob: float = 0.5
    slip_prob: float = 0.2
    task_seed: int = 0
    seed: int = 0
    spec: TinyQwen2Spec = field(default_factory=TinyQwen2Spec)
    task: str = "embedded"  # a name in `EMBEDDED_TASKS`
    tool_prob: float = 0.0  # embedded-multiply: the share of demonstrations that call the Python tool

    def key(self) -> str:
        fields = asdict(self)
        for name in _LATER_FIELDS:  # in the key only when set: the caches built before they existed stay valid
            if fields[name] == WarmStartConfig.__dataclass_fields__[name].default:
                del fields[name]
        blob = json.dumps({"v": _FORMAT_VERSION, **fields}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


_LATER_FIELDS = ("task", "tool_prob")


def cache_root() -> Path:
    return Path(os.environ.get("RLVR_CACHE_DIR", Path.home() / ".cache" / "rlvr_lightning"))


def embedded_policy_path(cfg: WarmStartConfig | None = None) -> Path:
    """Directory of the warm-started embedded policy; built on first use."""
    cfg = cfg or WarmStartConfig()
    out = cache_root() / f"embedded-{cfg.key()}"
    if (out / "warm_start.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if not (out / "warm_start.json").exists():
            _build(cfg, out)
    return out


def _lr_at(step: int, cfg: WarmStartConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * progress))


def shipped_weights(cfg: WarmStartConfig) -> Path:
    """Where the package ships a warm start's weights, which every machine then starts from instead of building them:
    the default's (the weights the results pages were made from, built before the CPU kernels were pinned, so that
    no build under the pin reproduces them) and `embedded-tir`'s (built under the pin: 2000 steps take minutes)."""
    return SHIPPED / f"embedded-{cfg.key()}.safetensors"


def _build(cfg: WarmStartConfig, out: Path) -> None:
    t0 = time.time()
    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen2(tokenizer, cfg.spec, seed=cfg.seed)
    tmp = out.with_name(out.name + ".tmp")
    shipped = shipped_weights(cfg)
    if shipped.is_file():
        save_policy(model, tokenizer, tmp)  # its configuration and tokenizer; the weights are the shipped ones
        shutil.copyfile(shipped, tmp / "model.safetensors")
        meta = {"config": asdict(cfg), "shipped": shipped.name}
    else:
        log.info("Building the embedded warm-start policy (%d steps) in %s", cfg.steps, out)
        partial = out.with_name(out.name + ".partial")  # the build's state, so that an interrupted one resumes
        loss = warm_start(model, tokenizer, cfg, resume_dir=partial)
        save_policy(model, tokenizer, tmp)
        shutil.rmtree(partial, ignore_errors=True)
        meta = {"config": asdict(cfg), "final_loss": loss, "seconds": round(time.time() - t0, 1)}
    (tmp / "warm_start.json").write_text(json.dumps(meta, indent=2))
    tmp.rename(out)  # atomic: a half-written cache entry is never picked up


def demonstration(problem, rng: random.Random, cfg: WarmStartConfig) -> list[tuple[str, bool]]:
    """A flawed demonstration of `problem` as (text, trained) pieces (a tool's output is not trained on)."""
    if isinstance(problem, multiplication_task.MultiplicationProblem):
        return multiplication_task.flawed_demonstration(problem, rng, cfg.tool_prob, cfg.slip_prob)
    return [(flawed_demonstration(problem, rng, cfg.wrong_format_prob, cfg.slip_prob), True)]


def warm_start(
    model: torch.nn.Module,
    tokenizer,
    cfg: WarmStartConfig,
    problems: Sequence[ArithmeticProblem] | None = None,
    resume_dir: Path | None = None,
    save_every_s: float = SAVE_EVERY_S,
) -> float:
    """Train `model` in place on flawed demonstrations of `cfg.task`'s training problems, or of
    `problems` (each batch samples them without replacement: at least `cfg.batch_size`, repeat a short
    list); every field of `cfg` is used but `spec`, which only sizes the embedded model. Returns the
    last step's loss. Any HF causal LM with the embedded tokenizer works (`models.families`).
    A progress bar with its ETA shows every few seconds. With `resume_dir`, the build's whole state (weights,
    optimizer, the demonstrations' random generator, the step) is saved there every `save_every_s` seconds, and a
    build that finds it goes on from there: an interrupted build resumes and ends with the weights an uninterrupted
    one would have, bit for bit."""
    from tqdm.auto import tqdm

    train = list(problems) if problems is not None else EMBEDDED_TASKS[cfg.task](seed=cfg.task_seed)[0]
    rng = random.Random(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    start = load_build_state(resume_dir, model, opt, rng) if resume_dir is not None else 0
    if start:
        log.info("Resuming the warm start at step %d/%d from %s", start, cfg.steps, resume_dir)
    model.train()
    saved_at = time.monotonic()
    progress = tqdm(total=cfg.steps, initial=start, desc="warm start", unit="step", mininterval=2.0, dynamic_ncols=True)
    for step in range(start, cfg.steps):
        batch = rng.sample(train, cfg.batch_size)
        prompts = [tokenizer(p.prompt()).input_ids for p in batch]
        targets = [_target(tokenizer, demonstration(p, rng, cfg)) for p in batch]
        input_ids, labels, attn = _pack_right_padded(prompts, targets, tokenizer.pad_token_id)
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, cfg)
        loss = model(input_ids=input_ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        progress.update(1)
        if step % 100 == 0 or step == cfg.steps - 1:
            progress.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
        if resume_dir is not None and time.monotonic() - saved_at > save_every_s and step + 1 < cfg.steps:
            save_build_state(resume_dir, model, opt, rng, step + 1)
            saved_at = time.monotonic()
    progress.close()
    return loss.item()


def save_build_state(directory: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, rng: random.Random, step: int) -> None:
    """The build's state after `step` steps, written whole or not at all (a temporary file renamed)."""
    directory.mkdir(parents=True, exist_ok=True)
    state = {"step": step, "model": model.state_dict(), "optimizer": opt.state_dict(), "rng": rng.getstate(),
             "torch_rng": torch.get_rng_state()}  # fmt: skip
    torch.save(state, directory / "state.pt.tmp")
    os.replace(directory / "state.pt.tmp", directory / "state.pt")


def load_build_state(directory: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, rng: random.Random) -> int:
    """The step a saved build state resumes at (0: none saved), its weights, optimizer and generators restored."""
    path = directory / "state.pt"
    if not path.is_file():
        return 0
    state = torch.load(path, weights_only=False)  # the build's own file, in this machine's cache
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    rng.setstate(state["rng"])
    torch.set_rng_state(state["torch_rng"])
    return int(state["step"])


def _target(tokenizer, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
    """The demonstration's ids then EOS, and whether each is trained on; pieces are tokenized one by one, as the
    rollout appends a tool's output."""
    ids, trained = [], []
    for text, train in pieces:
        piece = tokenizer(text).input_ids
        ids += piece
        trained += [train] * len(piece)
    return ids + [tokenizer.eos_token_id], trained + [True]


def _pack_right_padded(prompts: list[list[int]], targets: list[tuple[list[int], list[bool]]], pad_id: int):
    """Concatenate prompt+target, right-pad, and mask the prompt and the target ids not trained on out of the
    labels (−100)."""
    width = max(len(p) + len(t) for p, (t, _) in zip(prompts, targets))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    attn = torch.zeros_like(ids)
    for i, (p, (t, trained)) in enumerate(zip(prompts, targets)):
        n = len(p) + len(t)
        ids[i, :n] = torch.tensor(p + t)
        labels[i, len(p) : n] = torch.where(torch.tensor(trained), torch.tensor(t), -100)
        attn[i, :n] = 1
    return ids, labels, attn


EMBEDDED_WARM_STARTS = {  # a name usable as data.model_name_or_path → the warm start it builds
    EMBEDDED: WarmStartConfig(),
    # Clean demonstrations: 43% of the samples at T = 1 are correct (greedy 76%) where the default's
    # are 15%, so the rewards are close to class-balanced, the regime the REAL paper's models start in.
    "embedded-balanced": WarmStartConfig(wrong_format_prob=0.0, slip_prob=0.0),
    # The Python tool's task (`grpo-tir`): half the demonstrations call the tool, a fifth of those mistyping a factor.
    # 2000 steps: copying the factors into the call is learned by 1000; copying the output into the answer, which
    # the answers in the head compete with, reaches about a quarter of the calls by 2000 (docs/tools.md).
    "embedded-tir": WarmStartConfig(task="embedded-multiply", tool_prob=0.5, slip_prob=0.2, steps=2000),
}


def warm_start_digest(name_or_path: str, build: bool = True) -> str | None:
    """The sha256 (first 12 hex digits) of an embedded warm start's weights; None for any other model (its name
    or path says what it is). The warm start is built where it is first used, and a build on another machine
    or with other library versions need not be bit-identical: runs that began from different builds are not
    comparable, and this digest (an MLflow tag of each run) tells them apart. `build` False: None for a warm start
    neither shipped nor built here yet (not known without building it)."""
    cfg = EMBEDDED_WARM_STARTS.get(name_or_path)
    if cfg is None:
        return None
    cached = cache_root() / f"embedded-{cfg.key()}" / "model.safetensors"
    if build or cached.is_file():
        weights = embedded_policy_path(cfg) / "model.safetensors"
    else:
        weights = shipped_weights(cfg)
    return hashlib.sha256(weights.read_bytes()).hexdigest()[:12] if weights.is_file() else None


def resolve_policy_path(name_or_path: str) -> str:
    """A name in `EMBEDDED_WARM_STARTS` → its cached warm-start directory (built on first use); anything
    else is returned for HF to resolve."""
    cfg = EMBEDDED_WARM_STARTS.get(name_or_path)
    return str(embedded_policy_path(cfg)) if cfg is not None else name_or_path
