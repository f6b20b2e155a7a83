"""Step 2: the planner against the measured update for real architectures built from their configurations
with random weights (`rlvr_lightning/planner/model_configs/`), padded and packed, with and without activation
checkpointing: peak allocated and reserved memory and the update's step time (`update_step.compared`); first,
the packed forward's agreement with the padded one at the same shape (`packed_agreement`).
With tiny shapes the same architectures are shrunk (2 layers, width 64, a 1,024-token vocabulary)."""

from __future__ import annotations

import copy

from bench.gpu_check.packed_agreement import agreement
from bench.gpu_check.record import attempt
from bench.gpu_check.update_step import UpdateShape, compared

ARCHITECTURES = ["Qwen/Qwen3-0.6B", "Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen3-1.7B"]
FULL = UpdateShape(rows=8, prompt_tokens=128, response_tokens=896, chunk_tokens=2048)  # 8,192 tokens a micro-batch
# The mean loss of packed and padded forwards of the same tokens on the same weights differs by bf16's rounding
# alone: 4e-5 to 6e-4 nats for the three models at FULL on an H100; sequences that saw past their boundaries
# moved it by 1e-2 to 2.5e-2.
PACKED_LOSS_TOLERANCE = 3e-3
TINY = UpdateShape(rows=2, prompt_tokens=8, response_tokens=24, chunk_tokens=16)


def shrunk(config):
    """The architecture at a size a CPU test runs in seconds: its family's code, a toy's dimensions."""
    config = copy.deepcopy(config)
    for key, value in {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                       "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1024, "max_window_layers": 2}.items():  # fmt: skip
        if hasattr(config, key):
            setattr(config, key, value)
    if getattr(config, "layer_types", None) is not None:  # one attention type per layer
        config.layer_types = config.layer_types[:2]
    return config


def run(ctx) -> dict:
    from dataclasses import replace

    from rlvr_lightning.planner.models import model_config

    base = TINY if ctx.tiny else FULL
    results: dict = {"shape": vars(base) | {"tokens_per_micro_batch": base.tokens_per_step}, "runs": {}}
    first = model_config(ARCHITECTURES[0])
    attempt(results, "packed_agreement", ctx.deadline, agreement, shrunk(first) if ctx.tiny else first, base)
    for name in ARCHITECTURES:
        config = model_config(name)
        config = shrunk(config) if ctx.tiny else config
        for checkpointing in (True, False):
            for packing in (False, True):
                shape = replace(base, activation_checkpointing=checkpointing, packing=packing)
                key = f"{name} {'packed' if packing else 'padded'}{', AC' if checkpointing else ''}"
                done = attempt(results["runs"], key, ctx.deadline, compared, config, shape, ctx.workdir)
                padded = results["runs"].get(key.replace("packed", "padded"))
                if packing and isinstance(done, dict) and "measured" in done and "measured" in (padded or {}):
                    # The same tokens and initial weights: only the attention kernel differs (bf16 noise, no bias).
                    gap = done["measured"]["first_loss"] - padded["measured"]["first_loss"]
                    done["first_loss_minus_padded"] = gap
                    if abs(gap) > PACKED_LOSS_TOLERANCE:
                        done["error"] = (f"the packed update's first loss is {gap:+.4f} nats from the padded one's "
                                         f"(tolerance {PACKED_LOSS_TOLERANCE}): a packed forward that differs in meaning")  # fmt: skip
    return results
