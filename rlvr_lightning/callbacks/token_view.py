"""A token view of a trained rollout batch: a self-contained HTML page (no network, no script from elsewhere) where each
sampled answer's tokens are shaded by a chosen quantity: the token advantage Â·w, the advantage shapers' weight w (THR,
OAR), the engine's log-prob minus the trainer's θ_old log-prob (the train–inference mismatch), the rollout
correction's weight, and the policy's entropy at each token (the update's first forward of it). Tokens an environment inserted are boxed and grey, tokens left out of the loss struck through; each
token's values are in its tooltip, and each answer's range of the chosen quantity is written above it.
How to read it for THR and OAR: docs/metrics.md#the-token-view."""

from __future__ import annotations

import html
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# name → (label, the neutral value: no shading)
QUANTITIES = {
    "advantage": ("token advantage Â·w", 0.0),
    "weight": ("shaper weight w (THR, OAR)", 1.0),
    "mismatch": ("engine − trainer log-prob", 0.0),
    "correction": ("rollout correction weight", 1.0),
    "entropy": ("policy entropy (nats)", 0.0),
}


@dataclass(frozen=True)
class TokenAnswer:
    """One answer as the page shows it: its tokens, a value of each quantity per token (None: not defined there),
    which tokens were inserted and which are out of the loss."""

    title: str
    tokens: list[str]
    values: dict[str, list[float | None]]
    inserted: list[bool]
    masked: list[bool]


def token_answers(result, rows: Sequence[int], decode: Callable[[list[int]], str]) -> list[TokenAnswer]:
    """The answers `rows` of a trained rollout batch (`training.step_metrics.StepResult`), their values on the CPU."""
    batch, inputs = result.batch, result.inputs
    rollout, t = batch.rollout, inputs.tensors
    weights = inputs.token_weights()
    weights = None if weights is None else weights.float().cpu()
    if batch.token_advantages is not None:  # distillation's own per-token advantages
        advantages = batch.token_advantages.float().cpu()
    else:
        advantages = batch.advantages.float().cpu()[:, None].expand(t.response_mask.shape)
    if weights is not None:  # Â' = Â·w; past a shaper's width its weight is 1
        w = torch.ones_like(advantages)
        width = min(w.shape[1], weights.shape[1])
        w[:, :width] = weights[:, :width]
        advantages = advantages * w
    mismatch = (t.rollout_logp.float() - inputs.behaviour.old_logp_all().float()).cpu()
    correction = None if inputs.is_weight is None else inputs.is_weight.float().cpu()
    entropy = getattr(result, "token_entropy", None)  # the first rows' own, where the step kept them
    loss_mask = inputs.loss_mask.bool().cpu()
    answers = []
    for n in rows:
        c = rollout.completions[n]
        L = len(c.token_ids)
        values = {
            "advantage": row_values(advantages, n, L, None),
            "weight": row_values(weights, n, L, 1.0),
            "mismatch": row_values(mismatch, n, L, None),
            "correction": row_values(correction, n, L, None if correction is not None else 1.0),
            "entropy": row_values(entropy, n, L, None) if entropy is not None and n < len(entropy) else [None] * L,
        }
        values["entropy"] = [None if v is None or v != v else v for v in values["entropy"]]  # NaN: not kept
        for key in ("advantage", "mismatch", "correction", "entropy"):  # defined on the tokens the policy sampled only
            values[key] = [v if s else None for v, s in zip(values[key], c.sampled_mask)]
        masked = [bool(s) and not bool(m) for s, m in zip(c.sampled_mask, row_values(loss_mask, n, L, 0.0))]
        title = (f"answer {n} (group {n // rollout.group_size}) · correct {float(rollout.correct[n]):g} · "
                 f"reward {float(batch.rewards[n]):.3f} · Â {float(batch.advantages[n]):.3f} · {c.finish_reason}")  # fmt: skip
        answers.append(TokenAnswer(title, [decode([i]) for i in c.token_ids], values, [not s for s in c.sampled_mask], masked))
    return answers


