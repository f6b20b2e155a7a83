"""The embedded default policy: a tiny Qwen2-architecture causal LM and a character-level tokenizer.

Both are built locally (no model hub is needed) and saved in the ordinary HF layout
(`config.json`, `model.safetensors`, `tokenizer.json`), so the trainer, vLLM and any HF tool load
them through exactly the code path a user's own model takes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"


@dataclass(frozen=True)
class TinyQwen2Spec:
    """Size of the embedded model (0.86M parameters at the defaults)."""

    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 2
    num_key_value_heads: int = 2
    intermediate_size: int = 512
    max_position_embeddings: int = 256

    def as_dict(self) -> dict:
        return asdict(self)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with no merges: exactly one token per byte (per character for ASCII).

    Why byte-level and not a plain character vocabulary: transformers 5 loads every `qwen2`
    checkpoint's tokenizer as `Qwen2Tokenizer`, which imposes byte-level pre-tokenization. A plain
    character vocabulary then silently loses spaces and newlines on reload (in the trainer and in
    vLLM alike); the byte-level alphabet tokenizes identically before and after a reload.
    """
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate([PAD, EOS, UNK] + alphabet)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK, padding_side="left"
    )
    tok.model_max_length = TinyQwen2Spec.max_position_embeddings
    return tok


def tiny_qwen2_config(tokenizer: PreTrainedTokenizerFast, spec: TinyQwen2Spec) -> Qwen2Config:
    # The vocabulary is padded to a multiple of 64 so that every kernel sees aligned shapes.
    vocab_size = (len(tokenizer) + 63) // 64 * 64
    return Qwen2Config(
        vocab_size=vocab_size,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rope_theta=10000.0,
        torch_dtype="float32",
        **spec.as_dict(),
    )


def build_tiny_qwen2(tokenizer: PreTrainedTokenizerFast, spec: TinyQwen2Spec, seed: int) -> Qwen2ForCausalLM:
    config = tiny_qwen2_config(tokenizer, spec)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def save_policy(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, out_dir: str | Path, state_dict: dict | None = None
) -> Path:
    """Write an HF-format directory that transformers and vLLM load directly (`state_dict`: full
    tensors to write instead of the model's own, e.g. gathered from FSDP shards)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True, state_dict=state_dict)
    tokenizer.save_pretrained(out)
    return out
