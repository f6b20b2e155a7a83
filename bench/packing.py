"""Padded against packed (padding-free) micro-batches: the token slots each layout's forwards run and
the update's time (forward + backward of one optimizer step, the module's own `PolicyUpdate`), side by
side in one process, layouts interleaved (A B C C B A ...).

Workload: a random-init Qwen2 (`models/synthetic.py`) with a 1,024-token vocabulary, B prompts × G
completions of random tokens whose lengths follow a long tail like published math RL runs: log-normal
(median 0.15 × the cap, σ 1), clipped to [1, cap], so the mean is about a quarter of the cap and a few
hit it; prompts of 40–160 tokens. Layouts (`model.compute.micro_batch_size`, `model.compute.max_tokens_per_micro_batch`,
`model.compute.packing`):
  rows            8-row micro-batches, each trimmed to its longest prompt + longest response
  padded_budget   token budget, rows sorted by length and trimmed (the padded layout's best)
  packed_budget   the same budget counting real tokens, each micro-batch one packed row
  packed_rows     8-row micro-batches, packed

    .venv/bin/python bench/packing.py            # ~2 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from common import median, write  # noqa: E402

from rlvr_lightning.training.settings import ComputeSettings, OptimSettings

LAYOUTS = {  # name: (micro_batch_size, token budget or None, packing)
    "rows": (8, None, False),
    "padded_budget": (64, "budget", False),
    "packed_budget": (64, "budget", True),
    "packed_rows": (8, None, True),
}


def response_lengths(n: int, cap: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    drawn = torch.exp(torch.randn(n, generator=g) + torch.log(torch.tensor(0.15 * cap)))
    return drawn.round().clamp(1, cap).long().tolist()


def build(args):
    from rlvr_lightning.algos import GRPO
    from rlvr_lightning.data.datamodule import RolloutDataModule
    from rlvr_lightning.models.synthetic import SyntheticQwen2Spec, synthetic_policy_path
    from rlvr_lightning.rollout.settings import RolloutSettings
    from rlvr_lightning.rollout.types import Completion, PromptBatch, Rollout, SamplingConfig
    from rlvr_lightning.standalone import standalone

    spec = SyntheticQwen2Spec(vocab_size=1024, hidden_size=args.hidden, num_hidden_layers=args.layers,
                              intermediate_size=4 * args.hidden, max_position_embeddings=4096)  # fmt: skip
    path = synthetic_policy_path(spec)
    rollout_settings = RolloutSettings(max_response_length=args.cap, group_size=args.group)
    dm = RolloutDataModule(model_name_or_path=str(path), batch_size=args.prompts, rollout=rollout_settings)
    module = standalone(GRPO(optim=OptimSettings(lr=1e-6), compute=ComputeSettings(micro_batch_size=8, logprob_chunk_tokens=1024)), dm)
    g = torch.Generator().manual_seed(args.seed)
    prompts = [
        torch.randint(3, 1024, (int(n),), generator=g).tolist()
        for n in torch.randint(40, 161, (args.prompts,), generator=g)
    ]
    lengths = response_lengths(args.prompts * args.group, args.cap, args.seed)
    completions = [
        Completion(torch.randint(3, 1024, (L,), generator=g).tolist(), [0.0] * L, "length" if L == args.cap else "stop")
        for L in lengths
    ]  # fmt: skip
    correct = torch.randint(0, 2, (len(lengths),), generator=g).float()
    rollout = Rollout(
        batch=PromptBatch([str(i) for i in range(args.prompts)], [""] * args.prompts, ["0"] * args.prompts),
        group_size=args.group, prompt_ids=prompts, completions=completions,
        sampling=SamplingConfig(group_size=args.group, max_tokens=args.cap), policy_version=0,
        texts=[""] * len(lengths), rewards=correct.clone(), correct=correct,
    )  # fmt: skip
    return module, rollout, spec


def one_update(module, rollout, layout: str, budget: int):
    """Seconds of one optimizer step's forward + backward, the forwards' token slots, and the gradient."""
    from rlvr_lightning.training.micro_batches import forward_tokens

    rows, max_tokens, packing = LAYOUTS[layout]
    h = module.hparams
    h.micro_batch_size, h.max_tokens_per_micro_batch, h.packing = rows, budget if max_tokens else None, packing
    step = module.step_context()
    inputs = module.rlvr_step.prepare(step, rollout)[1]  # θ_old from the update's own forward (one step per batch)
    update = module.rlvr_step.update
    all_rows = torch.arange(len(rollout.completions))
    counts = inputs.tensors.token_counts
    batches = update.plan.micro_batches(all_rows, counts, step.collectives)
    slots = sum(forward_tokens(counts[b], packed=packing) for b in batches)
    module.policy.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    update.accumulate_gradients(step, inputs, all_rows, module.manual_backward)
    seconds = time.perf_counter() - t0
    grad = torch.cat([p.grad.flatten() for p in module.policy.parameters() if p.grad is not None])
    return seconds, slots, len(batches), grad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cap", type=int, default=1024, help="max response length")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--budget", type=int, default=8192, help="max_tokens_per_micro_batch of the *_budget layouts")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="each layout runs 2 × rounds times, interleaved")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    module, rollout, spec = build(args)
    real = int(rollout.tensors(0).token_counts.sum())
    lengths = rollout.response_lengths
    order = list(LAYOUTS)
    sequence = [name for _ in range(args.rounds) for name in order + order[::-1]]
    one_update(module, rollout, "rows", args.budget)  # warm-up: allocator, thread pool
    seconds: dict[str, list[float]] = {name: [] for name in order}
    layout_stats: dict[str, dict] = {}
    grads: dict[str, torch.Tensor] = {}
    for name in sequence:
        s, slots, count, grad = one_update(module, rollout, name, args.budget)
        seconds[name].append(s)
        layout_stats[name] = {"forward_tokens": slots, "micro_batches": count, "padding_frac": 1 - real / slots}
        grads[name] = grad
    base = median(seconds["rows"])
    results = {}
    for name in order:
        med = median(seconds[name])
        results[name] = {
            **layout_stats[name], "update_seconds": seconds[name], "update_seconds_median": med,
            "real_tokens_per_second": real / med, "time_vs_rows": med / base,
            "forward_tokens_vs_rows": layout_stats[name]["forward_tokens"] / layout_stats["rows"]["forward_tokens"],
            "max_abs_grad_diff_vs_rows": float((grads[name] - grads["rows"]).abs().max()),
        }  # fmt: skip
        print(f"{name:14s} forward tokens {layout_stats[name]['forward_tokens']:7d}  micro-batches "
              f"{layout_stats[name]['micro_batches']:3d}  update {med:6.2f} s  ({med / base:.2f} × rows)")  # fmt: skip
    write("packing", {
        "workload": {"model": spec.dir_name(), "hidden": args.hidden, "layers": args.layers, "vocab": 1024,
                     "prompts": args.prompts, "group_size": args.group, "cap": args.cap, "budget": args.budget,
                     "real_tokens": real, "response_tokens": int(lengths.sum()),
                     "response_mean_over_cap": float(lengths.mean()) / args.cap,
                     "responses_at_cap": int((lengths == args.cap).sum()), "response_max": int(lengths.max())},
        "layouts": results,
    })  # fmt: skip


if __name__ == "__main__":
    main()
