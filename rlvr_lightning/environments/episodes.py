"""Multi-turn generation with a tool: sample, stop where the model closes a code block, run the code, append
its output's token ids, and sample on from there, until each answer ends or hits a limit.

Token-in/token-out: a completion's ids are exactly the ids the engine sampled, with the ids of each output the
library tokenized between them (`Completion.sampled` marks which is which); nothing the model wrote is decoded
and encoded again. Text is decoded only to find a closed block and read its code. An engine that honours stop
strings (vLLM) ends a segment at the block's end; where one samples past it (the HF engine), the segment is cut
at the first token that completes the marker, and what follows is dropped: the prefix of a sample is a sample
of the prefix, and the rest is sampled again after the output, as the model would see it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from rlvr_lightning.environments.python_tool import PythonTool, PythonToolSettings, ToolCall
from rlvr_lightning.rewards.extraction import extract_prediction
from rlvr_lightning.rollout.engine import RolloutEngine
from rlvr_lightning.rollout.types import Completion, SamplingConfig
from rlvr_lightning.seeding import derived_seed

StopReason = Literal["answered", "max_calls", "length"]


@dataclass
class Episode:
    """One answer in the making: its prompt, its response so far and the calls it made."""

    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    turns: int = 0
    stop: StopReason | None = None
    void_turns: int = 0  # segments with neither a closed code block nor an answer (SimpleTIR's void turn)

    def add(self, ids: list[int], logprobs: list[float], sampled: int) -> None:
        self.ids += ids
        self.logprobs += logprobs
        self.sampled += [sampled] * len(ids)

    @property
    def own_ids(self) -> list[int]:
        """The tokens the model sampled, without what the tool inserted."""
        return [t for t, s in zip(self.ids, self.sampled) if s]

    @property
    def timed_out(self) -> bool:
        return any(c.execution.status == "timeout" for c in self.calls)

    def excluded_by(self, settings: PythonToolSettings) -> str:
        """The stability guard that leaves this answer out of the loss, or "" (`PythonToolSettings.drop_*`)."""
        if settings.drop_void_turns and self.void_turns:
            return "void_turn"
        if settings.drop_max_calls and self.stop == "max_calls":
            return "max_calls"
        if settings.drop_timeouts and self.timed_out:
            return "timeout"
        return ""

    def completion(self, settings: PythonToolSettings) -> Completion:
        finish = "length" if self.stop == "length" else "stop"
        sampled = self.sampled if 0 in self.sampled else []
        return Completion(self.ids, self.logprobs, finish, sampled=sampled, excluded=self.excluded_by(settings))


def cut_at_marker(tokenizer, ids: list[int], marker: str) -> tuple[int, str]:
    """The fewest leading tokens of `ids` whose text contains `marker` (len(ids) if none does), and their text."""
    text = tokenizer.decode(ids)
    if marker not in text:
        return len(ids), text
    lo, hi = 1, len(ids)  # containing the marker is monotone in the prefix length
    while lo < hi:
        mid = (lo + hi) // 2
        if marker in tokenizer.decode(ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo, text if lo == len(ids) else tokenizer.decode(ids[:lo])


def generate_episodes(
    engine: RolloutEngine, tokenizer, prompt_ids: list[list[int]], sampling: SamplingConfig, tool: PythonTool
) -> list[list[Episode]]:
    """G episodes per prompt (`sampling.group_size`), each within `sampling.max_tokens` response tokens, tool
    outputs included; grouped per prompt like `RolloutEngine.generate`."""
    G, budget, marker = sampling.group_size, sampling.max_tokens, tool.settings.code_end
    max_turns = 2 * tool.settings.max_calls + 2  # a marker that closes no code block resumes without a call
    groups = engine.generate(prompt_ids, replace(sampling, stop=tool.stop))
    episodes = [Episode(list(prompt_ids[i])) for i in range(len(prompt_ids)) for _ in range(G)]
    segments = [c for group in groups for c in group]
    active = list(range(len(episodes)))
    turn = 0
    while active:
        turn += 1
        to_run: list[tuple[int, str]] = []
        for n, segment in zip(active, segments):
            episode = episodes[n]
            keep, text = cut_at_marker(tokenizer, segment.token_ids, marker)
            episode.add(segment.token_ids[:keep], segment.logprobs[:keep], 1)
            episode.turns += 1
            at = text.find(marker)  # the kept tokens end on the marker; the last one may carry a few characters more
            stopped_at_marker = at != -1
            code = tool.code_of(text[: at + len(marker)]) if stopped_at_marker else None
            if code is None and (stopped_at_marker or extract_prediction(text) is None):
                episode.void_turns += 1  # neither a call nor an answer
            if len(episode.ids) >= budget or (segment.finish_reason == "length" and not stopped_at_marker):
                episode.stop = "length"
            elif code is not None and len(episode.calls) >= tool.settings.max_calls:
                episode.stop = "max_calls"
            elif code is not None:
                to_run.append((n, code))
            elif not stopped_at_marker or episode.turns >= max_turns:
                episode.stop = "answered"
        for (n, _), call in zip(to_run, tool.run([code for _, code in to_run])):
            episode = episodes[n]
            episode.calls.append(call)
            output = tokenizer(call.appended, add_special_tokens=False).input_ids
            room = budget - len(episode.ids)
            episode.add(output[:room], [0.0] * min(room, len(output)), 0)
            if len(output) >= room:
                episode.stop = "length"
        active = [n for n in range(len(episodes)) if episodes[n].stop is None]
        if not active:
            break
        prompts = [episodes[n].prompt + episodes[n].ids for n in active]
        # One continuation per episode, each with what is left of its budget, seeded from the batch's seed, the
        # turn and that budget (an engine that takes no per-request seed, vLLM on CPU, follows its own seed: the
        # continuations are asked for in the same order every time).
        lefts = [budget - len(episodes[n].ids) for n in active]
        segments = []
        for left in sorted(set(lefts)):
            which = [k for k, x in enumerate(lefts) if x == left]
            seed = None if sampling.seed is None else derived_seed(sampling.seed, turn, left)
            params = replace(sampling, group_size=1, max_tokens=left, stop=tool.stop, seed=seed)
            for k, group in zip(which, engine.generate([prompts[k] for k in which], params)):
                segments.append((k, group[0]))
        segments = [c for _, c in sorted(segments, key=lambda x: x[0])]
    return [episodes[i * G : (i + 1) * G] for i in range(len(prompt_ids))]


def episode_metrics(episodes: list[Episode], settings: PythonToolSettings) -> dict[str, float]:
    """A rollout batch's tool metrics (logged as `train/tool_…`, `train/stop_…`): calls per answer, the share of
    answers that call, how calls ended, outputs cut, turns, the share of response tokens the tool inserted, call
    latency, why answers stopped, and the shares of answers with a void turn, with a timed-out call, and that the
    stability guards leave out of the loss."""
    n = max(1, len(episodes))
    calls = [c for e in episodes for c in e.calls]
    ended = [c.execution.status for c in calls]
    seconds = sorted(c.execution.seconds for c in calls)
    tokens = sum(len(e.ids) for e in episodes)
    per_call = max(1, len(calls))
    out = {
        "tool_calls_per_answer": len(calls) / n,
        "tool_answers_with_call": sum(bool(e.calls) for e in episodes) / n,
        "tool_success_frac": ended.count("ok") / per_call,
        "tool_error_frac": ended.count("error") / per_call,
        "tool_timeout_frac": ended.count("timeout") / per_call,
        "tool_output_truncated_frac": sum(c.truncated for c in calls) / per_call,
        "tool_turns_mean": sum(e.turns for e in episodes) / n,
        "tool_output_token_frac": sum(e.sampled.count(0) for e in episodes) / max(1, tokens),
        "tool_latency_p50_ms": 1000 * seconds[len(seconds) // 2] if seconds else 0.0,
        "tool_latency_p95_ms": 1000 * seconds[int(0.95 * (len(seconds) - 1))] if seconds else 0.0,
    }
    for reason in ("answered", "max_calls", "length"):
        out[f"stop_{reason}_frac"] = sum(e.stop == reason for e in episodes) / n
    out["tool_void_turn_answers"] = sum(bool(e.void_turns) for e in episodes) / n
    out["tool_timed_out_answers"] = sum(e.timed_out for e in episodes) / n
    out["tool_excluded_answers"] = sum(bool(e.excluded_by(settings)) for e in episodes) / n
    return out
