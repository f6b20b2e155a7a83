"""Packed against padded forwards of one architecture at the planner step's shape, with the figures that tell a
packing defect from rounding.

The first GPU run found the mean loss of 8 packed 1,024-token sequences 0.01-0.025 nats from the padded
forward's (of either sign across three random-weight models), while one packed 16k-token sequence matched its
padded forward bit for bit and the doctor's packed row (a 2-layer model, short sequences) matched exactly with
no leak. A deep random-weight network amplifies rounding, and the varlen kernel may split its reductions
differently for several sequences than the padded kernel does, so the difference alone says little. Hence,
in the same dtype and on the same weights (no grad, no FSDP):
  - `bf16_packed_vs_padded`: what the planner step saw, per token;
  - `bf16_padded_batch_vs_alone`: the padded forward of the 8 rows against each row run alone, the same kernel
    at another batch composition: the size of rounding's own effect at this depth;
  - `fp32_packed_vs_padded`: fp32, where the packed forward takes the per-sequence sdpa path: the semantics;
  - `bf16_leak`: each sequence's last token changed: the largest change of any other token's log-prob
    (0 unless a sequence sees past its end or into the next one).
Packing is sound when the leak is 0, fp32 agrees to rounding, and bf16's packed difference is of the size of
the batch-composition one. (On the H100 all three held; the first run's gap came from the planner, which wrote
its mask-free attention into the shared model configuration: docs/gpu.md.)
"""

from __future__ import annotations

import torch


def _stats(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> dict:
    d = (a.float() - b.float()) * mask
    n = mask.sum()
    return {"max_abs": float(d.abs().max()), "mean_abs": float(d.abs().sum() / n), "mean": float(d.sum() / n)}


def agreement(model_config, shape, seed: int = 0) -> dict:
    from bench.gpu_check.update_step import _batch, model_from
    from rlvr_lightning.doctor.checks import last_tokens_changed, masked_max
    from rlvr_lightning.models import packed_attention
    from rlvr_lightning.models.forward import policy_forward

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_from(model_config, dtype=torch.float32).eval()
    t = _batch(model_config.vocab_size, shape, device, seed)
    mask = t.response_mask

    def logp(m, batch, packed):
        with torch.no_grad():
            return policy_forward(m, batch, 1.0, chunk_tokens=shape.chunk_tokens, packed=packed).logp

    out: dict = {"rows": shape.rows, "tokens_per_row": shape.prompt_tokens + shape.response_tokens}
    fp32 = {p: logp(model, t, p) for p in (False, True)}
    out["fp32_packed_vs_padded"] = _stats(fp32[True], fp32[False], mask)
    model = model.to(torch.bfloat16)
    padded, packed = logp(model, t, False), logp(model, t, True)
    alone = torch.cat([logp(model, t.select(torch.tensor([i], device=device)), False) for i in range(shape.rows)])
    out["bf16_packed_vs_padded"] = _stats(packed, padded, mask)
    out["bf16_padded_batch_vs_alone"] = _stats(padded, alone, mask)
    changed, kept = last_tokens_changed(t, model_config.vocab_size)  # the doctor's leak probe, at this shape
    out["bf16_leak"] = masked_max(logp(model, changed, True) - packed, kept)
    kernel = packed_attention._varlen_kernel()
    out["packed_attention"] = packed_attention.attention_implementation(model)
    out["varlen_kernel"] = None if kernel is None else sorted(kernel[1])
    return out
