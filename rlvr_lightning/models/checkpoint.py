"""Turn a Lightning training checkpoint (`.ckpt`) into an HF model directory that transformers and vLLM
load, so `make eval CKPT=path/to/last.ckpt` evaluates exactly the weights that were saved.

A Lightning checkpoint holds the module's `state_dict` (the policy under `policy.`, plus the optimizer
and training state) and the data module's hyper-parameters, which name the base model: its config and
tokenizer are taken from there and the trained weights loaded over it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlvr_lightning.errors import ConfigError

POLICY_PREFIX = "policy."


def is_lightning_checkpoint(path: str) -> bool:
    return path.endswith(".ckpt")


def policy_from_checkpoint(ckpt: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write the policy of `ckpt` as an HF directory (default: `<ckpt without .ckpt>-hf` beside it).

    Reuses that directory when it is newer than the checkpoint.
    """
    from transformers import AutoModelForCausalLM

    from rlvr_lightning.models.embedded import save_policy
    from rlvr_lightning.models.lora import apply_lora, as_settings
    from rlvr_lightning.models.policy import load_tokenizer
    from rlvr_lightning.models.warm_start import resolve_policy_path
    from rlvr_lightning.models.weights import full_weights

    ckpt = Path(ckpt)
    if not ckpt.is_file():
        kind = "a directory (a sharded checkpoint?)" if ckpt.is_dir() else "not found"
        raise ConfigError(f"checkpoint {ckpt}: {kind}; expected a Lightning .ckpt file")
    out = Path(out_dir) if out_dir is not None else ckpt.with_name(ckpt.stem + "-hf")
    if (out / "config.json").exists() and out.stat().st_mtime >= ckpt.stat().st_mtime:
        return out
    try:
        # weights_only=False: Lightning checkpoints store hyper-parameters as plain Python objects.
        # Only load checkpoints you trust, as with any pickle.
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
    except Exception as err:  # truncated file, not a torch file at all
        raise ConfigError(f"checkpoint {ckpt}: cannot be read ({type(err).__name__}: {err})") from None
    base = (state.get("datamodule_hyper_parameters") or {}).get("model_name_or_path")
    weights = {k[len(POLICY_PREFIX) :]: v for k, v in state.get("state_dict", {}).items() if k.startswith(POLICY_PREFIX)}
    if base is None or not weights:
        raise ConfigError(f"checkpoint {ckpt}: not an rlvr_lightning checkpoint (no data module model or policy weights)")
    base_path = resolve_policy_path(base)
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    lora = as_settings((state.get("hyper_parameters") or {}).get("lora"))
    if lora is not None:  # a LoRA policy: base + adapter as trained, written with the adapter merged
        apply_lora(model, lora)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])  # e.g. lm_head.weight, restored by tying
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ConfigError(
            f"checkpoint {ckpt}: its policy does not match the base model {base!r} "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    model.config.use_cache = True  # training turns the KV cache off; inference wants it
    merged = dict(full_weights(model)) if lora is not None else None
    return save_policy(model, load_tokenizer(base_path), out, state_dict=merged)


def check_state_fits(saved: dict | None, expected: dict) -> None:
    """A checkpoint's `state_dict` that does not fit the module's `expected` is one ConfigError line."""
    mismatch = state_mismatch(saved, expected)
    if mismatch:
        raise ConfigError(f"ckpt_path: the checkpoint's weights do not fit this run's model: {mismatch}; a run "
                          "resumes with the model and LoRA settings it was trained with")  # fmt: skip


def state_mismatch(saved: dict | None, expected: dict) -> str | None:
    """The first way a checkpoint's `state_dict` does not fit a module's (a weight missing, one more, another
    shape), in words; None when it fits, or when there is none to compare (a sharded checkpoint is read
    straight into the module's shards)."""
    if not saved:
        return None
    missing, extra = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
    if missing:
        return f"{len(missing)} weights missing from it (first: {missing[0]})"
    if extra:
        return f"{len(extra)} weights it holds that the model lacks (first: {extra[0]})"
    for name, tensor in expected.items():
        if tuple(saved[name].shape) != tuple(tensor.shape):
            return f"{name} is {tuple(saved[name].shape)} in it and {tuple(tensor.shape)} in the model"
    return None
