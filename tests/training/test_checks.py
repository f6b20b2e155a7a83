"""Where each piece's settings are checked and recorded: a piece's own knob check (`check=`) runs wherever
the piece is used, a knob given to a piece that does not read it is refused, the module records every knob
its pieces run with, token-level rollout corrections are refused under losses with one term per
sequence, and an advantage estimator's statistics reach the step's metrics. At fit start: the engine's log-probs of
filtered sampling (top-p/top-k) are refused unless opted in, contradictory settings are clear errors, and an
estimator's knob that does not fit the group size stops the run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlvr_lightning.algos import DAPO, GRPO, GSPO, REAL
from rlvr_lightning.context import Collectives
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.pieces import advantage_estimators, policy_losses
from rlvr_lightning.pieces.kinds import AdvantageInputs, OptimizerStepNorms
from rlvr_lightning.rollout.types import RolloutTensors
from rlvr_lightning.training.batch import LossBatch
from rlvr_lightning.training.objective import compose_objective
from rlvr_lightning.training.settings import BehaviourSettings
from tests.support.settings import checked
from tests.support.update_harness import G, attach


# ---- a piece's own knob check ------------------------------------------------------------------
def test_a_group_level_loss_checks_tau_whichever_algorithm_selects_it():
    with pytest.raises(ConfigError, match=r"^model.policy_loss=real-anchor: tau must be > 0, got 0 \[tau=0 \(given\)\]$"):
        GRPO(policy_loss={"name": "real-anchor", "knobs": {"tau": 0}}, advantage_estimator="none")
    with pytest.raises(ConfigError, match=r"tau must be > 0, got -1.0 \[tau=-1.0 \(given\)\]"):
        REAL(policy_loss={"name": "real-anchor", "knobs": {"tau": -1.0}})
    REAL(policy_loss="ppo-clip", advantage_estimator="grpo")  # REAL's τ is its loss's knob: gone with its loss


def test_ratio_and_log_ratio_clip_ranges_are_checked_by_the_loss_that_reads_them():
    with pytest.raises(ConfigError, match=r"model.policy_loss=ppo-clip: the ratio's clip range needs 0 ≤ clip_eps_low ≤ 1"):
        GRPO(policy_loss={"name": "ppo-clip", "knobs": {"clip_eps_low": 1.2}})
    GRPO(policy_loss={"name": "gmpo", "knobs": {"clip_eps_low": 1.2}})  # GMPO's band is in log space: e^−1.2 is valid
    with pytest.raises(ConfigError, match=r"model.policy_loss=gmpo: the log-ratio's clip range"):
        GRPO(policy_loss={"name": "gmpo", "knobs": {"clip_eps_low": -0.1}})
    with pytest.raises(ConfigError, match=r"^model.policy_loss=sapo does not read the knob 'clip_eps_low'"):
        GRPO(policy_loss={"name": "sapo", "knobs": {"clip_eps_low": 5.0}})  # SAPO reads no clip range
    with pytest.raises(ConfigError, match="sapo_tau_neg=0"):
        GRPO(policy_loss={"name": "sapo", "knobs": {"sapo_tau_neg": 0}})


def test_a_check_that_needs_the_group_size_runs_at_fit_start_with_the_runs_value():
    GRPO(advantage_estimator={"name": "pass-at-k", "knobs": {"pass_at_k": 9}})  # G is not known yet
    piece = advantage_estimators.get("pass-at-k")
    piece.check_knobs({"pass_at_k": 8}, run={"group_size": 8})
    with pytest.raises(ConfigError, match=r"pass_at_k=9 \(given\), group_size=8 \(the run\)"):
        piece.check_knobs({"pass_at_k": 9}, run={"group_size": 8})
    with pytest.raises(ConfigError, match=r"pass_at_k=4 \(its default\), group_size=2 \(the run\)"):
        piece.check_knobs({}, run={"group_size": 2})


def test_a_users_piece_declares_its_own_check():
    def check_scale(*, scale: float) -> None:
        if scale <= 0:
            raise ValueError(f"scale must be > 0, got {scale}")

    @advantage_estimators.register("test-scaled-grpo", anchor=None, check=check_scale)
    def scaled(inputs: AdvantageInputs, *, scale: float = 1.0) -> torch.Tensor:
        return inputs.rewards * scale

    try:
        assert advantage_estimators.get("test-scaled-grpo").knobs == ("scale",)
        GRPO(advantage_estimator={"name": "test-scaled-grpo", "knobs": {"scale": 2.0}})
        with pytest.raises(ConfigError, match=r"^model.advantage_estimator=test-scaled-grpo: scale must be > 0, got -2"):
            GRPO(advantage_estimator={"name": "test-scaled-grpo", "knobs": {"scale": -2.0}})
    finally:
        advantage_estimators._pieces.pop("test-scaled-grpo")


# ---- a knob the piece does not read: refused; every knob recorded ----------------------------
def test_a_misspelt_knob_is_refused_listing_the_knobs_its_piece_reads():
    """(Was: a misspelt piece_args key, refused listing the selected pieces' knobs.)"""
    with pytest.raises(ConfigError, match=r"^model.advantage_estimator=pass-at-k does not read the knob 'pass_at_kk'; "
                                          r"its knobs: pass_at_k \(set them with --model.init_args.advantage_estimator"
                                          r".knobs.<knob>; [^\n]*\)$"):  # fmt: skip
        GRPO(advantage_estimator={"name": "pass-at-k", "knobs": {"pass_at_kk": 2}})
    with pytest.raises(ConfigError, match=r"^model.policy_loss=sapo does not read the knob 'sapo_tau_ne'; its knobs: "
                                          r"sapo_tau_pos, sapo_tau_neg \("):  # fmt: skip
        GRPO(policy_loss={"name": "sapo", "knobs": {"sapo_tau_ne": 1.1}})


def test_a_knob_of_another_piece_is_one_error_line_naming_the_piece_given_it():
    """A knob given to a piece that does not read it is refused, even where another piece of the algorithm reads
    it: nothing feeds a knob but its own piece's section. (Was: piece_args.clip_eps_high refused as an argument of
    the algorithm.)"""
    with pytest.raises(ConfigError, match=r"^model.loss_agg=seq-mean-token-mean does not read the knob 'clip_eps_high'; "
                                          r"its knobs: none \("):  # fmt: skip
        GRPO(loss_agg={"name": "seq-mean-token-mean", "knobs": {"clip_eps_high": 0.28}})
    with pytest.raises(ConfigError, match=r"^model.policy_loss=ppo-clip does not read the knob 'tau'; its knobs: "
                                          r"clip_eps_low, clip_eps_high, dual_clip_c \([^\n]*\)$"):  # fmt: skip
        REAL(policy_loss={"name": "ppo-clip", "knobs": {"tau": 0.5}}, advantage_estimator="grpo")


@pytest.mark.parametrize("loss", ["cispo", "dppo-tv", "dppo-kl", "sapo", "gmpo", "clip-cov"])
def test_a_knob_no_selected_piece_reads_is_refused(loss):
    """dual_clip_c (dual-clip PPO's c) given to a loss that has no dual clip would change nothing."""
    GRPO(policy_loss=loss)
    with pytest.raises(ConfigError, match=rf"^model.policy_loss={loss} does not read the knob 'dual_clip_c'; its knobs: "):
        GRPO(policy_loss={"name": loss, "knobs": {"dual_clip_c": 3.0}})
    GRPO(policy_loss={"name": "ppo-clip", "knobs": {"dual_clip_c": 3.0}})


def test_a_choice_with_other_keys_than_name_and_knobs_is_refused():
    with pytest.raises(ConfigError, match=r"^model.policy_loss takes \{name: <piece>, knobs: \{<knob>: <value>\}\}"):
        GRPO(policy_loss={"name": "ppo-clip", "clip_eps_high": 0.28})


def test_the_path_from_config_to_loss_needs_no_name_matching():
    """The loss's knobs come from its own choice: the bound partial carries clip_eps_high=0.3 while the module has
    no argument of that name (nor of the loss's other knobs), and another kind's knobs never reach it."""
    import inspect

    module = GRPO(policy_loss={"name": "ppo-clip", "knobs": {"clip_eps_high": 0.3}})
    loss = module.settings.pieces.objective.loss
    assert loss.func is policy_losses.get("ppo-clip").fn
    assert loss.keywords == {"clip_eps_low": 0.2, "clip_eps_high": 0.3, "dual_clip_c": None}
    for cls in type(module).__mro__:
        if "__init__" in cls.__dict__:
            params = inspect.signature(cls.__dict__["__init__"]).parameters
            assert not {"clip_eps_low", "clip_eps_high", "dual_clip_c", "tis_cap", "tau", "piece_args"} & set(params), cls
    assert "clip_eps_high" not in module.settings.args and "clip_eps_high" not in module.hparams
    with pytest.raises(TypeError, match="clip_eps_high"):
        GRPO(clip_eps_high=0.3)


def test_the_module_records_every_knob_its_pieces_run_with_defaults_included():
    def knobs(module) -> dict:
        return {kind: module.hparams[kind] for kind in ("advantage_estimator", "policy_loss", "rollout_correction")}

    assert knobs(GRPO(rollout_correction="none")) == {
        "advantage_estimator": {"name": "grpo", "knobs": {}},
        "policy_loss": {"name": "ppo-clip", "knobs": {"clip_eps_low": 0.2, "clip_eps_high": 0.2, "dual_clip_c": None}},
        "rollout_correction": {"name": "none", "knobs": {}}}  # fmt: skip
    assert GRPO(advantage_estimator="pass-at-k").hparams.advantage_estimator == {"name": "pass-at-k", "knobs": {"pass_at_k": 4}}
    assert GRPO(policy_loss={"name": "sapo", "knobs": {"sapo_tau_pos": 2.0}}).hparams.policy_loss == {
        "name": "sapo", "knobs": {"sapo_tau_pos": 2.0, "sapo_tau_neg": 1.05}}  # fmt: skip
    recorded = GRPO(policy_loss="clip-cov", rollout_correction="icepop").hparams
    assert recorded.policy_loss["knobs"] == {"clip_eps_low": 0.2, "clip_eps_high": 0.2, "clip_cov_ratio": 2e-4,
                                            "clip_cov_lb": 1.0, "clip_cov_ub": 5.0}  # fmt: skip
    assert recorded.rollout_correction == {"name": "icepop", "knobs": {"is_mask_low": 0.5, "is_mask_high": 5.0}}
    assert "piece_args" not in recorded
    assert all(type(recorded[k]["name"]) is str for k in ("policy_loss", "rollout_correction"))  # plain, for pickles


def test_the_recorded_knobs_are_the_runs_mlflow_params():
    from rlvr_lightning.cli.config_logging import logged_params

    params = logged_params({"trainer": {"max_steps": 3}}, GRPO(advantage_estimator="pass-at-k"))
    assert params["model.init_args.advantage_estimator.knobs.pass_at_k"] == 4
    assert params["model.init_args.policy_loss.name"] == "ppo-clip"
    assert params["model.init_args.policy_loss.knobs.clip_eps_high"] == 0.2


# ---- token-level rollout corrections under losses with one term per sequence -------------------
def one_sequence(weights: list[float], logp: torch.Tensor) -> tuple[LossBatch, OptimizerStepNorms]:
    T = len(weights)
    ones = torch.ones(1, T)
    ids = torch.zeros(1, 1 + T, dtype=torch.long)  # the loss reads none of these: one prompt token, T response tokens
    tensors = RolloutTensors(ids, torch.ones_like(ids), torch.arange(1 + T)[None], ones, torch.zeros(1, T), 1, ones)
    batch = LossBatch(tensors, ones.clone(), logp.detach().clone(), None, ones, torch.tensor([weights]), torch.ones(1), 1)
    return batch, OptimizerStepNorms(1.0, float(T), 1.0, 0.0, 1, float(T))


@pytest.mark.parametrize("loss", ["ppo-clip", "gspo-token"])
def test_a_dropped_token_gets_no_gradient_from_per_token_losses(loss):
    """One sequence of 3 tokens, Â = 1, on policy, weights (2, 0, 1), seq-mean-token-mean: ∂L/∂log π = −w/3."""
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.125]])).requires_grad_()
    batch, norms = one_sequence([2.0, 0.0, 1.0], logp)
    objective = compose_objective({"policy_loss": loss, "loss_agg": "seq-mean-token-mean", "kl_coef": 0.0,
                                   "kl_estimator": "k3"})  # fmt: skip
    value, _ = objective.micro_batch_loss(batch, logp, norms, on_policy=True)
    value.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-2 / 3, 0.0, -1 / 3]]))


