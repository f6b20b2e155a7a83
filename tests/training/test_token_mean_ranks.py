"""Global loss normalisers across ranks whose response-token counts differ
(docs/algorithms.md#loss-aggregation): two CPU ranks (gloo, spawned) take one optimizer step each on
their own prompts; after DDP's gradient averaging the gradient must equal the single-process gradient
over the union of both ranks' sequences. It does only because the step's counts (T_S for token-mean,
N_S, and REAL's B and M) are summed over the ranks (`training.batch.optimizer_step_norms`, one all-reduce through
the strategy's `reduce`) and each rank's loss is multiplied by the world size.

The update is the real one (`PolicyUpdate.accumulate_gradients`: micro-batches, the agreed micro-batch
count under token budgets, `optimizer_step_norms`, `policy_forward`, and the objective the module itself
composes from the registered pieces, `compose_objective`: PPO-clip and each aggregator, or REAL's
losses with their normalisers). The policy is a constructed tiny causal LM, so the spawned ranks
import neither Lightning nor transformers and the test takes seconds on an idle machine."""

from __future__ import annotations

import functools
import queue
import socket
import traceback
from types import SimpleNamespace

import pytest
import torch
import torch.distributed

from rlvr_lightning.context import Collectives, StepContext
from rlvr_lightning.models.forward import policy_forward
from rlvr_lightning.pieces import policy_losses
from rlvr_lightning.pieces.advantages import group_advantage
from rlvr_lightning.pieces.covariance import kl_cov_selection
from rlvr_lightning.pieces.kinds import TokenSelectionInputs
from rlvr_lightning.rollout.types import Completion, PromptBatch, Rollout, SamplingConfig
from rlvr_lightning.seeding import keyed_uniform
from rlvr_lightning.training.batch import UpdateInputs
from rlvr_lightning.training.behaviour import Precomputed
from rlvr_lightning.training.layout import UpdateLayout
from rlvr_lightning.training.objective import compose_objective
from rlvr_lightning.training.update import NonFiniteGuard, PolicyUpdate

G, MAX_LEN, VOCAB, WORLD = 4, 8, 16, 2
EPS_LOW, EPS_HIGH = 0.2, 0.28  # DAPO's clip-higher
PROMPTS = ([[1, 2, 3], [4, 5]], [[6, 7, 8, 9], [10, 11]])  # two prompts per rank
LENGTHS = ((1, 2, 1, 3, 2, 1, 1, 1), (8, 7, 8, 6, 5, 8, 7, 8))  # rank 0: 12 response tokens, rank 1: 57
CORRECT = ((1, 0, 0, 0, 0, 1, 1, 0), (1, 1, 0, 0, 0, 0, 0, 0))  # rank 1's 2nd group: Â ≡ 0, yet counts in T_S
AGGREGATORS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# REAL: normaliser B (prompts) or M (rollouts in mixed groups). Clip-Cov, KL-Cov: token selections over
# the step (global means and counts, KL-Cov's global top share, Clip-Cov's draws keyed by global sequence).
SELECTIONS = {"clip-cov": {"clip_cov_ratio": 0.3, "clip_cov_lb": 0.0, "clip_cov_ub": 100.0}, "kl-cov": {"kl_cov_ratio": 0.1}}
LOSSES = AGGREGATORS + ("real-anchor", "real-bce", *SELECTIONS)
LAYOUTS = (None, 24)  # micro-batches of 3 rows; token budgets of 24 (rank 0 needs fewer: the count is agreed)


