"""The trainer's policy and its frozen reference (loaded in fp32 and, under FSDP2, sharded), and the
tokenizer that goes with them."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from rlvr_lightning.errors import ConfigError
from rlvr_lightning.models.hub import hub_problem, looks_like_path
from rlvr_lightning.models.lora import BaseModelView, LoraSettings, apply_lora
from rlvr_lightning.parallel import checkpoint_layers, shard_policy


def load_policies(
    path: str,
    with_reference: bool,
    mesh=None,
    param_dtype: str = "float32",
    activation_checkpointing: bool = False,
    lora: LoraSettings | None = None,
    seed: int = 0,
    reshard_after_forward: bool = True,
) -> tuple[torch.nn.Module, torch.nn.Module | BaseModelView | None]:
    """(policy, reference or None) from an HF model directory or id; `mesh` (the strategy's device mesh,
    None without FSDP2) shards both per decoder layer. With `lora` the policy gets a LoRA adapter (before
    sharding, so each decoder layer's FSDP2 unit holds its own adapters) and the reference is the policy
    with its adapter switched off: the base weights are held once; `seed` draws the adapter's initial A.
    `reshard_after_forward` (FSDP2): free each layer's gathered weights after its forward, or keep them for its backward."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    policy.config.use_cache = False
    # The policy stays in eval mode on purpose: no dropout, so trainer log-probs equal the
    # engine's and repeated forwards (old log-probs, REAL two-pass) are deterministic.
    warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode at the start of training")
    reference = None
    if lora is not None:
        apply_lora(policy, lora, seed)
        reference = BaseModelView(policy) if with_reference else None
    elif with_reference:
        reference = load_frozen(path, mesh, param_dtype)
    if mesh is not None:
        shard_policy(policy, data_parallel(mesh), param_dtype, activation_checkpointing, reshard_after_forward)
    elif activation_checkpointing:
        checkpoint_layers(policy)
    return policy, reference


def data_parallel(mesh):
    """The strategy's device mesh's data-parallel dimension (the mesh itself when its dimensions have no names)."""
    return mesh["data_parallel"] if mesh.mesh_dim_names else mesh


def load_frozen(path: str, mesh=None, param_dtype: str = "float32") -> torch.nn.Module:
    """A model that only scores (the KL reference, a distillation teacher): fp32, eval mode, no gradients, and
    under FSDP2 (`mesh`) sharded per decoder layer like the policy."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.requires_grad_(False)
    if mesh is not None:
        shard_policy(model, data_parallel(mesh), param_dtype)
    return model


def check_model_source(name_or_path: str, option: str = "data.model_name_or_path") -> None:
    """Before any work, one line for a model the run could not load: a local directory that does not exist or holds
    no `config.json`, or a hub model id on a machine that is offline without a cached copy. An embedded name
    (`models.warm_start.EMBEDDED_WARM_STARTS`, resolved before this) and a hub id the machine can reach pass."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"{option}={name_or_path}: not a Hugging Face model directory (it has no config.json)")
        return
    if path.exists() or looks_like_path(name_or_path):
        raise ConfigError(f"{option}: model directory does not exist: {name_or_path}")
    problem = hub_problem(name_or_path, "model")
    if problem is not None:
        raise ConfigError(f"{option}: {problem}")


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    check_model_source(path)
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"could not load a tokenizer from data.model_name_or_path={path!r}: {str(err).splitlines()[0]} "
            "(use `embedded`, a local HF model directory, or an HF model id reachable from this machine)"
        ) from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok

