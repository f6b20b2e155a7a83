"""Verifier throughput, completions per second.

The persistent math-verify pool (`MathVerifier`, 2 workers) on three kinds of completions: short
embedded-task answers (as in RL on the default, many repeats within a group), MATH-500 reference
solutions (long LaTeX, distinct), and GSM8K solutions. Each set is verified `--rounds` times; the
first round includes the pool start-up and is reported apart. The verifier's share of a training
step is in step_breakdown.json.

    .venv/bin/python bench/verifier_throughput.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import median, write  # noqa: E402

BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "benchmarks"


def workloads() -> dict[str, tuple[list[str], list[str]]]:
    from rlvr_lightning.models.embedded_task import train_test_split

    problems = train_test_split(seed=0)[0][:16]
    golds, texts = [], []
    for p in problems:  # 16 prompts × G = 8, a third right, a third off by one, a third unanswered
        gold = str(p.value)
        for j in range(8):
            golds.append(gold)
            texts.append(f"\\boxed{{{gold}}}" if j % 3 == 0 else f"\\boxed{{{int(gold) + 1}}}" if j % 3 == 1 else "Answer:")
    out = {"embedded 16x8": (golds, texts)}
    for name, answer_key, text_key in (("math500", "answer", "solution"), ("gsm8k", "answer", "answer")):
        path = BENCH / f"{name}.jsonl"
        if path.exists():
            rows = [json.loads(line) for line in path.read_text().splitlines()[:200]]
            out[f"{name} x200"] = ([r[answer_key] for r in rows], [r[text_key] for r in rows])
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    from rlvr_lightning.rewards.pool import MathVerifier

    results = {}
    with MathVerifier(num_workers=args.workers, timeout_s=5.0) as verifier:
        t0 = time.perf_counter()
        verifier.verify(["1"], ["\\boxed{1}"])
        startup = time.perf_counter() - t0
        for name, (golds, texts) in workloads().items():
            rates, correct = [], 0.0
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                res = verifier.verify(golds, texts)
                rates.append(len(texts) / (time.perf_counter() - t0))
                correct = sum(res.rewards) / len(texts)
            results[name] = {"completions": len(texts), "completions_per_s": median(rates), "accuracy": correct}
    write("verifier_throughput", {"workers": args.workers, "pool_startup_s": startup, "workloads": results})


if __name__ == "__main__":
    main()