class TinyCausalLM(torch.nn.Module):
    """state_t = tanh(W·Σ_{s≤t} e(x_s)) over the attended tokens, logits = H·state_t: causal, and blind to
    padding, so a sequence's log-probs do not depend on the batch it is laid out in."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(VOCAB, 6, generator=g))
        self.mix = torch.nn.Parameter(torch.randn(6, 6, generator=g) / 6**0.5)
        self.head = torch.nn.Parameter(torch.randn(VOCAB, 6, generator=g))

    def forward(self, input_ids, attention_mask, logits_to_keep=0, **_):
        x = self.embed[input_ids] * attention_mask[..., None]
        logits = torch.tanh(x.cumsum(1) @ self.mix.T) @ self.head.T
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


def rank_update(world_size: int, reduce, loss: str, max_tokens: int | None) -> tuple[PolicyUpdate, StepContext]:
    """The update a module with these settings runs (GRPO's PPO-clip with DAPO's clip-higher and the
    aggregator `loss`, REAL's loss `loss` on micro-batches of whole groups, or a loss with a token
    selection, Clip-Cov or KL-Cov), and its step context."""
    real, own_loss = loss.startswith("real-"), loss not in AGGREGATORS
    name = loss if own_loss else "ppo-clip"
    clip = {"clip_eps_low": EPS_LOW, "clip_eps_high": EPS_HIGH} if "clip_eps_low" in policy_losses.get(name).knobs else {}
    values = {"policy_loss": {"name": name, "knobs": {**clip, **SELECTIONS.get(loss, {})}},
              "loss_agg": "token-mean" if own_loss else loss, "kl_estimator": "k3", "kl_coef": 0.0}  # fmt: skip
    plan = UpdateLayout(1, 1, G if real else 3, max_tokens, 0, 1.0, float(MAX_LEN))
    rank = torch.distributed.get_rank() if world_size > 1 else 0
    step = StepContext(
        policy=TinyCausalLM(), ref_policy=None, engines=SimpleNamespace(engine=None), tokenizer=None, prompts=None,
        sampling=SamplingConfig, collectives=Collectives(world_size, rank, reduce), device=torch.device("cpu"), rollout_batch=0,
        policy_version=0, total_rollout_batches=1, seed=0,
    )  # fmt: skip
    return PolicyUpdate(compose_objective(values), plan, NonFiniteGuard(1)), step


def rank_rollout(rank: int) -> Rollout:
    g = torch.Generator().manual_seed(rank)
    completions = [
        Completion(torch.randint(1, VOCAB, (L,), generator=g).tolist(), [0.0] * L, "stop") for L in LENGTHS[rank]
    ]
    correct = torch.tensor(CORRECT[rank], dtype=torch.float32)
    return Rollout(
        batch=PromptBatch([f"r{rank}p0", f"r{rank}p1"], ["", ""], ["1", "2"]), group_size=G, prompt_ids=PROMPTS[rank],
        completions=completions, sampling=SamplingConfig(group_size=G, max_tokens=MAX_LEN), policy_version=0,
        correct=correct,
    )  # fmt: skip


def old_offset(rank: int) -> torch.Tensor:
    """log π_old − log π_θ of each of the rank's response tokens: off policy, so the clip matters."""
    return 0.3 * torch.randn(len(LENGTHS[rank]), MAX_LEN, generator=torch.Generator().manual_seed(100 + rank))


def update_inputs(policy: torch.nn.Module, rollout: Rollout, offset: torch.Tensor) -> UpdateInputs:
    t = rollout.tensors(pad_id=0)
    with torch.no_grad():
        logp = policy_forward(policy, t, 1.0).logp
    mask = t.response_mask
    advantages = group_advantage(rollout.correct, G)[:, None] * mask
    old = logp + offset[:, : mask.shape[1]] * mask
    return UpdateInputs(t, advantages, None, mask, None, rollout.correct, G, 1.0, Precomputed(old, "trainer"))


def step(rollout: Rollout, offset: torch.Tensor, world_size: int, reduce, loss: str, max_tokens: int | None):
    """One optimizer step's loss on this rank and its gradient after DDP's averaging over the ranks."""
    update, context = rank_update(world_size, reduce, loss, max_tokens)
    inputs = update_inputs(context.policy, rollout, offset)
    loss = update.accumulate_gradients(context, inputs, torch.arange(rollout.num_sequences), torch.Tensor.backward)
    grad = torch.cat([p.grad.flatten() for p in context.policy.parameters()])
    if world_size > 1:
        import torch.distributed as dist

        dist.all_reduce(grad)
        grad /= world_size
    return loss.item(), grad


TOP = ((5, 0), (6, 2), (7, 1))  # case "ties everywhere": the three tokens of highest covariance, all on rank 1


def tied_selection(rank: int | None, reduce_sum, case: str) -> torch.Tensor:
    """KL-Cov's top share of a step's tokens, on rank `rank`'s half of 8 sequences or on all 8 in one
    process (None); ties at the boundary are broken by draws keyed by global sequence and position.
    - "ties everywhere": top 4 of 48; three tokens (Â = 1, ℓ = −0.1) lie above the rest, whose
      covariances are all equal ((0 − Ā)(−1 − ℓ̄)): the fourth is one of 45 ties on both ranks.
    - "ties on rank 1": top 12 of 32; rank 0's 8 tokens (Â = 1, distinct ℓ near −0.1) all lie above
      rank 1's 24 tied ones: rank 0 has no tie to draw for, yet takes part in every collective."""
    old, adv, mask = torch.full((8, 6), -1.0), torch.zeros(8, 6), torch.ones(8, 6)
    if case == "ties everywhere":
        for n, t in TOP:
            old[n, t], adv[n, t] = -0.1, 1.0
        share = 4 / 48
    else:
        mask[:4, 2:] = 0
        old[:4, :2] = -0.1 - 0.01 * torch.arange(8.0).reshape(4, 2)
        adv[:4, :2] = 1.0
        share = 12 / 32
    rows = slice(None) if rank is None else slice(4 * rank, 4 * rank + 4)
    first = 0 if rank is None else 4 * rank
    draws = lambda local: keyed_uniform((7,), (first + local).tolist(), 6)  # noqa: E731
    inputs = TokenSelectionInputs(old[rows] * mask[rows], adv[rows] * mask[rows], mask[rows], draws, reduce_sum)
    return kl_cov_selection(inputs, kl_cov_ratio=share)[0]


TIE_CASES = ("ties everywhere", "ties on rank 1")


