"""How well do OAR-G's saliencies rank reasoning tokens like OAR-P's scores?

On the embedded warm-started policy (and its untrained initialisation), for worked solutions of the
embedded task: the Spearman correlation per rollout between OAR-P and OAR-G, for each read-out and
OAR-G baseline (`zero`: the authors' gradient × input; `pad`: gradient × (input − pad embedding)).

    .venv/bin/python bench/oar_rank_agreement.py [--rollouts 24]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from common import write  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rollouts", type=int, default=24)
    args = parser.parse_args()

    from torchmetrics.functional import spearman_corrcoef
    from transformers import AutoModelForCausalLM

    from rlvr_lightning.attribution.oar import oar_g_saliency, oar_p_scores, segment_boxed
    from rlvr_lightning.models.embedded import TinyQwen2Spec, build_char_tokenizer, build_tiny_qwen2
    from rlvr_lightning.models.policy import load_tokenizer
    from rlvr_lightning.models.warm_start import embedded_policy_path

    warm = str(embedded_policy_path())
    tok = load_tokenizer(warm)
    models = {
        "warm_start": AutoModelForCausalLM.from_pretrained(warm, dtype=torch.float32).eval(),
        "random_init": build_tiny_qwen2(build_char_tokenizer(), TinyQwen2Spec(), seed=0).eval(),
    }
    g = torch.Generator().manual_seed(0)
    inputs = []
    for _ in range(args.rollouts):
        a, b, c = torch.randint(1, 20, (3,), generator=g).tolist()
        v = a + b - c
        prompt = tok(f"What is {a}+{b}-{c}?\n", add_special_tokens=False).input_ids
        response = tok(f"{a}+{b}={a + b},{a + b}-{c}={v}.\\boxed{{{v}}}", add_special_tokens=False).input_ids
        inputs.append(segment_boxed(prompt, response, tok, conclude_template="\\boxed{"))  # as the presets
    results = {}
    for name, model in models.items():
        for mode in ("last", "answer_mean", "answer_joint"):
            p_scores = oar_p_scores(model, inputs, tok.pad_token_id, mode=mode)
            for baseline in ("zero", "pad"):
                gens = [torch.Generator().manual_seed(i) for i in range(len(inputs))]
                g_scores = oar_g_saliency(model, inputs, tok.pad_token_id, mode=mode, generators=gens, baseline=baseline)
                rho = torch.stack([spearman_corrcoef(p, s) for p, s in zip(p_scores, g_scores)])
                results[f"{name}/{mode}/{baseline}"] = {
                    "spearman_mean": rho.mean().item(), "spearman_min": rho.min().item(),
                    "spearman_max": rho.max().item(), "positive_frac": (rho > 0).float().mean().item(),
                }  # fmt: skip
    write("oar_rank_agreement", {"rollouts": args.rollouts, "results": results})


if __name__ == "__main__":
    main()
