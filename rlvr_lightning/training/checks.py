"""Configuration checks of an algorithm's settings, run before anything expensive starts: which
pieces combine (at construction), and what needs the data and rollout settings and callbacks too (at fit start).
Each failure is a `ConfigError` that names the options and what would work."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlvr_lightning.errors import ConfigError
from rlvr_lightning.pieces import advantage_estimators, policy_losses, rollout_corrections
from rlvr_lightning.pieces.registry import Piece
from rlvr_lightning.pieces.selection import selected_pieces
from rlvr_lightning.training.layout import UpdateLayout
from rlvr_lightning.training.objective import Objective


def check_pieces(h: Mapping[str, Any], objective: Objective, correction: Piece, proximal: Piece | None = None) -> None:
    """Which pieces combine; each piece's own knobs were checked when it was bound (its `check`)."""
    loss = objective.policy_loss
    corrects_rollouts = correction.name != "none"
    if proximal is not None and not proximal["forward"]:
        if not corrects_rollouts:
            raise ConfigError(
                f"model.proximal_policy={proximal.name} approximates decoupled PPO's proximal policy, which a rollout "
                "correction weighs against the behaviour policy: set model.rollout_correction (tis-token, icepop, …)"
            )
        if objective.two_pass or objective.reads_step_first:
            raise ConfigError(
                f"model.proximal_policy={proximal.name} is read in each micro-batch's forward; {loss.name} needs θ_old "
                "before the step's first forward: use model.proximal_policy=recompute"
            )
    if objective.group_level and corrects_rollouts:
        raise ConfigError(
            f"model.rollout_correction={h['rollout_correction']} re-weights token-level losses; "
            f"model.policy_loss={loss.name} is group level (sequence logits): use rollout_correction=none"
        )
    if correction["level"] == "token" and not loss["token_weights"]:
        sequence_level = ", ".join(p.name for p in rollout_corrections.pieces() if p["level"] == "sequence")
        raise ConfigError(
            f"model.rollout_correction={correction.name} weighs each token, but model.policy_loss={loss.name} writes one "
            f"term per sequence on all its tokens, so a token's weight would reach the whole sequence: use a "
            f"sequence-level correction ({sequence_level}) or a per-token loss (gspo-token, ppo-clip)"
        )
    if objective.two_pass and not objective.group_level:
        raise ConfigError(f"model.two_pass is for group-level policy losses (REAL's); {loss.name} is token level")


def check_behaviour(logprobs: str, corrects_rollouts: bool, proximal: Piece) -> None:
    """Which behaviour sources the pieces combine with (`logprobs`: `model.behaviour.logprobs`)."""
    if logprobs != "rollout":
        return
    if not proximal["forward"]:
        raise ConfigError(
            f"model.proximal_policy={proximal.name} weighs the trainer's θ_old against the engine's log-probs: "
            "keep model.behaviour.logprobs=trainer"
        )
    if corrects_rollouts:
        raise ConfigError(
            "model.rollout_correction corrects θ_old (trainer) against the rollout engine; with "
            "model.behaviour.logprobs=rollout both are the engine's and every weight is 1. Use one or the other."
        )


def check_teacher(args: Mapping[str, Any], teacher: Any) -> None:
    """A teacher (`training.teacher.TeacherSettings`, or None) is given exactly when the advantage estimator reads
    one, and the policy loss then takes the token advantages it returns."""
    estimator = advantage_estimators.selected(args)
    if teacher is not None:
        teacher.check()
    if estimator["teacher"] and teacher is None:
        raise ConfigError(
            f"{estimator.what} distils a teacher: set --model.init_args.teacher.model_name_or_path (a model with the "
            "student's vocabulary)"
        )
    if teacher is not None and not estimator["teacher"]:
        raise ConfigError(
            f"model.teacher is set but {estimator.what} does not read a teacher (use model.advantage_estimator=opd, "
            "or drop model.teacher)"
        )
    loss = policy_losses.selected(args)
    if estimator["teacher"] and not loss["token_advantages"]:
        raise ConfigError(f"{estimator.what} gives each token its own advantage, which {loss.what} does not read")


