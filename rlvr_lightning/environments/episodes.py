"""Multi-turn generation: sample, stop where a segment ends, let the environment reply, append its reply's
token ids, and sample on from there, until each answer ends or hits a limit (`environments.base`).

Token-in/token-out: a completion's ids are exactly the ids the engine sampled, with the ids of each reply the
library tokenized between them (`Completion.sampled` marks which is which); nothing the model wrote is decoded
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
from dataclasses import asdict, dataclass, field, replace
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
    Episodes of a batch generated ahead go into checkpoints as plain values (`to_state`): `calls` as dicts
    where they are dataclasses (the environment's `load_call` rebuilds them), `state` as it is."""

    prompt: list[int]
    question: str = ""  # the problem's prompt text
    answer: str = ""  # its gold answer
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the policy version of each token, where known (async)
    turns: int = 0
    turn_start: int = 0  # where the current turn's tokens begin in `ids` (after the last reply)
    segment: str = ""  # the latest segment's text, ending on the stop string where it hit one
    stopped_at: str | None = None  # the environment's stop string the latest segment ended on
    stop: str | None = None  # why it ended (`Reply.stop`, or the loop's "length" / "max_turns")
    reward: float | None = None  # the environment's reward, when it gave one
    calls: list[Any] = field(default_factory=list)  # what the environment ran for it (the Python tool's calls)
    reply_seconds: float = 0.0  # its share of the wall time its environment took to reply (a batch's, split evenly)
    state: dict[str, Any] = field(default_factory=dict)  # the environment's own notes on it

    def add(self, ids: list[int], logprobs: list[float], sampled: int, versions: list[int] | None = None) -> None:
        self.ids += ids
        self.logprobs += logprobs
        self.sampled += [sampled] * len(ids)
        if versions is not None:
            self.versions += versions

    @property
    def own_ids(self) -> list[int]:
        """The tokens the model sampled, without what the environment inserted."""
        return [t for t, s in zip(self.ids, self.sampled) if s]

    def completion(self, excluded: str = "") -> Completion:
        finish = "length" if self.stop == "length" else "stop"
        sampled = self.sampled if 0 in self.sampled else []
        return Completion(self.ids, self.logprobs, finish, list(self.versions), sampled=sampled, excluded=excluded)

    def to_state(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_state(state: dict[str, Any], environment: Environment) -> Episode:
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
    cap = budget if cap is None else min(cap, budget)
    stops = tuple(environment.stop)
    segment_sampling = replace(sampling, stop=(*sampling.stop, *stops)) if stops else sampling
    if all(not e.ids and not e.turns for e in episodes):  # a fresh batch: its groups, as one request per prompt
        G = sampling.group_size
        prompts = [e.prompt for e in episodes[::G]]
        groups = generate(prompts, replace(segment_sampling, max_tokens=cap))
        active, segments = list(range(len(episodes))), [c for group in groups for c in group]
    else:
        active = [n for n, e in enumerate(episodes) if e.stop is None and len(e.ids) < cap]
        segments = continuations(generate, episodes, active, segment_sampling, cap, turn=0)
    turn = 0
    while active:
        turn += 1
        ended = []  # the episodes whose turn ended (the others stopped at the cap mid-turn)
        for n, segment in zip(active, segments):
            episode = episodes[n]
            before = len(episode.ids) - episode.turn_start  # the turn's tokens from earlier pieces
            keep, text, hit = cut_at_stop(tokenizer, episode.ids[episode.turn_start :] + segment.token_ids, stops)
            keep = max(0, keep - before)  # no stops: the whole segment
            versions = segment.versions[:keep] if segment.versions else None if version is None else [version] * keep
            episode.add(segment.token_ids[:keep], segment.logprobs[:keep], 1, versions)
            at_cap = segment.finish_reason == "length" and hit is None
            if at_cap and cap <= len(episode.ids) < budget:
                continue  # stopped at the cap mid-turn: the turn goes on in a later piece
            episode.turns += 1
            # the kept tokens end on the stop string; the last one may carry a few characters more
            episode.segment = text if hit is None else text[: text.find(hit) + len(hit)]
            episode.stopped_at = hit
            if len(episode.ids) >= budget or at_cap:
                episode.stop = "length"
            ended.append(episode)
        replies = environment_replies(environment, ended) if ended else []
        for episode, reply in zip(ended, replies):
            if episode.stop is not None:
                continue
            if reply.text is None:
                episode.stop, episode.reward = reply.stop, reply.reward
                continue
            output = reply.token_ids(tokenizer)
            room = budget - len(episode.ids)
            inserted = output[:room]
            last = episode.versions[-1] if episode.versions else version
            versions = None if last is None else [last] * len(inserted)
            episode.add(inserted, [0.0] * len(inserted), 0, versions)
            episode.turn_start = len(episode.ids)
            if output and len(output) >= room:
                episode.stop = "length"
            elif episode.turns >= environment.max_turns:
                episode.stop = "max_turns"
        active = [n for n, e in enumerate(episodes) if e.stop is None and len(e.ids) < cap]
        if not active:
            break
        segments = continuations(generate, episodes, active, segment_sampling, cap, turn)


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


def environment_replies(environment: Environment, episodes: list[Episode]) -> list[Reply]:
    """`environment.reply(episodes)`, checked: one `Reply` per episode, and whatever it raises as one line."""
    name = type(environment).__name__
    one_at_a_time = contextlib.nullcontext() if environment.concurrent_replies else _ONE_REPLY_AT_A_TIME
    try:
        with one_at_a_time:
            start = time.perf_counter()
            replies = list(environment.reply(episodes))
            seconds = time.perf_counter() - start
    except Exception as err:
        message = " ".join(str(err).split())
        raise EnvironmentFailed(f"data.environment: {name}.reply raised {type(err).__name__}: {message}") from err
    if len(replies) != len(episodes) or not all(isinstance(r, Reply) for r in replies):
        raise EnvironmentFailed(f"data.environment: {name}.reply must return one Reply per episode "
                                f"({len(episodes)}), got {replies[:3]!r}{'…' if len(replies) > 3 else ''}")  # fmt: skip
    share = seconds / max(1, len(episodes))
    for episode in episodes:
        episode.reply_seconds += share
    return replies


def episode_metrics(episodes: list[Episode], environment: Environment) -> dict[str, float]:
    """A rollout batch's episode metrics (logged under `train/`): why answers stopped (`stop_<reason>_frac`),
    turns per answer, the share of response tokens the environment inserted, the wall time it took to reply
    (`environment_seconds`: beside `time/step`, its share of the step), its mean reward, and the
    environment's own metrics: the same keys for every batch of one environment."""
    n = max(1, len(episodes))
    tokens = sum(len(e.ids) for e in episodes)
    out = {
        "turns_mean": sum(e.turns for e in episodes) / n,
        "inserted_token_frac": sum(e.sampled.count(0) for e in episodes) / max(1, tokens),
        "environment_seconds": sum(e.reply_seconds for e in episodes),
    }
    for reason in (*STOP_REASONS, *environment.stop_reasons):
        out[f"stop_{reason}_frac"] = sum(e.stop == reason for e in episodes) / n
    # Every batch, rewards given or not (0 for an answer it gave none): ranks reducing these (the held-out
    # evaluation under FSDP) need the same keys whatever their own episodes did.
    out["reward_environment_mean"] = sum(e.reward or 0.0 for e in episodes) / n
    return {**out, **environment.metrics(episodes)}
