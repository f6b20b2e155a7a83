"""The trainer's policy as the rollout engine and exports receive it: full HF weights (a LoRA policy's merged
on the fly) or, for a LoRA policy synced as an adapter, the adapter alone."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from rlvr_lightning.models.lora import (
    ADAPTER,
    LoraSettings,
    adapter_config_json,
    adapter_weights,
    gathered,
    lora_layers,
)
from rlvr_lightning.rollout.engine import RolloutEngine


@torch.no_grad()
def full_weights(model: torch.nn.Module, merged: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) pairs of the policy as a plain HF checkpoint, one at a time: under FSDP each tensor
    is all-gathered from its shards as it is handed over (every rank must iterate, in the same order), so no
    rank holds two full copies. A LoRA policy's adapted weight is merged here, W + scale·B·A, from the
    gathered W, A and B: the trainer's W is never changed (see `models.lora` for why not PEFT's merge).
    `merged=False`: the base model's weights (W alone)."""
    layers = lora_layers(model)
    held: dict[str, dict[str, torch.Tensor]] = {}  # an adapted layer's tensors until W, A and B have come
    for name, tensor in model.state_dict().items():
        owner, part = _lora_part(name)
        if owner is None:
            yield name, gathered(tensor)
        elif part == "bias":
            yield f"{owner}.bias", gathered(tensor)
        else:
            parts = held.setdefault(owner, {})
            parts[part] = gathered(tensor)
            if len(parts) == 3:
                w, a, b = parts.pop("weight"), parts.pop("lora_A"), parts.pop("lora_B")
                weight = _merge(w, a, b, layers[owner]) if merged else w
                yield f"{owner}.weight", weight
                del held[owner]
    if held:
        raise RuntimeError(f"LoRA layers without base weight or adapter in the state dict: {sorted(held)[:3]}")


def _merge(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    """W + scale·B·A in fp32, in W's dtype. GPT-2's `Conv1D` layers store W as (in, out): PEFT marks them
    `fan_in_fan_out` and applies the delta transposed."""
    scale = layer.scaling[ADAPTER]
    if getattr(layer, "fan_in_fan_out", False):
        return torch.addmm(w.float().T, b.float(), a.float(), alpha=scale).T.contiguous().to(w.dtype)
    return torch.addmm(w.float(), b.float(), a.float(), alpha=scale).to(w.dtype)


def _lora_part(name: str) -> tuple[str | None, str]:
    """(adapted module, `weight` | `bias` | `lora_A` | `lora_B`) for a state-dict entry of a LoRA layer,
    (None, name) for any other."""
    for marker in (".base_layer.", ".lora_A.", ".lora_B."):
        if marker in name:
            owner, rest = name.split(marker, 1)
            return owner, rest.split(".")[-1] if marker == ".base_layer." else marker.strip(".")
    return None, name


def load_into_engine(
    engine: RolloutEngine, policy: torch.nn.Module, version: int, lora: LoraSettings | None, base_model: str
) -> None:
    """Hand `policy` to `engine` as version `version`: its adapter (`lora.sync: adapter`) or its full weights."""
    if lora is not None and lora.sync == "adapter":
        engine.load_adapter(adapter_weights(policy), adapter_config_json(lora, policy, base_model), version=version)
    else:
        engine.load_weights(full_weights(policy), version=version)
