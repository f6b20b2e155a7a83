"""The Markdown tables of docs/gpu.md from one gpu-check's JSON (`make gpu-check OUT=DIR`), never edited by hand.

    python scripts/gpu_table.py DIR            # print
    python scripts/gpu_table.py DIR --write    # replace the part of docs/gpu.md between its two markers
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "gpu.md"
BEGIN, END = "<!-- gpu-table: begin -->", "<!-- gpu-table: end -->"


def load(folder: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def cell(value, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value).replace("|", "\\|")  # a figure's |Δ| must not end the table's cell


def short(commit: str) -> str:
    """A commit's first 12 digits, keeping `+dirty` (a step run with changes not yet committed says so)."""
    return commit[:12] + ("+dirty" if commit.endswith("+dirty") else "")


def header_table(runs: dict[str, dict]) -> list[str]:
    env = runs.get("environment") or next(iter(runs.values()))
    lines = ["| card | date | commit | torch | transformers | tiny shapes |", "|---|---|---|---|---|---|",
             f"| {env['card']} | {env['date']} | `{short(env['commit'])}` | {env['torch']} | {env['transformers']} | {env['tiny_shapes']} |",
             "", "| step | status | seconds | date | commit | problems |", "|---|---|---|---|---|---|"]  # fmt: skip
    for step, r in runs.items():
        if step != "environment":  # a step rerun alone has its own date and commit
            lines.append(f"| {step} | {r['status']} | {cell(r.get('elapsed_s'))} | {r['date'][:16]} | `{short(r['commit'])}` "
                         f"| {'; '.join(r.get('problems', [])) or '–'} |")  # fmt: skip
    return lines


def measured_rows(title: str, runs: dict, mfu: bool = False) -> list[str]:
    head = ("| run | planned GiB | allocated GiB | reserved GiB | planned / allocated | planned s | measured s | tokens/s "
            "| trainer efficiency |")
    lines = [f"**{title}**", "", head + (" MFU |" if mfu else ""), "|---" * (head.count("|") - 1 + mfu) + "|"]
    for name, r in runs.items():
        if not isinstance(r, dict) or "measured" not in r:
            why = r if isinstance(r, str) else r.get("error") or r.get("skipped")
            lines.append(f"| {name} | {why} |")
            continue
        p, m = r["planned"], r["measured"]
        row = [name, cell(p["peak_gib"]), cell(m["peak_allocated_gib"]), cell(m["peak_reserved_gib"]),
               cell(r["memory_ratio_planned_to_allocated"]), cell(p.get("step_s")), cell(m["step_s"]), cell(m["tokens_per_s"], 4), cell(r.get("trainer_efficiency_measured"), 2)]  # fmt: skip
        lines.append("| " + " | ".join(row + ([cell(r.get("mfu"))] if mfu else [])) + " |")
    return lines + [""]


def packed_rows(planner: dict) -> list[str]:
    """Packed against padded: the forwards' per-token log-probs (`packed_agreement`) and each packed update's first
    loss beside its padded twin's."""
    agreement = planner.get("packed_agreement")
    gaps = {k: r["first_loss_minus_padded"] for k, r in planner.get("runs", {}).items()
            if isinstance(r, dict) and "first_loss_minus_padded" in r}  # fmt: skip
    if not isinstance(agreement, dict) and not gaps:
        return []
    lines = ["**Packed against padded**", "", "| comparison | max \\|Δ\\| | mean \\|Δ\\| | mean Δ |", "|---|---|---|---|"]
    if isinstance(agreement, dict):
        for key in ("fp32_packed_vs_padded", "bf16_packed_vs_padded", "bf16_padded_batch_vs_alone"):
            if isinstance(agreement.get(key), dict):
                d = agreement[key]
                lines.append(f"| log-probs, {key.replace('_', ' ')} | {cell(d['max_abs'])} | {cell(d['mean_abs'])} | {cell(d['mean'])} |")
        lines.append(f"| log-probs, bf16 leak past a sequence's end | {cell(agreement.get('bf16_leak'))} | – | – |")
    lines += [f"| first loss, {name} − padded | – | – | {cell(gap)} |" for name, gap in gaps.items()]
    return lines + [""]


def profile_rows(throughput: dict) -> list[str]:
    """Where the padded update's time went (`bench/gpu_check/profile_summary.py`): its phases and top kernels."""
    run = next(iter(throughput.get("runs", {}).values()), None)
    prof = run.get("measured", {}).get("profile") if isinstance(run, dict) else None
    if not prof:
        return []
    lines = [f"**Where the update's time goes** (one profiled step of {cell(prof['wall_s'])} s; {prof['measured_on']}: "
             f"{cell(prof['kernels_s'])} s, outside them {cell(prof.get('outside_kernels_share'))} of the step)", "",
             "| phase or kernel | calls | seconds | share of kernels |", "|---|---|---|---|"]  # fmt: skip
    for name, ph in prof["phases"].items():
        lines.append(f"| {name} (phase) | {ph['calls']} | {cell(ph['device_s'] if ph['device_s'] is not None else ph['cpu_s'])} | – |")
    lines += [f"| `{cell(k['name'])}` | {k['calls']} | {cell(k['seconds'])} | {cell(k['share'])} |" for k in prof["top"]]
    return lines + [""]


