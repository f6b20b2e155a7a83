"""The planner's step-time model: the assumed spread of response lengths, vLLM's continuous batching (paged
KV cache, preemption, the long tail, the per-step overhead), the weight sync, and the expected and
worst-case steps of a plan. Small cases are checked against sums done by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rlvr_lightning.errors import ConfigError
from rlvr_lightning.planner.generation import DecodeCosts, continuous_batching, padded_batch
from rlvr_lightning.planner.lengths import expected_longest, response_lengths, submission_order

BASE = ["--config", "configs/base.yaml", "--config", "configs/algo/grpo.yaml"]
# The docs' 7B example (docs/planning.md), at every sequence at the limit.
DOCS_7B = ["--config", "configs/strategy/fsdp.yaml", "--data.model_name_or_path", "Qwen/Qwen2.5-Math-7B", "--plan.hardware", "h100",
           "--trainer.devices", "8", "--data.batch_size", "64", "--rollout.group_size", "16",
           "--rollout.max_response_length", "8192"]  # fmt: skip


def memory_bound(overhead: float = 0.5) -> DecodeCosts:
    """Weights of 1,000 bytes, 10 bytes of KV per token, 100 bytes/s: a step reading c tokens of context
    costs 10 + c / 10 seconds; compute is free."""
    return DecodeCosts(weight_bytes=1000, kv_bytes_per_token=10, bandwidth=100, flops_per_token=1, flop_s=1e12,
                       step_overhead_s=overhead)  # fmt: skip


@pytest.mark.parametrize("mean,cap", [(300, 4096), (1000, 4096), (3500, 4096), (50, 64)])
def test_the_clipped_quantiles_have_the_given_mean(mean, cap):
    spread = response_lengths(mean, cap, 256)
    assert spread.mean == pytest.approx(mean, rel=1e-9)
    assert max(spread.lengths) <= cap and list(spread.lengths) == sorted(spread.lengths)
    assert 0 <= spread.share_at_cap < 1


def test_a_mean_at_the_cap_puts_every_response_there():
    spread = response_lengths(4096, 4096, 64)
    assert spread.lengths == (4096.0,) * 64 and spread.share_at_cap == 1


def test_the_expected_longest_of_one_row_is_the_mean_and_grows_with_rows():
    spread = response_lengths(1000, 4096, 128)
    assert expected_longest(spread.lengths, 1) == pytest.approx(1000)
    assert 1000 < expected_longest(spread.lengths, 4) < expected_longest(spread.lengths, 16) <= 4096


def test_the_submission_order_is_a_permutation():
    assert sorted(submission_order(1024)) == list(range(1024))


def test_one_sequence_decodes_its_length_in_steps_reading_the_weights_and_its_kv():
    """Prompt 10, 5 tokens: step j reads the weights (1,000 bytes) and 10 + j tokens of KV (10 bytes each) at
    100 bytes/s: Σ_j (10 + (10 + j) / 10) = 5 × 11 + 0.1 × (0+1+2+3+4) = 56 s, plus 5 × 0.5 s overhead."""
    g = continuous_batching(10, [5], kv_tokens=1000, max_num_seqs=256, costs=memory_bound())
    assert g.decode_steps == 5
    assert g.decode_s == pytest.approx(56.0)
    assert g.overhead_s == pytest.approx(2.5)
    assert (g.peak_in_flight, g.preemptions) == (1, 0)


def test_a_compute_bound_step_costs_its_flops():
    """1,000 sequences of one token in one step: 2 FLOPs per sequence at 100 FLOP/s = 20 s, more than the
    10 s the weights' 1,000 bytes take at 100 bytes/s (no KV bytes here)."""
    costs = DecodeCosts(1000, 0, 100, flops_per_token=2, flop_s=100, step_overhead_s=0)
    g = continuous_batching(1, [1] * 1000, kv_tokens=10**6, max_num_seqs=1000, costs=costs)
    assert g.decode_s == pytest.approx(20.0)


