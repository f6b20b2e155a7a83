"""A random-init Qwen2-architecture model with a large vocabulary (Qwen2.5's 151,936 by default).

For memory and throughput work at real vocabulary sizes without a model hub: the LM head and the
embedding have the shape of a Qwen2.5 model's, the transformer in between is tiny (2 layers, hidden
256 by default). The tokenizer has exactly `vocab_size` ids, so every id the model can sample
decodes: the embedded model's byte-level alphabet (one token per byte, so the embedded arithmetic
prompts and any text encode) plus `<pad>`, `<eos>`, `<unk>`, then filler tokens `<|f…|>` that
encoding never produces (no merges) and that decode to their own ASCII text.

The directory is written in the ordinary HF layout (`config.json`, `model.safetensors`,
`tokenizer.json`), so the trainer and vLLM load it like a user's model, and cached under
`cache_root()` keyed by every setting, so repeated runs reuse it:

    python -m rlvr_lightning.models.synthetic --out .cache/models/qwen2-151k --vocab-size 151936 \\
        --hidden-size 256 --layers 2

(`--out` becomes a symlink to the cached directory; without `--out` the cached path is printed.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from filelock import FileLock
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from rlvr_lightning.models.embedded import EOS, PAD, UNK, save_policy
from rlvr_lightning.models.warm_start import cache_root

log = logging.getLogger(__name__)
QWEN25_VOCAB = 151_936
_FORMAT_VERSION = 1  # bump when the builder changes in a way the key cannot see
_MARKER = "synthetic.json"


@dataclass(frozen=True)
class SyntheticQwen2Spec:
    """Shape of the synthetic model; 40.9M parameters at the defaults (38.9M of them the tied embedding)."""

    vocab_size: int = QWEN25_VOCAB
    hidden_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4  # head dim 64, as the embedded model's
    num_key_value_heads: int = 2  # grouped-query attention, as Qwen2.5
    intermediate_size: int = 1024
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = True  # Qwen2.5 0.5B–3B tie the LM head to the embedding; 7B does not
    seed: int = 0

    def __post_init__(self) -> None:
        base = len(_base_tokens())
        if self.vocab_size < base:
            raise ValueError(f"vocab_size must be ≥ {base} (the byte alphabet and special tokens): {self.vocab_size}")
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("hidden_size must divide into num_attention_heads, and those into num_key_value_heads")

    def key(self) -> str:
        blob = json.dumps({"v": _FORMAT_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def dir_name(self) -> str:
        return f"synthetic-qwen2-v{self.vocab_size}-h{self.hidden_size}-l{self.num_hidden_layers}-{self.key()}"


def _base_tokens() -> list[str]:
    return [PAD, EOS, UNK] + sorted(pre_tokenizers.ByteLevel.alphabet())


def build_tokenizer(vocab_size: int, model_max_length: int = 4096) -> PreTrainedTokenizerFast:
    """Byte-level BPE with no merges and exactly `vocab_size` ids: the embedded tokenizer's 259 tokens
    (same ids: `<pad>` 0, `<eos>` 1, `<unk>` 2, then the bytes) followed by filler tokens."""
    tokens = _base_tokens()
    tokens += [f"<|f{i}|>" for i in range(vocab_size - len(tokens))]
    core = Tokenizer(models.BPE(vocab={tok: i for i, tok in enumerate(tokens)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK, padding_side="left"
    )
    tok.model_max_length = model_max_length
    return tok


def build_synthetic_qwen2(spec: SyntheticQwen2Spec) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast]:
    """The random-init model (seeded) and its tokenizer, in memory."""
    tokenizer = build_tokenizer(spec.vocab_size, spec.max_position_embeddings)
    fields = asdict(spec)
    seed = fields.pop("seed")
    config = Qwen2Config(
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rope_theta=1_000_000.0,  # Qwen2.5's
        rms_norm_eps=1e-6,
        torch_dtype="float32",
        **fields,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config), tokenizer


def synthetic_policy_path(spec: SyntheticQwen2Spec | None = None) -> Path:
    """Directory of the synthetic model for `spec` under `cache_root()`; built on first use (once across
    concurrent processes: file lock, written to a temporary name and renamed)."""
    spec = spec or SyntheticQwen2Spec()
    out = cache_root() / spec.dir_name()
    if (out / _MARKER).exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if not (out / _MARKER).exists():
            log.info("Building the synthetic Qwen2 model (vocabulary %d) in %s", spec.vocab_size, out)
            model, tokenizer = build_synthetic_qwen2(spec)
            tmp = out.with_name(out.name + ".tmp")
            save_policy(model, tokenizer, tmp)
            params = sum(p.numel() for p in model.parameters())
            (tmp / _MARKER).write_text(json.dumps({"spec": asdict(spec), "parameters": params}, indent=2))
            tmp.rename(out)
    return out


def link(out: str | Path, target: Path) -> Path:
    """Make `out` a symlink to `target` (replacing an older symlink; never a real directory)."""
    out = Path(out)
    if out.is_symlink():
        if out.resolve() == target.resolve():
            return out
        out.unlink()
    elif out.exists():
        raise FileExistsError(f"{out} exists and is not a symlink; remove it or choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    tmp.symlink_to(target.resolve(), target_is_directory=True)
    tmp.replace(out)
    return out


def main(argv: list[str] | None = None) -> None:
    d = SyntheticQwen2Spec()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="symlink this path to the cached model directory (default: print its path)")
    p.add_argument("--vocab-size", type=int, default=d.vocab_size)
    p.add_argument("--hidden-size", type=int, default=d.hidden_size)
    p.add_argument("--layers", type=int, default=d.num_hidden_layers)
    p.add_argument("--heads", type=int, default=d.num_attention_heads)
    p.add_argument("--kv-heads", type=int, default=d.num_key_value_heads)
    p.add_argument("--intermediate-size", type=int, help="default: 4 × hidden size")
    p.add_argument("--max-positions", type=int, default=d.max_position_embeddings)
    p.add_argument("--untied", action="store_true", help="a separate LM head (as Qwen2.5-7B)")
    p.add_argument("--seed", type=int, default=d.seed)
    args = p.parse_args(argv)
    spec = SyntheticQwen2Spec(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate_size or 4 * args.hidden_size,
        max_position_embeddings=args.max_positions,
        tie_word_embeddings=not args.untied,
        seed=args.seed,
    )
    path = synthetic_policy_path(spec)
    print(link(args.out, path) if args.out else path)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main()