def fast_path_rows(fast: dict) -> list[str]:
    """Each fast path and memory setting at the throughput setup, under expandable segments."""
    lines = [f"**Fast paths at the throughput setup** (allocator: {fast.get('allocator')}; planned peak by chunk: "
             + ", ".join(f"{k} {cell(v)} GiB" for k, v in fast.get("planned_peak_gib", {}).items() if not isinstance(v, dict))
             + ")", "", "| variant | step s | tokens/s | MFU | allocated GiB | reserved GiB | first loss − plain | grad norm vs plain |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in fast.get("runs", {}).items():
        if not isinstance(r, dict) or "measured" not in r:
            lines.append(f"| {name} | {r.get('error') or r.get('skipped') if isinstance(r, dict) else r} |")
            continue
        m = r["measured"]
        lines.append(f"| {name} | {cell(m['step_s'])} | {cell(m['tokens_per_s'], 4)} | {cell(r.get('mfu'))} | "
                     f"{cell(m['peak_allocated_gib'])} | {cell(m['peak_reserved_gib'])} | {cell(m.get('first_loss_minus_plain'))} "
                     f"| {cell(m.get('first_grad_norm_relative_to_plain'))} |" + (f" {m['error']}" if "error" in m else ""))  # fmt: skip
    return lines + [""]


def tables(runs: dict[str, dict]) -> str:
    lines = header_table(runs) + [""]
    if "doctor" in runs:
        lines += ["**Doctor rows**", "", "| configuration | check | result | figure |", "|---|---|---|---|"]
        for config, r in runs["doctor"].get("configs", {}).items():
            for row in r.get("rows", []) if isinstance(r, dict) else []:
                lines.append(f"| {config} | {row['check']} | {row['result']} | {cell(row['figure'] or row['note'])} |")
        lines.append("")
    if "planner" in runs:
        lines += measured_rows("The planner against the measured update", runs["planner"].get("runs", {}))
        lines += packed_rows(runs["planner"])
    if "throughput" in runs:
        t = runs["throughput"]
        pub = t.get("published", {})
        lines += measured_rows(f"Trainer throughput at {pub.get('setup')} (published: {pub.get('tokens_per_s')} tokens/s, "
                               f"MFU {pub.get('mfu')})", t.get("runs", {}), mfu=True)  # fmt: skip
        lines += profile_rows(t)
    if "fast_paths" in runs:
        lines += fast_path_rows(runs["fast_paths"])
    if "engine" in runs:
        lines += ["**HF engine generation**", "", "| policy | sequences | tokens | seconds | tokens/s |", "|---|---|---|---|---|"]
        for name, r in runs["engine"].get("runs", {}).items():
            if "tokens_per_s" in r:
                lines.append(f"| {name} | {r['sequences']} | {r['generated_tokens']} | {cell(r['seconds'])} | {cell(r['tokens_per_s'], 4)} |")
            else:
                lines.append(f"| {name} | {r.get('error') or r.get('skipped')} |")
        lines.append("")
    if "rl_runs" in runs:
        keys = ["train/reward_mean", "train/loss", "train/entropy", "train/grad_norm", "val/accuracy"]
        lines += [f"**RL runs** ({runs['rl_runs'].get('policy')})", "", "| run | seconds | " + " | ".join(keys) + " |",
                  "|---" * (len(keys) + 2) + "|"]  # fmt: skip
        for name, r in runs["rl_runs"].get("runs", {}).items():
            if "final_metrics" not in r:
                lines.append(f"| {name} | {r.get('error') or r.get('skipped')} |")
                continue
            lines.append(f"| {name} | {cell(r['seconds'])} | " + " | ".join(cell(r["final_metrics"].get(k)) for k in keys) + " |")
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--write", action="store_true", help=f"into {DOC.relative_to(REPO)} between its markers")
    args = p.parse_args()
    runs = load(args.folder)
    if not runs:
        sys.exit(f"error: no JSON files in {args.folder}")
    text = tables(runs)
    if not args.write:
        print(text, end="")
        return
    doc = DOC.read_text()
    start, end = doc.index(BEGIN) + len(BEGIN), doc.index(END)
    DOC.write_text(doc[:start] + "\n" + text + doc[end:])
    print(f"wrote the tables of {args.folder} into {DOC}")


if __name__ == "__main__":
    main()
