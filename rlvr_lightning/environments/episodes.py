"""Multi-turn generation: sample, stop where a segment ends, let the environment reply, append its reply's
token ids, and sample on from there, until each answer ends or hits a limit (`environments.base`).

Token-in/token-out: a completion's ids are exactly the ids the engine sampled, with the ids of each reply the
library tokenized between them (`Episode.add_tokens` marks which is which in `sampled_mask`, the one mask that
goes on to the loss as `Completion.sampled_mask`); nothing the model wrote is decoded
and encoded again. Text is decoded only for the environment to read. An engine that honours stop strings (vLLM)
ends a segment at the environment's stop string; where one samples past it (the HF engine, or a stop string
split across two requests), the segment is cut at the first token that completes it, and what follows is
dropped: the prefix of a sample is a sample of the prefix, and the rest is sampled again after the reply, as
the model would see it.

Episodes may also be advanced in pieces (`advance_episodes` with a `cap`): each stops once it holds `cap`
response tokens, mid-turn or after a reply, and a later call continues it from there, under whatever weights
the engine holds then (the rollout stream's partial rollouts: a weight sync between two pieces). A turn cut by
the cap is one turn: the environment sees it whole, once it ends.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, is_dataclass, replace
from typing import Any

from rlvr_lightning.environments.base import Environment, EnvironmentFailed, Reply
from rlvr_lightning.rollout.engine import RolloutEngine
from rlvr_lightning.rollout.types import Completion, PromptBatch, SamplingConfig
from rlvr_lightning.seeding import derived_seed

STOP_REASONS = ("answered", "length", "max_turns")  # the loop's own; an environment adds its `stop_reasons`
# Batches generated side by side (replicas, the rollout stream) may ask for replies at once; an environment
# that has not said it can answer them so (`Environment.concurrent_replies`) answers one batch at a time.
_ONE_REPLY_AT_A_TIME = threading.Lock()


@dataclass
class Episode:
    """One answer in the making: its prompt and problem, its response so far, and what the environment did.
    The loop writes it; an environment reads it and returns what it adds (`Reply.calls`, `Reply.notes`).
    Episodes of a batch generated ahead go into checkpoints as plain values (`to_state`): `calls` as dicts
    where they are dataclasses (the environment's `load_call` rebuilds them), `state` as it is."""

    prompt: list[int]
    question: str = ""  # the problem's prompt text
    answer: str = ""  # its gold answer
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sampled_mask: list[bool] = field(default_factory=list)  # per token of `ids`: sampled (True) or inserted (False)
    versions: list[int] = field(default_factory=list)  # the policy version of each token, where known (async)
    turns: int = 0
    turn_start: int = 0  # where the current turn's tokens begin in `ids` (after the last reply)
    segment: str = ""  # the latest segment's text, ending on the stop string where it hit one
    stopped_at: str | None = None  # the environment's stop string the latest segment ended on
    stop: str | None = None  # why it ended (`Reply.stop`, or the loop's "length" / "max_turns")
    reward: float | None = None  # the environment's reward, when it gave one
    calls: list[Any] = field(default_factory=list)  # what the environment ran for it (`Reply.calls`, in order)
    reply_seconds: float = 0.0  # its share of the wall time its environment took to reply (a batch's, split evenly)
    state: dict[str, Any] = field(default_factory=dict)  # the environment's own notes on it (`Reply.notes`)
    # What happened, in order (`Completion.events`: an answer's trace in MLflow): each turn the model took and each
    # reply the environment gave, with its token range, wall-clock window and calls (the objects `calls` holds;
    # `to_state` saves them as `calls` are saved).
    events: list[dict[str, Any]] = field(default_factory=list)
    turn_started_ns: int = 0  # when the generation call that began the current turn started

    def add_tokens(self, ids: list[int], logprobs: list[float], versions: list[int] | None, *, sampled: bool) -> None:
        """Append tokens the engine `sampled`, or that the environment inserted (`sampled=False`): the one place
        a token's mark is made."""
        self.ids += ids
        self.logprobs += logprobs
        self.sampled_mask += [sampled] * len(ids)
        if versions is not None:
            self.versions += versions

    @property
    def own_ids(self) -> list[int]:
        """The tokens the model sampled, without what the environment inserted."""
        return [t for t, s in zip(self.ids, self.sampled_mask) if s]

    def completion(self, excluded: str = "") -> Completion:
        finish = "length" if self.stop == "length" else "stop"
        return Completion(
            self.ids, self.logprobs, finish, list(self.versions), list(self.sampled_mask), excluded, list(self.events)
        )

    def to_state(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_state(state: dict[str, Any], environment: Environment) -> Episode:
        """An episode `to_state` saved; one saved before `sampled_mask` holds `sampled` (1/0 per token) instead."""
        state = dict(state)
        if "sampled" in state:
            state["sampled_mask"] = [bool(s) for s in state.pop("sampled")]
        episode = Episode(**state)
        episode.calls = [environment.load_call(c) for c in episode.calls]
        return episode


def cut_at_stop(tokenizer, ids: list[int], stops: tuple[str, ...]) -> tuple[int, str, str | None]:
    """The fewest leading tokens of `ids` whose text contains one of `stops` (len(ids) if none does), their
    text, and the stop string it contains first (None if none)."""
    text = tokenizer.decode(ids)
    if not any(s in text for s in stops):
        return len(ids), text, None
    lo, hi = 1, len(ids)  # containing a stop string is monotone in the prefix length
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in tokenizer.decode(ids[:mid]) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    kept = text if lo == len(ids) else tokenizer.decode(ids[:lo])
    return lo, kept, min((s for s in stops if s in kept), key=kept.find)


def start_episodes(prompt_ids: list[list[int]], group_size: int, batch: PromptBatch | None = None) -> list[Episode]:
    """`group_size` empty episodes per prompt of `batch`'s problems, group-contiguous."""
    problems = list(zip(batch.prompts, batch.answers)) if batch is not None else [("", "")] * len(prompt_ids)
    return [Episode(list(prompt_ids[i]), *problems[i]) for i in range(len(prompt_ids)) for _ in range(group_size)]


Generate = Callable[[list[list[int]], SamplingConfig], list[list[Completion]]]  # `RolloutEngine.generate`


def generate_episodes(
    engine: RolloutEngine,
    tokenizer,
    prompt_ids: list[list[int]],
    sampling: SamplingConfig,
    environment: Environment,
    batch: PromptBatch | None = None,
) -> list[list[Episode]]:
    """G episodes per prompt (`sampling.group_size`) of `batch`'s problems, each within `sampling.max_tokens`
    response tokens, replies included; grouped per prompt like `RolloutEngine.generate`."""
    G = sampling.group_size
    episodes = start_episodes(prompt_ids, G, batch)
    advance_episodes(engine.generate, tokenizer, episodes, sampling, environment)
    return [episodes[i * G : (i + 1) * G] for i in range(len(prompt_ids))]


@dataclass(frozen=True)
class Limits:
    """What one `advance_episodes` call takes episodes to."""

    cap: int  # the response tokens an episode stops at in this call (a piece of a partial rollout)
    budget: int  # the response tokens an episode may hold in all (`sampling.max_tokens`), replies included
    version: int | None  # the policy version of tokens the engine does not version itself (None: not recorded)


def advance_episodes(
    generate: Generate,
    tokenizer,
    episodes: list[Episode],
    sampling: SamplingConfig,
    environment: Environment,
    cap: int | None = None,
    version: int | None = None,
) -> None:
    """Take `episodes` (group-contiguous, `sampling.group_size` per prompt) on with `generate` (an engine's) until
    each has ended or holds `cap` response tokens (default: the budget, `sampling.max_tokens`). Each token
    added keeps its policy version: the engine's where it reports them per token (servers across weight syncs),
    else `version` (None: not recorded); a reply's tokens take the version of the token before them.
    Episodes with nothing generated start with one request per prompt (`sampling`'s seed and group size); those
    stopped at an earlier cap continue with one request each, seeded from `sampling.seed`."""
    budget = sampling.max_tokens
    limits = Limits(budget if cap is None else min(cap, budget), budget, version)
    stops = tuple(environment.stop)
    sampling = replace(sampling, stop=(*sampling.stop, *stops)) if stops else sampling
    started = time.time_ns()
    active, segments = first_segments(generate, episodes, sampling, limits.cap)
    turn = 0
    while active:
        turn += 1
        ended = [
            episodes[n] for n, s in zip(active, segments) if take_segment(episodes[n], s, tokenizer, stops, limits, started)
        ]
        replies, window = environment_replies(environment, ended) if ended else ([], (0, 0))
        for episode, reply in zip(ended, replies):
            take_reply(episode, reply, tokenizer, environment.max_turns, limits, window)
        active = unfinished(episodes, limits.cap)
        if active:
            started = time.time_ns()
            segments = continuations(generate, episodes, active, sampling, limits.cap, turn)


def unfinished(episodes: list[Episode], cap: int) -> list[int]:
    """The episodes still going that hold fewer than `cap` response tokens."""
    return [n for n, e in enumerate(episodes) if e.stop is None and len(e.ids) < cap]


def first_segments(
    generate: Generate, episodes: list[Episode], sampling: SamplingConfig, cap: int
) -> tuple[list[int], list[Completion]]:
    """The episodes to take on and their first segments: a fresh batch's groups as one request per prompt, else a
    continuation of each unfinished episode."""
    if all(not e.ids and not e.turns for e in episodes):
        G = sampling.group_size
        groups = generate([e.prompt for e in episodes[::G]], replace(sampling, max_tokens=cap))
        return list(range(len(episodes))), [c for group in groups for c in group]
    active = unfinished(episodes, cap)
    return active, continuations(generate, episodes, active, sampling, cap, turn=0)


def take_segment(
    episode: Episode, segment: Completion, tokenizer, stops: tuple[str, ...], limits: Limits, started_ns: int
) -> bool:
    """Append the sampled `segment` (from a generation call begun at `started_ns`), cut where its turn's text first
    completes a stop string; True when the turn ended there (for the environment to reply), False when it stopped
    at the cap mid-turn (it goes on later)."""
    before = len(episode.ids) - episode.turn_start  # the turn's tokens from earlier pieces
    if before == 0 or not episode.turn_started_ns:  # a turn's first piece (or one resumed from an older checkpoint)
        episode.turn_started_ns = started_ns
    keep, text, hit = cut_at_stop(tokenizer, episode.ids[episode.turn_start :] + segment.token_ids, stops)
    keep = max(0, keep - before)  # no stops: the whole segment
    version = limits.version
    versions = segment.versions[:keep] if segment.versions else None if version is None else [version] * keep
    episode.add_tokens(segment.token_ids[:keep], segment.logprobs[:keep], versions, sampled=True)
    at_cap = segment.finish_reason == "length" and hit is None
    if at_cap and limits.cap <= len(episode.ids) < limits.budget:
        return False
    episode.turns += 1
    # the kept tokens end on the stop string; the last one may carry a few characters more
    episode.segment = text if hit is None else text[: text.find(hit) + len(hit)]
    episode.stopped_at = hit
    if len(episode.ids) >= limits.budget or at_cap:
        episode.stop = "length"
    event = {"kind": "turn", "tokens": [episode.turn_start, len(episode.ids)],
             "ns": [episode.turn_started_ns, time.time_ns()], "stopped_at": hit}  # fmt: skip
    episode.events.append(event)
    return True


def take_reply(
    episode: Episode, reply: Reply, tokenizer, max_turns: int, limits: Limits, window: tuple[int, int]
) -> None:
    """The environment's reply to the turn (given in the wall-clock `window`, in ns): its calls and notes kept, then
    its text's ids inserted (within the budget) or the episode ended. An episode already out of budget keeps the
    calls and notes alone. Each reply is one of the episode's `events`."""
    episode.calls += reply.calls
    episode.state.update(reply.notes)
    start = len(episode.ids)
    insert_reply(episode, reply, tokenizer, max_turns, limits)
    event = {"kind": "reply", "tokens": [start, len(episode.ids)], "ns": list(window), "stop": episode.stop,
             "reward": reply.reward, "calls": list(reply.calls)}  # fmt: skip
    episode.events.append(event)


def insert_reply(episode: Episode, reply: Reply, tokenizer, max_turns: int, limits: Limits) -> None:
    """The reply's text's ids inserted (within the budget), or the episode ended."""
    if episode.stop is not None:
        return
    if reply.text is None:
        episode.stop, episode.reward = reply.stop, reply.reward
        return
    output = reply.token_ids(tokenizer)
    room = limits.budget - len(episode.ids)
    inserted = output[:room]
    last = episode.versions[-1] if episode.versions else limits.version
    episode.add_tokens(inserted, [0.0] * len(inserted), None if last is None else [last] * len(inserted), sampled=False)
    episode.turn_start = len(episode.ids)
    if output and len(output) >= room:
        episode.stop = "length"
    elif episode.turns >= max_turns:
        episode.stop = "max_turns"


def plain_value(call: Any) -> Any:
    """One of `Reply.calls` as plain values: a dataclass (the Python tool's `ToolCall`) as a dict of its fields, as a
    checkpoint saves it."""
    return asdict(call) if is_dataclass(call) and not isinstance(call, type) else call


def continuations(
    generate: Generate, episodes: list[Episode], active: list[int], sampling: SamplingConfig, cap: int, turn: int
) -> list[Completion]:
    """One continuation per active episode, each up to `cap` response tokens, seeded from `sampling.seed`, the
    turn and what it may add (an engine that takes no per-request seed, vLLM on CPU, follows its own seed: the
    continuations are asked for in the same order every time)."""
    prompts = [episodes[n].prompt + episodes[n].ids for n in active]
    lefts = [cap - len(episodes[n].ids) for n in active]
    out: list[tuple[int, Completion]] = []
    for left in sorted(set(lefts)):
        which = [k for k, x in enumerate(lefts) if x == left]
        seed = None if sampling.seed is None else derived_seed(sampling.seed, turn, left)
        params = replace(sampling, group_size=1, max_tokens=left, seed=seed)
        for k, group in zip(which, generate([prompts[k] for k in which], params)):
            out.append((k, group[0]))
    return [c for _, c in sorted(out, key=lambda x: x[0])]


def environment_replies(environment: Environment, episodes: list[Episode]) -> tuple[list[Reply], tuple[int, int]]:
    """`environment.reply(episodes)`, checked: one `Reply` per episode, and whatever it raises as one line; with
    the wall-clock window (ns) the environment took."""
    name = type(environment).__name__
    one_at_a_time = contextlib.nullcontext() if environment.concurrent_replies else _ONE_REPLY_AT_A_TIME
    try:
        with one_at_a_time:
            start, clock = time.time_ns(), time.perf_counter()
            replies = list(environment.reply(episodes))
            seconds, end = time.perf_counter() - clock, time.time_ns()
    except Exception as err:
        message = " ".join(str(err).split())
        raise EnvironmentFailed(f"data.environment: {name}.reply raised {type(err).__name__}: {message}") from err
    if len(replies) != len(episodes) or not all(isinstance(r, Reply) for r in replies):
        raise EnvironmentFailed(f"data.environment: {name}.reply must return one Reply per episode "
                                f"({len(episodes)}), got {replies[:3]!r}{'…' if len(replies) > 3 else ''}")  # fmt: skip
    share = seconds / max(1, len(episodes))
    for episode in episodes:
        episode.reply_seconds += share
    return replies, (start, end)


def episode_metrics(episodes: list[Episode], environment: Environment) -> dict[str, float]:
    """A rollout batch's episode metrics (logged under `train/`): why answers stopped (`stop_<reason>_frac`),
    turns per answer, the share of response tokens the environment inserted, the wall time it took to reply
    (`environment_seconds`: beside `time/step`, its share of the step), its mean reward, and the
    environment's own metrics: the same keys for every batch of one environment."""
    n = max(1, len(episodes))
    tokens = sum(len(e.ids) for e in episodes)
    out = {
        "turns_mean": sum(e.turns for e in episodes) / n,
        "inserted_token_frac": sum(e.sampled_mask.count(False) for e in episodes) / max(1, tokens),
        "environment_seconds": sum(e.reply_seconds for e in episodes),
    }
    for reason in (*STOP_REASONS, *environment.stop_reasons):
        out[f"stop_{reason}_frac"] = sum(e.stop == reason for e in episodes) / n
    # Every batch, rewards given or not (0 for an answer it gave none): ranks reducing these (the held-out
    # evaluation under FSDP) need the same keys whatever their own episodes did.
    out["reward_environment_mean"] = sum(e.reward or 0.0 for e in episodes) / n
    return {**out, **environment.metrics(episodes)}