def test_a_cache_too_small_forces_preemptions_and_takes_longer():
    lengths = [200] * 32
    roomy = continuous_batching(50, lengths, kv_tokens=32 * 250 + 1000, max_num_seqs=256, costs=memory_bound())
    tight = continuous_batching(50, lengths, kv_tokens=1200, max_num_seqs=256, costs=memory_bound())
    assert roomy.preemptions == 0 and tight.preemptions > 0
    assert tight.seconds > roomy.seconds and tight.decode_steps > roomy.decode_steps


def test_one_long_response_among_short_ones_sets_the_rollouts_length():
    lengths = [10] * 63 + [1000]
    g = continuous_batching(5, lengths, kv_tokens=10**6, max_num_seqs=256, costs=memory_bound())
    assert g.decode_steps >= 1000
    assert g.tail_steps >= 990  # the long one alone after the others ended
    assert g.mean_in_flight < 2  # 64 × 10 + 990 tokens over 1,000 steps


def test_the_hf_engine_decodes_every_row_to_the_longest():
    g = padded_batch(10, [3, 5], memory_bound())
    # Two rows: step j reads 1,000 + 10 × (20 + 2j) bytes: Σ_{j<5} (10 + 2 + 0.2 j) = 60 + 2 = 62 s.
    assert (g.decode_steps, g.decode_s) == (5, pytest.approx(62.0))


def parsed(*argv: str):
    from rlvr_lightning.plan import parse

    return parse([*BASE, *argv])[0]