def row_values(x: torch.Tensor | None, n: int, length: int, fill: float | None) -> list[float | None]:
    """Row n's first `length` values of a [N, T] tensor, `fill` past its width (a shaper may weigh a prefix only) or
    everywhere when there is no tensor."""
    if x is None:
        return [fill] * length
    values = x[n, :length].tolist()
    return values + [fill] * (length - len(values))


def token_view_html(answers: Sequence[TokenAnswer], heading: str) -> str:
    """The page: a quantity selector, then each answer's range line and its shaded tokens."""
    options = "".join(f'<option value="{k}">{html.escape(label)}</option>' for k, (label, _) in QUANTITIES.items())
    blocks = []
    for a in answers:
        spans = []
        for i, token in enumerate(a.tokens):
            data = {k: a.values[k][i] for k in QUANTITIES}
            tip = "; ".join(f"{QUANTITIES[k][0]} = {'–' if v is None else f'{v:.4g}'}" for k, v in data.items())
            if a.inserted[i]:
                tip += "; inserted by the environment"
            if a.masked[i]:
                tip += "; out of the loss"
            cls = " ".join(c for c, on in (("inserted", a.inserted[i]), ("masked", a.masked[i])) if on)
            attrs = "".join(f' data-{k}="{"" if v is None else repr(float(v))}"' for k, v in data.items())
            spans.append(f'<span class="t {cls}" title="{html.escape(tip)}"{attrs}>{html.escape(token)}</span>')
        blocks.append(f'<div class="answer"><div class="title">{html.escape(a.title)}</div>'
                      f'<div class="range"></div><div class="tokens">{"".join(spans)}</div></div>')  # fmt: skip
    neutral = json.dumps({k: n for k, (_, n) in QUANTITIES.items()})
    return PAGE.format(heading=html.escape(heading), options=options, blocks="\n".join(blocks), neutral=neutral)


PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>{heading}</title>
<style>
body {{ font-family: sans-serif; margin: 1em; }}
.answer {{ margin: 1em 0; border-top: 1px solid #ccc; padding-top: .5em; }}
.title {{ font-weight: bold; }} .range {{ color: #555; margin: .2em 0; }}
.tokens {{ font-family: monospace; white-space: pre-wrap; line-height: 1.6; }}
.t.inserted {{ color: #888; outline: 1px dashed #888; }} .t.masked {{ text-decoration: line-through; }}
</style></head><body>
<h2>{heading}</h2>
<p>Shade by <select id="quantity">{options}</select> (red: above its neutral value, blue: below; hover a token for
its values). Boxed grey: inserted by an environment; struck through: out of the loss.</p>
{blocks}
<script>
const NEUTRAL = {neutral};
function shade() {{
  const q = document.getElementById("quantity").value;
  const spans = Array.from(document.querySelectorAll("span.t"));
  let scale = 0;
  for (const s of spans) {{ const v = s.dataset[q]; if (v !== "") scale = Math.max(scale, Math.abs(parseFloat(v) - NEUTRAL[q])); }}
  for (const s of spans) {{
    const v = s.dataset[q];
    if (v === "" || scale === 0) {{ s.style.background = ""; continue; }}
    const d = (parseFloat(v) - NEUTRAL[q]) / scale;
    s.style.background = d >= 0 ? `rgba(220,40,40,${{d}})` : `rgba(40,80,220,${{-d}})`;
  }}
  for (const a of document.querySelectorAll(".answer")) {{
    const vals = Array.from(a.querySelectorAll("span.t")).map(s => s.dataset[q]).filter(v => v !== "").map(parseFloat);
    a.querySelector(".range").textContent = vals.length
      ? `${{q}}: min ${{Math.min(...vals).toPrecision(4)}}, max ${{Math.max(...vals).toPrecision(4)}} over ${{vals.length}} tokens`
      : `${{q}}: not defined on this answer`;
  }}
}}
document.getElementById("quantity").addEventListener("change", shade);
shade();
</script></body></html>
"""
