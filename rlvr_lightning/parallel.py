"""FSDP2 (`fully_shard`, DTensor) for the policy through Lightning's `ModelParallelStrategy`.

    make train ALGO=grpo ARGS="--config configs/strategy/fsdp.yaml --trainer.devices 2"

The same code runs on CPU (gloo) and GPU (NCCL): the strategy picks the backend from the device.
Each decoder layer is one FSDP unit (its parameters are all-gathered just before its forward and freed
after), the embeddings, final norm and LM head form the root unit. Every rank keeps its own colocated
rollout engine; a weight sync all-gathers one parameter at a time (`rlvr_lightning.models.weights.full_weights`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from rlvr_lightning.errors import ConfigError, check_choice

# Where Hugging Face causal LMs keep their stack of decoder blocks.
_LAYER_PATHS = ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers")


class FSDP2Strategy(ModelParallelStrategy):
    """`ModelParallelStrategy` with a 1-D data-parallel mesh over all ranks: pure FSDP2, no tensor parallel.

    (Its "auto" default shards across nodes and runs tensor parallelism inside a node, which a
    policy that is not written for tensor parallelism cannot use.)
    """

    def __init__(self, collective_timeout_s: float = 600.0, **kwargs) -> None:
        """`collective_timeout_s`: how long a rank waits in one collective for the others (gloo's own default is
        30 min) before it fails; a rank killed or frozen is named sooner by the watchdog's heartbeats
        (`--watchdog.rank_unresponsive_s`)."""
        from datetime import timedelta

        if collective_timeout_s <= 0:
            raise ConfigError(f"trainer.strategy.init_args.collective_timeout_s must be > 0, got {collective_timeout_s}")
        kwargs.setdefault("timeout", timedelta(seconds=collective_timeout_s))
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1, **kwargs)

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    for path in _LAYER_PATHS:
        module = model
        for name in path.split("."):
            module = getattr(module, name, None)
            if module is None:
                break
        if isinstance(module, torch.nn.ModuleList):
            return list(module)
    raise ConfigError(
        f"FSDP: cannot find the decoder layers of {type(model).__name__} (looked for {', '.join(_LAYER_PATHS)})"
    )


def checkpoint_layers(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in the backward pass (PyTorch's composable, non-reentrant
    `checkpoint`; it composes with `fully_shard` applied after it).

    Not transformers' `gradient_checkpointing_enable`: that acts only in train mode, and the policy stays
    in eval mode (no dropout, so trainer log-probs equal the engine's), where it silently did nothing."""
    from torch.distributed._composable import checkpoint

    for layer in decoder_layers(model):
        checkpoint(layer)


def shard_policy(
    model: torch.nn.Module,
    mesh,
    param_dtype: str = "float32",
    activation_checkpointing: bool = False,
    reshard_after_forward: bool = True,
) -> torch.nn.Module:
    """Apply `fully_shard` per decoder layer, then to the whole model, on the data-parallel `mesh`.

    `param_dtype="bfloat16"`: parameters are all-gathered and computed in bf16, gradients reduced in
    fp32 and the sharded master weights stay fp32 (FSDP2's MixedPrecisionPolicy). `reshard_after_forward=False`
    keeps each layer's gathered weights from its forward to its backward (one gather fewer per layer and
    micro-batch, the gathered weights held meanwhile); the GPU check measures it.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    check_choice("model.compute.fsdp_param_dtype", param_dtype, ("float32", "bfloat16"))
    policy = MixedPrecisionPolicy(param_dtype=getattr(torch, param_dtype), reduce_dtype=torch.float32)
    if activation_checkpointing:
        checkpoint_layers(model)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def ranks_barrier(device: torch.device) -> Callable[[], None] | None:
    """The trainer's ranks' barrier as a plain function (what Lightning's strategies call), for objects that must
    not keep the strategy; None in a single process."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    if dist.get_backend() == "nccl":  # NCCL's barrier needs this rank's device
        return partial(dist.barrier, device_ids=[device.index])
    return dist.barrier


def ranks_reduce() -> Callable[..., torch.Tensor] | None:
    """The sum, min or max of a tensor over the trainer's ranks, as Lightning's strategies reduce (a barrier, then
    an in-place all-reduce; `reduce_op`: "sum", "min" or "max"), as a plain function for objects that must not keep
    the strategy; None in a single process."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None

    def reduce(tensor: torch.Tensor, reduce_op: str = "sum") -> torch.Tensor:
        dist.barrier()
        dist.all_reduce(tensor, op=getattr(dist.ReduceOp, reduce_op.upper()))
        return tensor

    return reduce