@pytest.fixture(scope="module")
def docs_7b():
    """The docs' 7B example: its RunSpec, its parameter count and its engine share (no trainer measured)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlvr_lightning.planner.engine_memory import engine_share
    from rlvr_lightning.planner.hardware import hardware
    from rlvr_lightning.planner.run_spec import run_spec

    argv = sys.argv
    sys.argv = ["plan"]
    try:
        spec = run_spec(parsed(*DOCS_7B), hardware("h100"))
    finally:
        sys.argv = argv
    with torch.device("meta"):
        parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(spec.model_config).parameters())
    return spec, parameters, engine_share(spec, parameters)


def test_continuous_batching_keeps_more_in_flight_than_reserved_waves(docs_7b):
    """At every sequence at the limit, paging on demand and admitting as sequences finish keeps more of them in
    flight than waves that each reserve prompt + limit tokens."""
    from rlvr_lightning.planner.step_time import generation

    spec, parameters, engine = docs_7b
    P, T, N = spec.max_prompt_length, spec.max_response_length, spec.sequences_per_rank
    waves = engine.kv_tokens // (P + T)
    g = generation(spec, parameters, engine, P, response_lengths(T, T, N))
    assert g.mean_in_flight > 1.5 * waves, (g.mean_in_flight, waves)
    assert g.decode_steps < N * T / waves  # fewer steps than the waves would take


def test_eager_mode_pays_more_per_step_than_cuda_graphs(docs_7b):
    from rlvr_lightning.planner.step_time import generation, step_overhead

    spec, parameters, engine = docs_7b
    eager = spec.changed(enforce_eager=True)
    assert step_overhead(eager) > step_overhead(spec)
    spread = response_lengths(2000, spec.max_response_length, spec.sequences_per_rank)
    graphs_s = generation(spec, parameters, engine, 512, spread)
    eager_s = generation(eager, parameters, engine, 512, spread)
    assert eager_s.overhead_s > graphs_s.overhead_s and eager_s.decode_s == pytest.approx(graphs_s.decode_s)


def test_the_weight_sync_is_priced_as_the_engines_do_it(docs_7b):
    from rlvr_lightning.planner.weight_sync import weight_sync

    spec, parameters, _ = docs_7b
    nbytes = 2 * parameters
    colocated = weight_sync(spec, nbytes, nbytes)
    asleep = weight_sync(spec.changed(sleep_level=1), nbytes, nbytes)
    assert 1 <= colocated.seconds <= 5  # published refits of 7–8B models: 1–5 s
    assert asleep.seconds > colocated.seconds and "sleep + wake" in asleep.parts
    assert weight_sync(spec.changed(engine="hf"), nbytes, nbytes).seconds == 0


def test_the_sleep_mode_fix_raises_the_engines_share(docs_7b):
    from rlvr_lightning.device_defaults import SHARE_ASLEEP
    from rlvr_lightning.planner.planner import candidate_changes

    spec, _, _ = docs_7b
    sleep = next(change for description, change in candidate_changes(spec) if "sleep_level" in change)
    assert sleep == {"sleep_level": 1, "gpu_memory_utilization": SHARE_ASLEEP}
    given = spec.changed(gpu_memory_utilization=0.4, device_defaults=None)  # a share the user set
    description, change = next((d, c) for d, c in candidate_changes(given) if "sleep_level" in c)
    assert description == f"--rollout.sleep_level 1 --rollout.gpu_memory_utilization {SHARE_ASLEEP:g}"


def test_the_plan_prints_the_expected_and_the_worst_step(monkeypatch):
    """A mean at the limit is the worst case; a shorter mean is faster; memory is planned at the limits."""
    from rlvr_lightning.planner.preflight import plan_config
    from rlvr_lightning.planner.report import as_dict, as_text

    monkeypatch.setattr(sys, "argv", ["plan"])
    run = ("--plan.hardware", "h100", "--rollout.max_response_length", "256")
    at_cap = plan_config(parsed(*run, "--plan.mean_response_length", "256"))
    shorter = plan_config(parsed(*run, "--plan.mean_response_length", "64", "--plan.mean_prompt_length", "16"))
    assert at_cap.step.total == pytest.approx(at_cap.step.worst_total)
    assert at_cap.step.stages == at_cap.step.worst_stages
    assert shorter.step.total < shorter.step.worst_total == pytest.approx(at_cap.step.worst_total)
    assert shorter.peak_gib == pytest.approx(at_cap.peak_gib)
    report = as_dict(shorter)
    assert report["step_s_expected"] <= report["step_s_worst"]
    assert {"decode_steps", "mean_in_flight", "preemptions", "tail_s"} <= set(report["generation"]["expected"])
    assert "expected" in as_text(shorter) and "log-normal" in as_text(shorter)


def test_a_mean_beyond_its_limit_is_one_line(capsys, monkeypatch):
    from rlvr_lightning.plan import main

    monkeypatch.setattr(sys, "argv", ["plan"])
    for argv, message in [(["--mean-response-length", "5000"], "plan.mean_response_length must be in (0, rollout.max_response_length="),
                          (["--mean-prompt-length", "0"], "plan.mean_prompt_length must be in (0, data.max_prompt_length=32], got 0")]:  # fmt: skip
        with pytest.raises(SystemExit) as exit_info:
            main([*BASE, "--hardware", "h100", *argv])
        err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("error")]
        assert exit_info.value.code == 2 and len(err) == 1 and message in err[0], err
    with pytest.raises(ConfigError, match="plan.mean_response_length must be > 0"):
        from rlvr_lightning.planner.settings import PlanSettings

        PlanSettings(mean_response_length=-1)


def test_a_decode_step_streams_every_weight_but_the_gathered_input_embedding(docs_7b):
    """Qwen2.5-Math-7B's embedding is its own matrix: its rows are gathered, not read whole each step; a head tied
    to the embedding is read whole for the logits."""
    from rlvr_lightning.planner.step_time import streamed_parameters

    spec, parameters, _ = docs_7b
    cfg = spec.model_config
    assert not cfg.tie_word_embeddings
    assert streamed_parameters(spec, parameters) == parameters - cfg.vocab_size * cfg.hidden_size
    tied = spec.changed(model_config=cfg.__class__.from_dict({**cfg.to_dict(), "tie_word_embeddings": True}))
    assert streamed_parameters(tied, parameters) == parameters


def test_fsdp_collectives_across_nodes_run_at_the_network_not_nvlink(docs_7b, monkeypatch):
    """A step whose compute is negligible (no FLOPs, no per-layer costs) is its collectives: over two nodes, at the
    network's 50 GB/s per GPU instead of NVLink's 450 (the ring runs at its slowest link)."""
    from rlvr_lightning.planner import step_time
    from rlvr_lightning.planner.step_time import trainer_stages
    from rlvr_lightning.planner.trainer_memory import StagePeak, TrainerMemory

    monkeypatch.setattr(step_time, "LAYER_FORWARD_S", 0.0)
    monkeypatch.setattr(step_time, "LAYER_BACKWARD_S", 0.0)

    spec, parameters, _ = docs_7b
    trainer = TrainerMemory([StagePeak("update backward", 0, {}, flops=1)], parameters)
    one_node = trainer_stages(spec, trainer, 1.0)["update forward + backward"]
    two_nodes = spec.changed(devices=4, nodes=2)  # the same 8 ranks
    assert trainer_stages(two_nodes, trainer, 1.0)["update forward + backward"] == pytest.approx(one_node * 450 / 50)
    # Weights kept gathered from the forward to the backward: two transfers a micro-batch (a gather, the
    # reduce-scatter) instead of three.
    kept = two_nodes.changed(reshard_after_forward=False)
    assert trainer_stages(kept, trainer, 1.0)["update forward + backward"] == pytest.approx(one_node * 450 / 50 * 2 / 3)


def test_packed_micro_batches_at_the_expected_lengths_are_fewer_and_gather_the_weights_fewer_times(docs_7b):
    """Under a token budget, packed micro-batches hold the expected real tokens: at a quarter of the limits'
    tokens a quarter as many, so a step bound by its FSDP gathers takes a quarter of the time; padded ones
    (or rows) stay as many as at the limits."""
    from rlvr_lightning.planner.step_time import expected_micro_batches, trainer_stages
    from rlvr_lightning.planner.trainer_memory import StagePeak, TrainerMemory

    spec, parameters, _ = docs_7b
    row = spec.max_prompt_length + spec.max_response_length
    packed = spec.changed(packing=True, max_tokens_per_micro_batch=4 * row, devices=4, nodes=2)  # 4 rows at the limits
    assert (expected_micro_batches(packed, 1.0), expected_micro_batches(packed, 0.25)) == (256, 64)
    padded = packed.changed(packing=False)
    assert expected_micro_batches(padded, 0.25) == expected_micro_batches(padded, 1.0) == 256
    trainer = TrainerMemory([StagePeak("update backward", 0, {}, flops=1)], parameters)
    gathers = {share: trainer_stages(packed, trainer, share)["update forward + backward"] for share in (1.0, 0.25)}
    assert gathers[0.25] == pytest.approx(gathers[1.0] / 4)


@pytest.mark.e2e
def test_a_published_end_to_end_run_is_planned_within_the_bounds_the_docs_state(monkeypatch):
    """NeMo-RL v0.3's FSDP2 run (bench/published_e2e.py, sources in bench/README.md): 122 s a step, 57 s of it
    generation, planned at its published mean lengths within [0.6, 1.6] of the step and [0.5, 2] of generation."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    from published_e2e import RUNS, compared, plan_run

    run = next(r for r in RUNS if "FSDP2" in r.name)
    result = compared(run, plan_run(run))
    assert 0.6 <= result["total_ratio"] <= 1.6 and 0.5 <= result["generation_ratio"] <= 2, result


