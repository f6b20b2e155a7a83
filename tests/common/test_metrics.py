"""pass@k against brute-force enumeration of k-subsets."""

from __future__ import annotations

import itertools

import pytest
import torch

from rlvr_lightning.metrics import PassAtK, pass_at_k


def brute_force(n: int, c: int, k: int) -> float:
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(samples, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_equals_enumeration_of_all_subsets(n):
    for c in range(n + 1):  # includes c = 0 and c = n
        for k in range(1, n + 1):  # includes k = n
            got = pass_at_k(torch.tensor([c]), n, k).item()
            assert got == pytest.approx(brute_force(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_1_is_the_mean_accuracy_and_large_n_is_stable():
    c = torch.tensor([0, 3, 7, 10])
    torch.testing.assert_close(pass_at_k(c, 10, 1), c.double() / 10)
    # C(1000, 500) overflows doubles; the product form does not.
    value = pass_at_k(torch.tensor([1]), 1000, 500).item()
    assert value == pytest.approx(0.5)


def test_k_larger_than_n_is_refused():
    with pytest.raises(ValueError, match="pass@5"):
        pass_at_k(torch.tensor([1]), 4, 5)


def test_metric_accumulates_over_updates_with_standard_error():
    metric = PassAtK(k=2)
    a = torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0]])
    b = torch.tensor([[1, 1, 0, 0]])
    metric.update(a)
    metric.update(b)
    per_problem = torch.tensor([brute_force(4, 1, 2), 0.0, brute_force(4, 2, 2)], dtype=torch.float64)
    assert metric.compute().item() == pytest.approx(per_problem.mean().item())
    assert metric.standard_error().item() == pytest.approx((per_problem.std() / 3**0.5).item())


def test_majority_vote_with_ties_missing_answers_and_k():
    from rlvr_lightning.metrics import MajAtK, majority_credit

    assert majority_credit(["5", "5", "6"], [True, True, False]) == 1.0
    assert majority_credit(["5", "6", "6"], [True, False, False]) == 0.0
    assert majority_credit(["5", "6"], [True, False]) == 0.5  # tie: expected credit of a random break
    assert majority_credit(["5", "6", "7", "7", "5"], [True, False, False, False, True]) == 0.5
    assert majority_credit([None, None, "3"], [False, False, True]) == 1.0  # no answer: no vote
    assert majority_credit([None, " "], [False, False]) == 0.0
    metric = MajAtK(k=3)
    answers = [["5", "6", "6", "5", "5"], ["1", "1", "2", "2", "2"]]
    correct = torch.tensor([[1, 0, 0, 1, 1], [0, 0, 1, 1, 1]])
    metric.update(answers, correct)  # first 3 samples: "6" wins (wrong); "1" wins (wrong)
    assert metric.compute().item() == 0.0
    full = MajAtK(k=5)
    full.update(answers, correct)
    assert full.compute().item() == 1.0
    with pytest.raises(ValueError, match="maj@6"):
        MajAtK(k=6).update(answers, correct)


def _ranks_worker(rank: int, world: int, port: int, out) -> None:
    import torch.distributed as dist

    from rlvr_lightning.metrics import MajAtK, PassAtK

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    data = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    answers = [["a", "b", "b", "c"], ["a", "a", "b", "c"], [None] * 4, ["x"] * 4]
    mine = slice(rank * 2, rank * 2 + 2)  # each rank sees half of the problems
    pass2, maj = PassAtK(k=2), MajAtK(k=4)
    pass2.update(data[mine])
    maj.update(answers[mine], data[mine])
    out.put((rank, pass2.compute().item(), pass2.standard_error().item(), maj.compute().item()))
    dist.destroy_process_group()


def test_metrics_synchronise_across_two_cpu_ranks():
    import torch.multiprocessing as mp

    from rlvr_lightning.metrics import MajAtK
    from rlvr_lightning.rollout.loopback import free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_ranks_worker, args=(r, 2, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    single = PassAtK(k=2)
    data = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    single.update(data)
    maj = MajAtK(k=4)
    maj.update([["a", "b", "b", "c"], ["a", "a", "b", "c"], [None] * 4, ["x"] * 4], data)
    for _, value, se, maj_value in results:  # every rank reports the global value, not its half
        assert value == pytest.approx(single.compute().item())
        assert se == pytest.approx(single.standard_error().item())
        assert maj_value == pytest.approx(maj.compute().item())
