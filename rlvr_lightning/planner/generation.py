"""One engine's rollout of its sequences, as vLLM's scheduler runs it (continuous batching), or as the HF
engine runs it (one padded batch).

vLLM: requests are admitted in order while fewer than `max_num_seqs` run and the paged KV cache has room
for the next one's prompt; blocks are allocated as sequences grow, not reserved at their final size. When
the cache is full the most recently admitted sequence is preempted (vLLM's recompute mode: its prompt and
the tokens it generated so far are prefilled again when it is re-admitted, first in line). Every decode
step advances every running sequence by one token and costs

    max(bytes / bandwidth, 2 × parameters × running / FLOP/s) + a per-step overhead,

bytes being the weights streamed once (the input embedding is gathered, not streamed) and the KV cache of
every live token. Between events (a sequence finishes, the cache fills, sequences are admitted) the
running set is constant and the per-step cost affine in the step, so each segment is summed in closed
form: a rollout of 1,024 sequences of 8k tokens is a few thousand events, not eight million steps.

Simplifications, each stated in the plan: every prompt at the mean prompt length; prefill priced apart
from the decode steps (vLLM chunks it into them), compute-bound; the cache counted in tokens, with one
block (BLOCK_TOKENS) of headroom per running sequence required to admit another (so an admission does not
at once preempt); attention's FLOPs left out of the decode step.

The HF engine (`rollout.engine hf`, transformers' `generate`) decodes the whole batch as one padded batch
until its longest response ends: steps = the longest response, every row in every step.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import deque
from dataclasses import dataclass

BLOCK_TOKENS = 16  # vLLM's default KV block size
# The tail: decode steps while fewer than this share of the batch an average token is decoded in run (that
# batch, Σ running² / Σ running over the steps, is not pulled down by the tail's own many small steps).
TAIL_SHARE = 0.25


@dataclass(frozen=True)
class DecodeCosts:
    """What one engine pays per token and per step."""

    weight_bytes: float  # read once per decode step
    kv_bytes_per_token: float
    bandwidth: float  # bytes/s a decode step sustains
    flops_per_token: float  # 2 × the matmuls' parameters
    flop_s: float  # FLOP/s a decode or prefill step sustains
    step_overhead_s: float  # scheduling, sampling, kernel launches: per decode step, whatever the batch

    def prefill_seconds(self, tokens: float) -> float:
        return tokens * self.flops_per_token / self.flop_s

    def segment(self, steps: int, running: int, live_tokens: float) -> float:
        """Decode seconds (overhead apart) of `steps` steps of `running` sequences, the first step reading
        `live_tokens` tokens of KV (each later step `running` more): Σ_j max(a + b·j, m), in closed form."""
        if steps <= 0:
            return 0.0
        a = (self.weight_bytes + self.kv_bytes_per_token * live_tokens) / self.bandwidth
        b = self.kv_bytes_per_token * running / self.bandwidth
        m = running * self.flops_per_token / self.flop_s
        if a >= m:
            bound = 0  # memory-bound from the first step
        elif b <= 0:
            bound = steps
        else:
            bound = min(steps, math.ceil((m - a) / b))  # the first steps are compute-bound
        memory = (steps - bound) * a + b * (steps * (steps - 1) - bound * (bound - 1)) / 2
        return bound * m + memory


@dataclass(frozen=True)
class Generation:
    decode_steps: int
    prefill_s: float
    decode_s: float
    overhead_s: float
    mean_in_flight: float  # sequences per decode step, averaged over the steps
    peak_in_flight: int
    preemptions: int
    tail_s: float  # decode seconds while fewer than TAIL_SHARE × the typical batch run (the long tail)
    tail_steps: int
    model: str  # which scheduler was simulated, in words
    tail_rule: str = f"steps at under {TAIL_SHARE:.0%} of the batch an average token sees"
    tool_s: float = 0.0  # the Python tool's calls, while the engine waits for them (`planner.tool_time`)

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s + self.overhead_s + self.tool_s

    def as_dict(self) -> dict:
        return {
            "seconds": round(self.seconds, 3),
            "prefill_s": round(self.prefill_s, 3),
            "decode_s": round(self.decode_s, 3),
            "overhead_s": round(self.overhead_s, 3),
            "tool_s": round(self.tool_s, 3),
            "decode_steps": self.decode_steps,
            "mean_in_flight": round(self.mean_in_flight, 1),
            "peak_in_flight": self.peak_in_flight,
            "preemptions": self.preemptions,
            "tail_s": round(self.tail_s, 3),
            "tail_steps": self.tail_steps,
            "tail_rule": self.tail_rule,
            "model": self.model,
        }


def continuous_batching(prompt: int, lengths: list[int], kv_tokens: int, max_num_seqs: int, costs: DecodeCosts) -> Generation:
    """vLLM's rollout of sequences with these response `lengths` (in the order they are submitted), each
    after a `prompt`-token prompt, in a paged cache of `kv_tokens` tokens (see the module's docstring)."""
    if prompt + max(lengths) > kv_tokens:
        raise ValueError(f"a sequence of {prompt + max(lengths)} tokens does not fit a KV cache of {kv_tokens} tokens")
    waiting = deque(range(len(lengths)))
    generated = [0] * len(lengths)
    running: dict[int, tuple[int, int, int]] = {}  # sequence → (admitted at step, context then, admission id)
    ends: list[tuple[int, int, int]] = []  # heap of (step it finishes, admission id, sequence)
    admitted: list[tuple[int, int]] = []  # (sequence, admission id), in admission order (stale entries skipped)
    now = offset = admissions = preemptions = 0  # offset: Σ (context at admission − step admitted)
    prefill_s = decode_s = 0.0
    segments: list[tuple[int, int, float]] = []  # (running, steps, decode seconds)

    def usage() -> int:  # live tokens: Σ over running of context at admission + steps since
        return offset + len(running) * now

    def remove(seq: int) -> tuple[int, int, int]:
        nonlocal offset
        start, context, ident = running.pop(seq)
        offset -= context - start
        return start, context, ident

    while waiting or running:
        while waiting and len(running) < max_num_seqs:  # admissions, first in line first
            seq = waiting[0]
            context = prompt + generated[seq]
            if running and kv_tokens - usage() < context + BLOCK_TOKENS * (len(running) + 1):
                break
            waiting.popleft()
            admissions += 1
            running[seq] = (now, context, admissions)
            offset += context - now
            heapq.heappush(ends, (now + lengths[seq] - generated[seq], admissions, seq))
            admitted.append((seq, admissions))
            prefill_s += costs.prefill_seconds(context)
        while ends and running.get(ends[0][2], (0, 0, -1))[2] != ends[0][1]:
            heapq.heappop(ends)  # a preempted sequence's old entry
        room = (kv_tokens - usage()) // len(running)  # steps until the cache is full
        if room == 0:  # preempt the latest admitted; it waits first in line with what it generated
            while running.get(admitted[-1][0], (0, 0, -1))[2] != admitted[-1][1]:
                admitted.pop()
            seq, _ = admitted.pop()
            start, _, _ = remove(seq)
            generated[seq] += now - start
            waiting.appendleft(seq)
            preemptions += 1
            continue
        steps = min(ends[0][0] - now, room)
        seconds = costs.segment(steps, len(running), usage())
        decode_s += seconds
        segments.append((len(running), steps, seconds))
        now += steps
        while ends and ends[0][0] == now:
            _, ident, seq = heapq.heappop(ends)
            if running.get(seq, (0, 0, -1))[2] == ident:
                remove(seq)
    return _summary(
        segments,
        None,
        now,
        prefill_s,
        decode_s,
        costs,
        preemptions,
        "vLLM continuous batching: paged KV cache, admitted as others finish, preempted (recompute) when full",
    )


def padded_batch(prompt: int, lengths: list[int], costs: DecodeCosts) -> Generation:
    """The HF engine: one batch of every sequence, padded to the longest response. Its tail: the steps
    after three quarters of the responses have ended."""
    n, steps = len(lengths), max(lengths)
    seconds = costs.segment(steps, n, n * prompt)
    most = sorted(lengths)[math.ceil(0.75 * n) - 1]
    tail = (n, steps - most, seconds - costs.segment(most, n, n * prompt))
    g = _summary(
        [(n, steps, seconds)],
        [tail],
        steps,
        costs.prefill_seconds(n * prompt),
        seconds,
        costs,
        0,
        "HF generate: one padded batch, every row decoded until the longest response ends",
    )
    return dataclasses.replace(g, tail_rule="steps after three quarters of the responses ended")


def _summary(segments, tail, steps, prefill_s, decode_s, costs, preemptions, model) -> Generation:
    peak = max(r for r, _, _ in segments)
    mean = sum(r * k for r, k, _ in segments) / max(1, steps)
    if tail is None:
        typical = sum(r * r * k for r, k, _ in segments) / max(1, sum(r * k for r, k, _ in segments))
        tail = [(r, k, s) for r, k, s in segments if r < TAIL_SHARE * typical]
    tail_steps = sum(k for _, k, _ in tail)
    return Generation(
        decode_steps=steps,
        prefill_s=prefill_s,
        decode_s=decode_s,
        overhead_s=steps * costs.step_overhead_s,
        mean_in_flight=mean,
        peak_in_flight=peak,
        preemptions=preemptions,
        tail_s=sum(s for _, _, s in tail) + tail_steps * costs.step_overhead_s,
        tail_steps=tail_steps,
        model=model,
    )