def one_process(tensor: torch.Tensor, reduce_op: str = "mean") -> torch.Tensor:
    return tensor  # a single-device strategy's reduce


def all_ranks(tensor: torch.Tensor, reduce_op: str = "mean") -> torch.Tensor:
    """The strategy's `reduce` under DDP: an all-reduce over the process group."""
    import torch.distributed as dist

    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    out = tensor.clone()
    dist.all_reduce(out, ops[reduce_op])
    return out


def _rank(rank: int, port: int, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
        results = {}
        for name in LOSSES:
            for max_tokens in LAYOUTS:
                loss, grad = step(rank_rollout(rank), old_offset(rank), WORLD, all_ranks, name, max_tokens)
                results[(name, max_tokens)] = (loss, grad.tolist())
        for case in TIE_CASES:
            results[case] = tied_selection(rank, lambda t: all_ranks(t, "sum"), case).tolist()
        out.put((rank, results))
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, traceback.format_exc()))


@functools.cache  # one spawn of both ranks serves every test of this file
def two_ranks() -> dict[int, dict]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=180) for _ in procs)
    except queue.Empty:
        pytest.fail("the two ranks did not report within 180 s")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank, result in results.items():
        if isinstance(result, str):
            pytest.fail(f"rank {rank} failed:\n{result}")
    return results


def test_two_ranks_with_unequal_token_counts_give_the_gradient_of_one_process_over_their_union():
    ranks = two_ranks()
    union = Rollout.concat([rank_rollout(0), rank_rollout(1)])
    union_offset = torch.cat([old_offset(0), old_offset(1)])
    wrong = []
    for name in LOSSES:
        for max_tokens in LAYOUTS:
            key = (name, max_tokens)
            loss_1, grad_1 = step(union, union_offset, 1, one_process, name, max_tokens)
            assert grad_1.abs().sum() > 0
            for rank in range(WORLD):  # after the all-reduce every rank holds the union's gradient
                diff = (torch.tensor(ranks[rank][key][1]) - grad_1).abs()
                if (diff > 1e-7 + 1e-5 * grad_1.abs()).any():
                    wrong.append(f"{key} rank {rank}: gradient off by up to {diff.max().item():.3g}")
            # Each rank's loss is its share × world size (against DDP's averaging): their mean is the step's loss.
            mean_loss = sum(ranks[r][key][0] for r in range(WORLD)) / WORLD
            if mean_loss != pytest.approx(loss_1, rel=1e-5, abs=1e-8):
                wrong.append(f"{key}: loss {mean_loss:.6g} over the ranks, {loss_1:.6g} in one process")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("case", TIE_CASES)
def test_kl_cov_takes_its_exact_share_of_tied_tokens_across_ranks_as_one_process_would(case):
    ranks = two_ranks()
    union = torch.cat([torch.tensor(ranks[r][case]) for r in range(WORLD)])
    one = tied_selection(None, lambda t: t, case)
    if case == "ties everywhere":
        assert one.sum() == 4 and all(one[n, t] for n, t in TOP)
    else:
        assert one.sum() == 12 and one[:4, :2].all() and not one[:4, 2:].any()
    assert torch.equal(union, one)


def test_the_union_reference_is_the_token_mean_formula_and_per_rank_means_would_differ():
    """The single-process reference above is DAPO's token-mean, written out here; and the classic error it
    guards against (token-mean per rank, then DDP's average) gives another gradient on these ranks."""
    union = Rollout.concat([rank_rollout(0), rank_rollout(1)])
    offset = torch.cat([old_offset(0), old_offset(1)])
    loss_1, grad_1 = step(union, offset, 1, one_process, "token-mean", None)
    model = TinyCausalLM()
    t = union.tensors(pad_id=0)
    mask = t.response_mask
    logits = model(t.input_ids, t.attention_mask).logits[:, t.prompt_width - 1 : -1]
    logp = logits.log_softmax(-1).gather(-1, t.input_ids[:, t.prompt_width :, None]).squeeze(-1)
    ratio = torch.exp(offset[:, : mask.shape[1]].neg() * mask)  # π_θ/π_old; the old log-probs are logp + offset
    ratio = ratio * torch.exp(logp - logp.detach())  # value as above, gradient of ρ·log π_θ
    A = group_advantage(union.correct, G)[:, None]
    per_tok = torch.maximum(-A * ratio, -A * ratio.clamp(1 - EPS_LOW, 1 + EPS_HIGH))
    T_S = sum(sum(lengths) for lengths in LENGTHS)
    assert mask.sum().item() == T_S
    expected = (per_tok * mask).sum() / T_S
    expected.backward()
    assert loss_1 == pytest.approx(expected.item(), rel=1e-5)
    torch.testing.assert_close(grad_1, torch.cat([p.grad.flatten() for p in model.parameters()]), rtol=1e-5, atol=1e-7)
    per_rank = [step(rank_rollout(r), old_offset(r), 1, one_process, "token-mean", None)[1] for r in range(WORLD)]
    assert not torch.allclose(sum(per_rank) / WORLD, grad_1, rtol=1e-2, atol=0)