@pytest.mark.parametrize("loss", ["gspo", "gmpo"])
@pytest.mark.parametrize("correction", ["tis-token", "mis-token", "icepop"])
def test_token_level_corrections_are_refused_under_a_sequence_term_loss(loss, correction):
    assert not policy_losses.get(loss)["token_weights"]
    with pytest.raises(ConfigError, match=rf"^model.rollout_correction={correction} weighs each token, but model.policy_loss="
                                          rf"{loss} .*: use a sequence-level correction \(tis-sequence.*\) or a per-token loss"):  # fmt: skip
        GRPO(policy_loss=loss, rollout_correction=correction)


@pytest.mark.parametrize("loss", ["gspo", "gmpo"])
def test_sequence_level_corrections_weigh_a_sequence_term_whole(loss):
    """A sequence-level weight is the same on every token: it scales the sequence's term, as it should."""
    GRPO(policy_loss=loss, rollout_correction="tis-sequence")
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.125]])).requires_grad_()
    objective = compose_objective({"policy_loss": loss, "loss_agg": "seq-mean-token-mean", "kl_coef": 0.0,
                                   "kl_estimator": "k3"})  # fmt: skip
    grads = []
    for w in (1.0, 0.5):
        batch, norms = one_sequence([w] * 3, logp)
        logp.grad = None
        objective.micro_batch_loss(batch, logp, norms, on_policy=True)[0].backward()
        grads.append(logp.grad.clone())
    torch.testing.assert_close(grads[1], 0.5 * grads[0])
    assert grads[0].abs().sum() > 0


