"""LoRA policies through PEFT: the adapter settings, the reference that is the base model itself, and the
two forms the weights leave the trainer in (the adapter's own tensors, or merged full weights).

PEFT injects its layers into the HF model in place (`inject_adapter_in_model`), so the policy stays a plain
`PreTrainedModel`: the forward, the chunked LM head, THR's head and OAR's embeddings, FSDP2's per-layer
sharding and the HF engine see the same module with or without LoRA. Three things PEFT offers are avoided
on purpose:
- `disable_adapter()` also flips `requires_grad` on every adapter parameter, which FSDP2 reads once when it
  sets up its mixed precision; the reference flips only the layers' own switch (`adapters_disabled`).
- `merge_adapter()`/`unmerge_adapter()` change the frozen weights in place and the round trip is not exact in
  fp32 (W + Δ − Δ ≠ W in a few entries per thousand): repeated at every sync it would drift the base, which is
  also the KL reference. Merged weights are computed on the fly instead (`merged_weights`), W untouched.
- `lora_dropout` would be a no-op: the policy stays in eval mode (log-probs must equal the engine's), so p > 0
  is refused rather than silently ignored.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from torch.distributed.tensor import DTensor

from rlvr_lightning.errors import ConfigError

log = logging.getLogger(__name__)

ADAPTER = "default"  # PEFT's adapter name; one adapter per policy
# What PEFT and vLLM call an adapter's tensors: `base_model.model.<module>.lora_{A,B}.weight`.
PEFT_PREFIX = "base_model.model."
# Ranks vLLM's LoRA buffers come in (`max_lora_rank`); an adapter is padded up to the next one.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Modules that must stay plain: the chunked LM head and THR need the head's own weight, vLLM drops an LM-head
# delta from prompt log-probs, and embeddings are not Linear layers PEFT and vLLM agree on.
UNTARGETABLE = ("lm_head", "embed_tokens")


@dataclass(frozen=True)
class LoraSettings:
    """`--model.init_args.lora.*`: a LoRA policy instead of full fine-tuning.

    Args:
        rank: r, the adapter's rank.
        alpha: the scale is alpha / rank (alpha / √rank with `use_rslora`).
        dropout: must be 0: the policy runs in eval mode so that its log-probs equal the engine's.
        target_modules: Linear layers to adapt, by name suffix; the default is every projection of a
            Qwen2/Qwen3/Llama/Gemma decoder layer (attention and MLP), as RL practice uses; `all-linear`
            lets PEFT find them.
        use_rslora: rank-stabilised scale alpha / √rank.
        sync: how the engine gets the policy: `merged` (full weights W + scale·B·A through the engine's
            weight transport) or `adapter` (only the adapter's tensors; vLLM applies them to its base weights).
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: list[str] | str = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    use_rslora: bool = False
    sync: Literal["merged", "adapter"] = "merged"

    def __post_init__(self) -> None:
        if not 1 <= self.rank <= VLLM_LORA_RANKS[-1]:
            raise ConfigError(f"model.lora.rank must be in [1, {VLLM_LORA_RANKS[-1]}] (vLLM's largest), got {self.rank}")
        if self.alpha <= 0:
            raise ConfigError(f"model.lora.alpha must be > 0, got {self.alpha}")
        if self.dropout != 0:
            raise ConfigError(
                f"model.lora.dropout={self.dropout}: the policy runs in eval mode so that its log-probs equal the "
                "rollout engine's and repeated forwards agree; LoRA dropout would be silently off. Use 0."
            )
        if self.sync not in ("merged", "adapter"):
            raise ConfigError(f"model.lora.sync must be `merged` or `adapter`, got {self.sync!r}")
        if not isinstance(self.target_modules, str):  # a tuple: the settings are hashable (the planner's cache key)
            object.__setattr__(self, "target_modules", tuple(self.target_modules))
        targets = [self.target_modules] if isinstance(self.target_modules, str) else list(self.target_modules)
        if not targets:
            raise ConfigError("model.lora.target_modules is empty")
        bad = [t for t in targets if t.split(".")[-1] in UNTARGETABLE]
        if bad:
            raise ConfigError(
                f"model.lora.target_modules {bad}: the LM head and embeddings stay plain (the chunked LM head and "
                "THR use the head's weight, and vLLM leaves an LM-head adapter out of prompt log-probs)"
            )

    @property
    def scale(self) -> float:
        return self.alpha / (self.rank**0.5 if self.use_rslora else self.rank)

    @property
    def engine_max_rank(self) -> int:
        """vLLM's `max_lora_rank` for this adapter: the smallest allowed rank ≥ `rank`."""
        return next(r for r in VLLM_LORA_RANKS if r >= self.rank)

    def peft_config(self):
        from peft import LoraConfig

        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            lora_dropout=0.0,
            target_modules=self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules),
            use_rslora=self.use_rslora,
            bias="none",
            task_type="CAUSAL_LM",
            exclude_modules=list(UNTARGETABLE),
        )