def test_partial_rollouts_cut_each_response_at_the_segment_caps():
    """Hand check: caps ⌈12·1/2⌉ = 6 and 12; a response of 3 is one piece, 10 is 6 + 4, 12 is 6 + 6; the
    pieces after the first start 6 tokens in."""
    from rlvr_lightning.planner.lengths import LengthSpread
    from rlvr_lightning.planner.step_time import partial_segments

    pieces, before = partial_segments(LengthSpread((3.0, 10.0, 12.0), 12, 6.0, 1.0), 2)
    assert pieces.lengths == (3.0, 4.0, 6.0, 6.0, 6.0) and pieces.cap == 6
    assert before == pytest.approx((0 + 0 + 6 + 0 + 6) / 5)
    whole, _ = partial_segments(LengthSpread((3.0, 10.0, 12.0), 12, 6.0, 1.0), 1)
    assert whole.lengths == (3.0, 10.0, 12.0)


def test_partial_rollouts_shorten_a_steps_generation_and_the_plan_names_the_staleness_that_hides_it(docs_7b):
    """A long tail (mean 500 of 8,192 tokens): whole sequences make each step wait for the longest; pieces of
    at most L/s tokens, s batches at a time, keep more sequences in flight. (At a mean of 2,000 the KV cache
    is full throughout and the pieces' prefills make partial rollouts slower: the plan shows that too.)"""
    from rlvr_lightning.planner.step_time import overlap_notes, segmented_generation

    spec, parameters, engine = docs_7b
    spread = response_lengths(500, spec.max_response_length, spec.sequences_per_rank)
    at = {s: segmented_generation(spec, parameters, engine, 512, spread, s).seconds for s in (1, 2, 4)}
    assert at[4] < at[2] < at[1]
    update = (at[2] + at[4]) / 2  # an update that hides s = 4's generation, not s = 2's
    stages = {"generation": at[1], "update": update}
    notes = overlap_notes(spec, stages, lambda s: segmented_generation(spec, parameters, engine, 512, spread, s).seconds)
    assert any("--rollout.stream.max_staleness 1 would" in n for n in notes), notes
    hidden = [n for n in notes if "partial rollouts at --rollout.stream.max_staleness" in n]
    assert hidden and ("max_staleness 3 " in hidden[0] or "max_staleness 4 " in hidden[0]), notes