def check_run(
    h: Mapping[str, Any],
    batch_size: int,
    rollout: Any,
    objective: Objective,
    layout: UpdateLayout,
    shapers: list[str],
    corrects_rollouts: bool,
    max_staleness: int,
    behaviour: Any,
) -> None:
    """`batch_size`: prompts per rollout batch; `rollout`: the `rollout:` section (`RolloutSettings`);
    `shapers`: the names of the advantage shapers; `behaviour`: `model.behaviour` (`BehaviourSettings`)."""
    G = rollout.group_size
    run = {"group_size": G, "max_response_length": rollout.max_response_length}
    for piece, knobs in selected_pieces(h).values():  # the checks that need the run's settings (pass@k's k ≤ G)
        piece.check_knobs(knobs, run)
    if batch_size % h["num_mini_batches"]:
        raise ConfigError(
            f"data.batch_size={batch_size} prompts must divide into model.num_mini_batches="
            f"{h['num_mini_batches']} mini-batches of whole groups"
        )
    check_behaviour_logprobs(h, behaviour, rollout, corrects_rollouts, max_staleness)
    if objective.needs_whole_groups and not layout.keeps_groups_whole(G):
        raise ConfigError(
            f"model.policy_loss={h['policy_loss']} couples the {G} rollouts of a group, but model.compute.micro_batch_size="
            f"{layout.micro_batch_size} would split groups: use a multiple of rollout.group_size={G}, or model.two_pass=true"
        )
    if shapers and advantage_estimators.selected(h)["teacher"]:
        raise ConfigError(
            f"{', '.join(shapers)} with model.advantage_estimator={h['advantage_estimator']}: the shapers reweigh a "
            "sequence's advantage over its tokens, and distillation gives each token its own"
        )
    if shapers and not objective.policy_loss["token_advantages"]:
        raise ConfigError(
            f"{', '.join(shapers)} reshape(s) token advantages, but model.policy_loss={h['policy_loss']} does not "
            f"honour them ({objective.policy_loss.summary}); use a token-level loss such as gspo-token or ppo-clip"
        )


def check_behaviour_logprobs(
    h: Mapping[str, Any], behaviour: Any, rollout: Any, corrects_rollouts: bool, max_staleness: int
) -> None:
    distils = advantage_estimators.selected(h)["teacher"]
    uses_engine = corrects_rollouts or behaviour.logprobs == "rollout" or max_staleness > 0 or distils
    if rollout.samples_truncated_distribution and uses_engine and not behaviour.allow_filtered_rollout_logprobs:
        what = (
            f"model.advantage_estimator={h['advantage_estimator']} (the student's side of its reverse KL)"
            if distils
            else f"model.rollout_correction={h['rollout_correction']}"
            if corrects_rollouts
            else "model.behaviour.logprobs=rollout"
            if behaviour.logprobs == "rollout"
            else f"rollout.stream.max_staleness={max_staleness}"
        )
        raise ConfigError(
            f"{what} uses the rollout engine's log-probs as the behaviour policy, but rollout.top_p={rollout.top_p} / "
            f"rollout.top_k={rollout.top_k} sample from a truncated distribution whose log-probs are not the "
            "policy's. Sample with top_p=1 and top_k=-1, or set model.behaviour.allow_filtered_rollout_logprobs=true "
            "to accept the bias."
        )


def check_environment(name: str, shapers: tuple[str, ...]) -> None:
    """A run in an environment (`name`: data.tool, data.environment) with advantage shapers that would weigh the
    inserted tokens, refused before it starts."""
    if shapers:
        raise ConfigError(
            f"{name} with {', '.join(shapers)}: it does not leave the inserted tokens out of its weights' "
            "normalisation (THR and OAR do: see AdvantageShaper.weighs_sampled_tokens_only)"
        )


def check_sharded_shapers(shapers: tuple[str, ...]) -> None:
    """Shapers whose policy forwards differ between ranks (OAR's), refused on a policy sharded over several ranks,
    where every forward is a collective and unequal counts would deadlock."""
    if shapers:
        raise ConfigError(
            f"{', '.join(shapers)} does not support a policy sharded over several ranks (FSDP) yet: its number of "
            "scoring forwards differs between ranks; use one rank or DDP"
        )