# ---- the advantage estimator's statistics --------------------------------------------------------
def test_advantage_statistics_and_an_estimators_own_reach_the_steps_metrics():
    @advantage_estimators.register("test-with-stats", anchor=None)
    def with_stats(inputs: AdvantageInputs) -> tuple[torch.Tensor, dict[str, float]]:
        adv = inputs.rewards - 0.5
        return adv, {"adv_positive_frac": (adv > 0).float().mean()}

    try:
        module = GRPO(advantage_estimator="test-with-stats")
        rewards = torch.tensor([1.0, 0.0, 0.5, 0.5])
        rollout = SimpleNamespace(correct=rewards > 0.5, group_size=2, response_lengths=torch.ones(4, dtype=torch.long))
        adv, _, stats = module.settings.pieces.advantages(AdvantageInputs(rewards, rollout.correct, rollout.group_size, Collectives().sum, rollout.response_lengths))
        torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.0, 0.0]))
        assert stats == pytest.approx({"adv_mean": 0.0, "adv_std": (1 / 6) ** 0.5, "adv_abs_max": 0.5,
                                       "adv_zero_frac": 0.5, "adv_positive_frac": 0.25})  # fmt: skip
    finally:
        advantage_estimators._pieces.pop("test-with-stats")


def test_fit_start_checks_never_call_a_piece_on_inputs_training_never_gives(tiny_policy_dir):
    """An estimator that reads `lengths` (always given in training) passes the fit-start checks: they run the
    pieces' own checks, not the pieces on dummy tensors."""
    from tests.support.update_harness import attach

    @advantage_estimators.register("test-length-scaled", anchor=None)
    def length_scaled(inputs: AdvantageInputs) -> torch.Tensor:
        return inputs.rewards / inputs.lengths.float()

    try:
        checked(attach(GRPO, tiny_policy_dir, advantage_estimator="test-length-scaled"))
    finally:
        advantage_estimators._pieces.pop("test-length-scaled")