def as_settings(lora: LoraSettings | dict | None) -> LoraSettings | None:
    """The settings from the CLI's dataclass, a plain dict (a checkpoint's hyper-parameters) or None."""
    if lora is None or isinstance(lora, LoraSettings):
        return lora
    return LoraSettings(**dict(lora))


def warn_on_merged_half_precision(settings: LoraSettings | None, engine_dtype: str) -> bool:
    """A merged sync to a bf16/fp16 engine rounds W + scale·B·A to 16 bits, and an update much smaller than W's
    rounding step vanishes from the engine (every run starts there, B being zero: at an update RMS of 1e-5 on
    N(0, 0.02) weights, 80% of entries keep their bf16 value; `bench/merged_precision.py`), while the trainer
    computes W·x + scale·B·A·x and keeps it. The engine then samples from a policy further from the trainer's
    than the update itself, which the 16-bit sync probe's tolerance cannot see. An adapter sync keeps the
    update apart, as the trainer does."""
    if settings is None or settings.sync != "merged" or engine_dtype not in ("bfloat16", "float16"):
        return False
    log.warning(
        "lora.sync=merged with a %s rollout engine: adapter updates below %s's rounding step of the base weights "
        "do not reach the engine; --model.init_args.lora.sync adapter keeps them (docs/lora.md)",
        engine_dtype,
        engine_dtype,
    )
    return True


def apply_lora(model: torch.nn.Module, settings: LoraSettings, seed: int = 0) -> torch.nn.Module:
    """Inject the adapter into `model` in place (A random, B zero, so the policy starts as the base model);
    only adapter parameters keep `requires_grad`. A is drawn from its own generator seeded by `seed`, not from
    the process's: the same on every rank, and the same whatever ran before (the planner's pre-flight builds
    models that draw from the process's generator)."""
    from peft import inject_adapter_in_model

    try:
        # `manual_seed` reseeds every CUDA generator too (A is drawn on the GPU where the model is built there):
        # fork them all, so the process's generators come back as they were.
        cuda_devices = range(torch.cuda.device_count()) if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=cuda_devices):
            torch.manual_seed(seed)
            inject_adapter_in_model(settings.peft_config(), model, adapter_name=ADAPTER)
    except ValueError as err:  # target names that match no module
        raise ConfigError(f"model.lora.target_modules: {str(err).splitlines()[0]}") from None
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" in name)
    return model


def lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """{module name: PEFT LoRA layer} of every adapted Linear."""
    from peft.tuners.lora import LoraLayer

    return {name: mod for name, mod in model.named_modules() if isinstance(mod, LoraLayer)}


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts (a DTensor counts its global shape)."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


@contextmanager
def adapters_disabled(model: torch.nn.Module):
    """Forwards inside the block run the base model: each LoRA layer's own switch, `requires_grad` untouched."""
    layers = list(lora_layers(model).values())
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer in layers:
            layer._disable_adapters = False