def test_the_python_tools_calls_are_planned_in_generation(docs_7b):
    """The docs' 7B run with the tool: N = 1,024 answers a rank, 4 calls at most, 8 sandbox workers. Expected:
    ⌈N·c / workers⌉ calls' time (c = 4 by default, or as planned); the worst: every answer's 4 calls at the 5 s
    limit. It adds to generation, expected and worst, and the outputs' share of the budget is said."""
    from dataclasses import replace

    from rlvr_lightning.planner.step_time import segmented_generation
    from rlvr_lightning.planner.tool_time import ToolPlan

    spec, parameters, engine = docs_7b
    N, T = spec.sequences_per_rank, spec.max_response_length
    assert N == 1024
    spread = response_lengths(2000, T, N)
    plain = segmented_generation(spec, parameters, engine, 512, spread, 1)
    tool = ToolPlan(max_calls=4, calls_per_answer=4, call_s=0.065, timeout_s=5.0, workers=8, output_tokens=532)
    with_tool = spec.changed(tool=tool)
    expected = segmented_generation(with_tool, parameters, engine, 512, spread, 1)
    worst = segmented_generation(with_tool, parameters, engine, 512, spread, 1, worst=True)
    assert plain.tool_s == 0.0
    assert expected.tool_s == pytest.approx(512 * 0.065) and worst.tool_s == pytest.approx(4 * 128 * 5.0)
    assert expected.seconds == pytest.approx(plain.seconds + 512 * 0.065)
    fewer = segmented_generation(spec.changed(tool=replace(tool, calls_per_answer=0.5)), parameters, engine, 512, spread, 1)
    assert fewer.tool_s == pytest.approx(64 * 0.065)
    assert "up to 532 tokens a call: 2,128 of the 8,192-token response budget" in tool.describe(T)


def test_make_plan_reads_the_tool_and_the_plans_own_expectations(monkeypatch):
    from rlvr_lightning.planner.hardware import hardware
    from rlvr_lightning.planner.run_spec import run_spec

    monkeypatch.setattr(sys, "argv", ["plan"])
    spec = run_spec(parsed("--data.tool.max_calls", "3", "--data.tool.sandbox.workers", "2"), hardware("cpu"))
    assert (spec.tool.max_calls, spec.tool.calls_per_answer, spec.tool.workers, spec.tool.call_s) == (3, 3, 2, 0.063)
    assert spec.tool.output_tokens == 512 + len("```output\n") + len("\n```\n")
    planned = parsed("--data.tool.max_calls", "3", "--plan.tool_calls_per_answer", "0.5", "--plan.tool_call_ms", "20")
    spec = run_spec(planned, hardware("cpu"))
    assert (spec.tool.calls_per_answer, spec.tool.call_s) == (0.5, 0.02)
    assert run_spec(parsed(), hardware("cpu")).tool is None
    with pytest.raises(ConfigError, match="plan.tool_calls_per_answer must be ≥ 0"):
        from rlvr_lightning.planner.settings import PlanSettings

        PlanSettings(tool_calls_per_answer=-1)