@pytest.mark.parametrize(
    "model_kwargs,rollout_kwargs,ok",
    [
        ({"rollout_correction": "tis-token"}, {"top_p": 0.9}, False),
        ({"rollout_correction": "tis-sequence"}, {"top_k": 20}, False),
        ({"behaviour": BehaviourSettings(logprobs="rollout")}, {"top_p": 0.95}, False),
        ({"rollout_correction": "tis-token", "behaviour": BehaviourSettings(allow_filtered_rollout_logprobs=True)}, {"top_p": 0.9}, True),
        ({}, {"top_p": 0.9}, True),  # θ_old from the trainer: the engine's log-probs are only logged
        ({"rollout_correction": "tis-token"}, {}, True),
        ({}, {"top_p": 0.9, "engine": "vllm-server", "stream": {"max_staleness": 1}}, False),  # θ_old from the engine
    ],
)
def test_filtered_sampling_with_rollout_logprobs_is_refused_unless_opted_in(
    tiny_policy_dir, model_kwargs, rollout_kwargs, ok
):
    module = attach(GRPO, tiny_policy_dir, rollout_kwargs, **model_kwargs)
    if ok:
        checked(module)
    else:
        with pytest.raises(ConfigError, match="allow_filtered_rollout_logprobs"):
            checked(module)


def test_contradictory_or_invalid_settings_are_clear_errors():
    with pytest.raises(ConfigError, match="every weight is 1"):
        GRPO(rollout_correction="tis-token", behaviour=BehaviourSettings(logprobs="rollout"))
    with pytest.raises(ConfigError, match="registered: ppo-clip, gspo-token, gspo, "):
        GRPO(policy_loss="ppo")
    with pytest.raises(ConfigError, match="re-weights token-level losses"):
        GRPO(policy_loss="real-anchor", rollout_correction="tis-token")
    with pytest.raises(ConfigError, match="two_pass is for group-level"):
        REAL(policy_loss="ppo-clip", advantage_estimator="grpo", two_pass=True)
    with pytest.raises(ConfigError, match="valid: error, train_partial"):
        DAPO(on_exhausted="skip")
    assert GSPO(policy_loss="gspo-token").settings.pieces.objective.policy_loss.name == "gspo-token"
    assert GSPO().settings.pieces.objective.policy_loss.name == "gspo"


def test_an_estimator_knob_that_does_not_fit_the_group_size_stops_the_run_at_fit_start(tiny_policy_dir):
    module = attach(GRPO, tiny_policy_dir, advantage_estimator={"name": "pass-at-k", "knobs": {"pass_at_k": G + 1}})
    with pytest.raises(ConfigError, match=rf"pass_at_k must lie in \[1, rollout.group_size={G}\], got {G + 1}"):
        checked(module)
    checked(attach(GRPO, tiny_policy_dir, advantage_estimator={"name": "pass-at-k", "knobs": {"pass_at_k": G}}))
