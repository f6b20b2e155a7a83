"""What an environment is: the part that answers the model between the segments of one answer.

An answer is sampled in segments. A segment ends where the model ends its answer (EOS, a stop string of the
sampling settings), where it writes one of the environment's `stop` strings (a tool call's closing marker), or
at the response budget. After each, the environment sees the episodes (`environments.episodes.Episode`: the
problem, the latest segment's text, the turns so far, its calls and notes so far) and replies to each: with text
to append, whose tokens are context only (no loss, no KL, no entropy; they count against the budget), after
which the model goes on; or with the end of the episode, why it ended and, if it gives one, the episode's
reward (logged as `train/reward_environment_mean`, added to the verifier's correctness as a reward term).
An environment writes nothing into an episode: what it ran and its notes come back in the `Reply`, and the
episode loop keeps them.

A user's environment is a subclass in the user's own module, chosen by dotted path:

    --data.environment my_envs.SecondChance --data.environment.init_args.attempts 2

The Python tool (`python_tool.PythonTool`, set with `--data.tool.*`) is the built-in one; without either,
an answer is one segment scored by the verifier alone, as it always was.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlvr_lightning.environments.episodes import Episode


class EnvironmentFailed(RuntimeError):
    """An environment's `reply` raised or answered wrongly: one line naming it (the run resumes from its last
    checkpoint once the environment is mended)."""


@dataclass(frozen=True)
class Reply:
    """The environment's answer to an episode's latest segment: `text` to append and sample on from (""
    samples on with nothing appended), or `text=None`: the episode ends, for `stop` (logged as
    `train/stop_<stop>_frac`), with `reward` when the environment gives one.

    `data`: the span [start, end) of `text` that is data rather than the environment's own words (a tool's
    output, anything the model's code or an outside source wrote). Its text is encoded as plain text: a
    chat template's control tokens spelt there (`<|im_end|>`) stay characters and never become the tokens
    themselves; the rest of `text` is encoded as the tokenizer reads it (a turn of the environment's may use
    them).

    `calls`: what the environment ran for this turn (the Python tool's `ToolCall`), appended to `Episode.calls`;
    `notes`: entries the loop sets in `Episode.state`, the environment's own notes on the episode (its void turns
    so far). Both are kept whether or not the episode goes on."""

    text: str | None = None
    stop: str = "answered"
    reward: float | None = None
    data: tuple[int, int] | None = None
    calls: tuple[Any, ...] = ()
    notes: Mapping[str, Any] = field(default_factory=dict)

    def token_ids(self, tokenizer) -> list[int]:
        """The ids appended for `text`: the environment's words as the tokenizer reads them, `data` with no
        special token (the tokenizer's `split_special_tokens`)."""
        if not self.text:
            return []
        start, end = self.data if self.data is not None else (len(self.text), len(self.text))
        pieces = ((self.text[:start], False), (self.text[start:end], True), (self.text[end:], False))
        return [
            i
            for piece, as_data in pieces
            if piece
            for i in tokenizer(piece, add_special_tokens=False, split_special_tokens=as_data).input_ids
        ]


class Environment:
    """Override `reply`; `stop`, `max_turns`, `stop_reasons`, `metrics`, `excluded` and `close` as needed.

    stop: strings that end a segment for a reply (an engine that samples past one is cut where it completes).
    max_turns: segments per answer; an episode still going after that many ends (`stop: max_turns`).
    stop_reasons: the `Reply.stop` values it may give besides "answered", logged every batch (as 0 when unseen).
    concurrent_replies: `reply` may run in several threads at once (batches generated side by side: replicas,
        the rollout stream); False: the loop calls it for one batch at a time.
    """

    stop: tuple[str, ...] = ()
    max_turns: int = 8
    stop_reasons: tuple[str, ...] = ()
    concurrent_replies: bool = False

    def reply(self, episodes: Sequence[Episode]) -> list[Reply]:
        """One reply per episode, in order. An episode whose budget is spent already has `stop` set: it is
        shown so that the environment sees every segment, and what is replied to it is not appended."""
        raise NotImplementedError(f"{type(self).__name__}.reply")

    def metrics(self, episodes: Sequence[Episode]) -> dict[str, float]:
        """The environment's own metrics of a rollout batch's finished episodes (logged under `train/`)."""
        return {}

    def excluded(self, episode: Episode) -> str:
        """Why a finished episode stays out of the loss (a stability guard), or ""."""
        return ""

    def load_call(self, saved: dict) -> Any:
        """One of `Episode.calls` as a checkpoint saved it (a batch generated ahead of the trainer: a dataclass
        is saved as a dict of its fields), rebuilt; by default as saved."""
        return saved

    def close(self) -> None:
        """Release what it holds (workers, processes)."""