class BaseModelView:
    """The KL reference of a LoRA policy: the policy's own module with its adapters switched off, so the
    base weights are not held twice. Not an `nn.Module` (it is no submodule and adds nothing to checkpoints);
    everything but the call is the policy's."""

    def __init__(self, policy: torch.nn.Module) -> None:
        self._policy = policy

    def __call__(self, *args, **kwargs):
        with torch.no_grad(), adapters_disabled(self._policy):
            return self._policy(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._policy, name)


def gathered(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: an FSDP2 shard (DTensor) all-gathered, any other tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def adapter_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter's tensors under PEFT's file names (`base_model.model.<module>.lora_A.weight`, A [r, in],
    B [out, r]), gathered whole from FSDP shards; every rank must iterate, in the same order."""
    tag = f".{ADAPTER}.weight"
    for name, tensor in model.state_dict().items():
        if ".lora_A." in name or ".lora_B." in name:
            yield PEFT_PREFIX + name.removesuffix(tag) + ".weight", gathered(tensor)


def adapter_config(settings: LoraSettings, model: torch.nn.Module, base_model: str):
    """The adapter's PEFT `LoraConfig`, with the target modules PEFT resolved on this model."""
    config = settings.peft_config()
    config.base_model_name_or_path = base_model
    config.target_modules = sorted({name.rsplit(".", 1)[-1] for name in lora_layers(model)})
    config.exclude_modules = None
    config.inference_mode = True
    return config


def adapter_config_json(settings: LoraSettings, model: torch.nn.Module, base_model: str) -> dict:
    """`adapter_config.json`'s contents for the adapter of `model`, as PEFT writes it (sets as lists)."""
    config = adapter_config(settings, model, base_model).to_dict()
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}


def save_adapter(weights: dict[str, torch.Tensor], config, out: Path) -> Path:
    """A PEFT adapter directory (`adapter_model.safetensors`, `adapter_config.json`) that PEFT's
    `PeftModel.from_pretrained` and vLLM's `LoRARequest` both load."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous().cpu() for k, v in weights.items()}, str(out / "adapter_model.safetensors"))
    config.save_pretrained(str(out))
    return out


def is_adapter_dir(path: str | Path) -> bool:
    """A PEFT adapter directory (an `HFExport` of a LoRA policy), as opposed to a full model."""
    return (Path(path) / "adapter_config.json").is_file()


@dataclass(frozen=True)
class SavedAdapter:
    settings: LoraSettings
    base_model: str  # the model the adapter applies to (`base_model_name_or_path`)
    tensors: dict[str, torch.Tensor]  # under PEFT's file names
    config: dict  # its `adapter_config.json`, as a vLLM engine is handed an adapter


def read_adapter(path: str | Path) -> SavedAdapter:
    """A PEFT LoRA adapter directory: its settings, base model and tensors."""
    from safetensors.torch import load_file

    path = Path(path)
    config = json.loads((path / "adapter_config.json").read_text())
    if config.get("peft_type") != "LORA":
        raise ConfigError(f"{path}: a {config.get('peft_type')} adapter; only LoRA adapters are supported")
    settings = LoraSettings(
        rank=config["r"],
        alpha=config["lora_alpha"],
        target_modules=config["target_modules"],
        use_rslora=config.get("use_rslora", False),
    )
    tensors = load_file(str(path / "adapter_model.safetensors"))
    return SavedAdapter(settings, config["base_model_name_or_path"], tensors, config)


def load_adapter_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Set the adapter of a LoRA `model` (built with the adapter's settings) from PEFT-named tensors."""
    own = {name.removeprefix(PEFT_PREFIX).removesuffix(".weight") + f".{ADAPTER}.weight": t for name, t in tensors.items()}
    params = dict(model.named_parameters())
    missing = sorted(set(own) - set(params))
    left = sorted(n for n in params if ".lora_" in n and n not in own)
    if missing or left:
        raise ConfigError(f"the adapter does not fit the model: unknown {missing[:3]}, not in the adapter {left[:3]}")
    with torch.no_grad():
        for name, tensor in own.items():
            params[name].copy_(tensor)
