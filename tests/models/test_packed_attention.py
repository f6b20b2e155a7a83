"""Padding-free (packed) updates: a micro-batch's real tokens in one row give the same log-probs,
entropies, LM-head inputs and gradients as the padded layout on every model family the chunked head
supports; token budgets count real tokens; the varlen attention function (CUDA's path) agrees on CPU
through its per-sequence fallback; a packed GRPO run trains through the CLI."""

from __future__ import annotations

import math

import pytest
import torch
import transformers as tf

from rlvr_lightning.models.forward import policy_forward, response_hidden
from rlvr_lightning.models.packed_attention import (
    PACKED_SDPA,
    _torch_varlen,
    packed_sdpa_attention,
    prepare_packed_attention,
    varlen_causal_attention,
)
from rlvr_lightning.models.packing import packed_layout
from rlvr_lightning.parallel import checkpoint_layers
from rlvr_lightning.rollout.types import Completion, PromptBatch, Rollout, SamplingConfig
from rlvr_lightning.training.micro_batches import forward_tokens, split_rows
from rlvr_lightning.training.settings import ComputeSettings
from tests.models.test_lm_head_transforms import FAMILIES as TRANSFORM_FAMILIES
from tests.models.test_lm_head_transforms import SHARED, family_model
from tests.support.settings import resettle

# The families the chunked head supports without a transform, at the transform families' sizes: the
# embedded Qwen2 (here with grouped-query attention), Llama (untied head) and Gemma 3 with a sliding
# window shorter than the rows below, on its sliding layer.
PLAIN = {
    "qwen2": (tf.Qwen2Config, dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "llama": (tf.LlamaConfig, dict(tie_word_embeddings=False)),
    "gemma3_sliding": (tf.Gemma3TextConfig, dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
                                                 layer_types=["sliding_attention", "full_attention"])),
}  # fmt: skip
FAMILY_NAMES = sorted(PLAIN) + sorted(TRANSFORM_FAMILIES)


def model_of(name: str) -> torch.nn.Module:
    if name in TRANSFORM_FAMILIES:
        return family_model(name)
    config_cls, settings = PLAIN[name]
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config_cls(**{**SHARED, **settings})).eval()


def ragged(vocab: int = 96):
    """Three groups of two under prompts of 3, 12 and 6 tokens: responses of 1, 9, 2 (a long prompt and a
    short response), 0, 13 and 5 tokens."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3, 12, 6)]
    completions = [
        Completion(torch.randint(3, vocab, (L,), generator=g).tolist(), [0.0] * L, "stop") for L in (1, 9, 2, 0, 13, 5)
    ]
    rollout = Rollout(
        PromptBatch(["a", "b", "c"], [""] * 3, [""] * 3), 2, prompts, completions, SamplingConfig(group_size=2), 0
    )
    return rollout.tensors(pad_id=0)


def run(model, t, chunk_tokens, packed, weights):
    model.zero_grad(set_to_none=True)
    out = policy_forward(
        model, t, 0.8, with_entropy=True, capture_lm_head=True, chunk_tokens=chunk_tokens, packed=packed
    )
    (out.logp * weights).sum().backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_packed_equals_padded(model, t, chunk_tokens):
    weights = torch.randn(t.response_mask.shape, generator=torch.Generator().manual_seed(2))
    (padded, g_padded), (packed, g_packed) = (run(model, t, chunk_tokens, p, weights) for p in (False, True))
    mask = t.response_mask.bool()
    assert packed.logp.shape == padded.logp.shape and packed.lm_head_in.shape == padded.lm_head_in.shape
    torch.testing.assert_close(packed.logp, padded.logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(packed.entropy[mask], padded.entropy[mask], rtol=0, atol=1e-5)
    assert (packed.logp[~mask] == 0).all() and (packed.entropy[~mask] == 0).all()
    rows = list(range(len(mask)))  # THR's rows: the LM-head inputs that predict each response token
    thr_packed, thr_padded = (response_hidden(f.lm_head_in, rows, t.response_mask) for f in (packed, padded))
    for n in rows:
        torch.testing.assert_close(thr_packed[n], thr_padded[n], rtol=0, atol=1e-5)
    assert g_packed.keys() == g_padded.keys()
    for name, g in g_padded.items():  # fp32 rounding, relative to the gradient's scale (Gemma's embedding: ~10)
        torch.testing.assert_close(g_packed[name], g, rtol=1e-4, atol=1e-6 * max(1.0, float(g.abs().max())), msg=name)


@pytest.mark.parametrize("chunk_tokens", [0, 4], ids=["full-logits", "chunked"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_packed_logprobs_entropies_lm_head_inputs_and_gradients_equal_the_padded_ones(family, chunk_tokens):
    model = model_of(family)
    t = ragged()
    if family == "gemma3_sliding":
        assert int(t.lengths.max()) > model.config.sliding_window  # the window cuts into the longer rows
    assert_packed_equals_padded(model, t, chunk_tokens)


def test_the_layout_by_hand():
    """Two sequences (prompt 2 + response 1, prompt 1 + response 3) and an empty row, in a layout 2
    prompt and 3 response columns wide (5 per row)."""
    layout = packed_layout(torch.tensor([[2, 1], [1, 3], [0, 0]]), prompt_width=2, response_width=3)
    assert layout.token_index.tolist() == [0, 1, 2, 6, 7, 8, 9]  # row 1's prompt is left-padded by a column
    assert layout.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3]]
    assert layout.predicting.tolist() == [1, 3, 4, 5]  # the last prompt token, then each response token but the last
    assert layout.response_row.tolist() == [0, 1, 1, 1] and layout.response_col.tolist() == [0, 0, 1, 2]
    assert layout.cu_seqlens.tolist() == [0, 3, 7] and layout.cu_seqlens.dtype == torch.int32
    assert layout.max_length == 4 and layout.real_tokens == 7
    with pytest.raises(ValueError, match="no prompt token"):
        packed_layout(torch.tensor([[0, 2]]), prompt_width=1, response_width=2)


def test_token_budgets_count_real_tokens_when_packed():
    counts = torch.tensor([[5, 3], [5, 11], [9, 0], [9, 7]])
    assert forward_tokens(counts) == 4 * (9 + 11) and forward_tokens(counts, packed=True) == 49
    rows = torch.arange(4)
    for unit in (1, 2):
        packed = split_rows(rows, counts, 8, 30, unit, packed=True)
        padded = split_rows(rows, counts, 8, 30, unit)
        assert sorted(torch.cat(packed).tolist()) == rows.tolist()
        for b in packed:  # within the budget by real tokens (a unit above it alone)
            assert forward_tokens(counts[b], packed=True) <= 30 or len(b) == unit
        assert len(packed) <= len(padded)
    # 8, 16, 9 and 16 real tokens: 16 + 9 and 16 + 8 fit 30 (first fit, longest first); padded, either
    # 16-token row beside any other costs 2 × (9 + 11) or 2 × (5 + 11) = 32.
    assert sorted(sorted(b.tolist()) for b in split_rows(rows, counts, 8, 30, packed=True)) == [[0, 3], [1, 2]]
    assert len(split_rows(rows, counts, 8, 30)) == 3
    # Spread lengths: never more micro-batches than padded, each within the budget, the fewest possible + 1.
    g = torch.Generator().manual_seed(0)
    counts = torch.stack([torch.randint(20, 200, (64,), generator=g), torch.randint(1, 1000, (64,), generator=g)], 1)
    packed = split_rows(torch.arange(64), counts, 64, 2048, packed=True)
    assert max(forward_tokens(counts[b], packed=True) for b in packed) <= 2048
    assert len(packed) <= len(split_rows(torch.arange(64), counts, 64, 2048))
    assert len(packed) <= math.ceil(int(counts.sum()) / 2048) + 1


def test_the_varlen_attention_function_equals_sdpa_on_cpu():
    """`PACKED_SDPA` (switched in on CUDA): packed, through its per-sequence fallback here, the same
    log-probs and gradients as the padded forward, with activation checkpointing recomputing the
    packed layers in the backward; padded, exactly transformers' sdpa."""
    for family in ("qwen2", "gemma3_sliding"):
        model = model_of(family)
        t = ragged()
        sdpa = policy_forward(model, t, 1.0).logp
        assert prepare_packed_attention(model) == "sdpa"  # on CPU the model keeps transformers' own path
        assert prepare_packed_attention(model, force=True) == PACKED_SDPA
        assert torch.equal(policy_forward(model, t, 1.0).logp, sdpa)
        assert_packed_equals_padded(model, t, 4)
        checkpoint_layers(model)
        assert_packed_equals_padded(model, t, 4)


def test_the_varlen_attention_function_refuses_a_mask_in_a_packed_forward():
    q = torch.randn(1, 2, 5, 8)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="no attention mask"):
        packed_sdpa_attention(
            module, q, q, q, torch.ones(1, 1, 5, 5, dtype=torch.bool), cu_seq_lens_q=cu, max_length_q=3
        )


def dense_reference(q, k, v, cu, scale=None, left=-1):
    """Attention of q [S, H, D] with a dense [S × S] mask: same sequence, causal, at most `left` back."""
    seq = torch.repeat_interleave(torch.arange(len(cu) - 1), cu.diff().long())
    i = torch.arange(len(seq))
    allowed = (seq[:, None] == seq[None, :]) & (i[None, :] <= i[:, None])
    if left >= 0:
        allowed &= i[None, :] >= i[:, None] - left
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("shd,thd->hst", q, k) * (scale or q.shape[-1] ** -0.5)
    return torch.einsum("hst,thd->shd", scores.masked_fill(~allowed, -math.inf).softmax(-1), v)


def flash_varlen_stand_in(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    """What PyTorch's `varlen_attn` computes (its documented contract), for the argument translation of
    `_torch_varlen`, which can only run on CUDA: window (left, right), (-1, 0) causal; GQA when enabled."""
    assert window_size[1] == 0 and cu_q.dtype == torch.int32 and max_q == max_k == int(cu_q.diff().max())
    assert enable_gqa or q.shape[1] == k.shape[1]
    return dense_reference(q, k, v, cu_q, scale, window_size[0])


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_the_varlen_kernel_gets_transformers_window_and_grouped_heads(window, kv_heads):
    """A sliding window of W (transformers: a token sees the W − 1 before it) is the kernel's left
    window W − 1; grouped K/V heads go through `enable_gqa`, or are repeated for a kernel without it."""
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 1, 6, 13], dtype=torch.int32)
    q = torch.randn(13, 4, 8, generator=g)
    k, v = torch.randn(2, 13, kv_heads, 8, generator=g).unbind(0)
    expected = dense_reference(q, k, v, cu, 0.3, -1 if window is None else window - 1)
    torch.testing.assert_close(varlen_causal_attention(q, k, v, cu, 7, 0.3, window), expected)  # the fallback
    params = frozenset({"scale", "window_size", "enable_gqa"})
    for kernel in ((flash_varlen_stand_in, params), (flash_varlen_stand_in, params - {"enable_gqa"})):
        torch.testing.assert_close(_torch_varlen(kernel, q, k, v, cu, 7, 0.3, window), expected)


def module_cases():
    from rlvr_lightning.algos import GRPO, REAL
    from rlvr_lightning.shapers.settings import THRSettings
    from tests.shapers.test_thr import with_thr
    from tests.support.update_harness import attach

    thr = lambda d, rows: with_thr(GRPO, d, THRSettings(p=0.3, threshold="all"), compute=ComputeSettings(micro_batch_size=rows))  # noqa: E731
    return {  # (the module, its token budget: the real tokens of about three sequences, or None: rows)
        # θ_old and the reference from the separate pass (two mini-batches), truncated IS on the engine's log-probs.
        "grpo-kl-tis": (
            lambda d: attach(GRPO, d, kl_coef=0.05, rollout_correction="tis-token", num_mini_batches=2),
            64,
        ),
        "real-whole-groups": (lambda d: attach(REAL, d, compute=ComputeSettings(micro_batch_size=4)), None),
        "real-two-pass": (lambda d: attach(REAL, d, two_pass=True, compute=ComputeSettings(micro_batch_size=3)), 64),
        "thr-read-in-the-update": (lambda d: thr(d, 4), None),
        "thr-separate-pass": (lambda d: thr(d, 3), None),
    }


def packed_or_padded_update(tiny_policy_dir, case, packing):
    """The module's own preparation (θ_old / reference pass) and one optimizer step's gradient."""
    from rlvr_lightning.training.step_metrics import MetricAccumulator
    from tests.support.update_harness import MAX_LEN, gradient, sample_rollout, set_engine_logprobs

    build, max_tokens = module_cases()[case]
    module = build(tiny_policy_dir)
    resettle(module, packing=packing, max_tokens_per_micro_batch=max_tokens)
    shapes: list[tuple[int, ...]] = []
    module.policy.register_forward_pre_hook(
        lambda _m, _a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    rollout = sample_rollout(module)
    set_engine_logprobs(rollout, -1.0 - 0.1 * torch.rand(8, MAX_LEN, generator=torch.Generator().manual_seed(3)))
    _, inputs, _ = module.rlvr_step.prepare(module.step_context(), rollout)
    acc = MetricAccumulator()
    loss, grad = gradient(module, inputs, module.settings.compute.micro_batch_size, acc, max_tokens=max_tokens)
    return dict(inputs=inputs, loss=loss, grad=grad, metrics=acc.result(), shapes=shapes, weights=inputs.token_weights())


@pytest.mark.parametrize("case", list(module_cases()))
def test_a_packed_update_is_the_padded_one(tiny_policy_dir, case):
    """Through the module's own code: θ_old's and the reference's log-probs, THR's token weights, the loss
    and the gradient are the padded layout's; every forward of the packed run is one row of real tokens,
    within the budget when a sequence fits it, and the update's padding share is 0."""
    padded, packed = (packed_or_padded_update(tiny_policy_dir, case, p) for p in (False, True))
    a, b = padded["inputs"], packed["inputs"]
    torch.testing.assert_close(b.behaviour.old_logp_all(), a.behaviour.old_logp_all(), rtol=0, atol=1e-5)
    if a.ref_logp is not None:
        torch.testing.assert_close(b.ref_logp, a.ref_logp, rtol=0, atol=1e-5)
    if padded["weights"] is not None:
        torch.testing.assert_close(packed["weights"], padded["weights"])
        assert (padded["weights"] != 1).any()
    assert packed["loss"].item() == pytest.approx(padded["loss"].item(), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(packed["grad"], padded["grad"], rtol=1e-4, atol=1e-6)
    assert padded["grad"].abs().sum() > 0
    assert all(s[0] == 1 for s in packed["shapes"]) and padded["metrics"]["padding_frac"] > 0
    assert packed["metrics"]["padding_frac"] == 0
    max_tokens = module_cases()[case][1]
    if max_tokens is not None:  # sequence by sequence: each forward within the budget, or one sequence above it
        assert all(s[1] <= max(max_tokens, int(a.tensors.lengths.max())) for s in packed["shapes"])
        assert len(packed["shapes"]) < len(padded["shapes"])


@pytest.mark.e2e
def test_a_packed_grpo_run_trains_through_the_cli(tmp_path, quick_warm_start):
    """Two packed GRPO steps on the embedded model with a KL reference and a token budget, as a user runs
    them: the run finishes with finite metrics, no padding in the update, and the trainer's packed θ_old
    log-probs agree with the engine's token for token."""
    from tests.support.cli import run_cli, small_run_args

    _, model_dir = quick_warm_start
    args = [*small_run_args(tmp_path, model_dir), "--model.init_args.compute.packing", "true",
            "--model.init_args.compute.max_tokens_per_micro_batch", "96", "--model.init_args.kl_coef", "0.01"]  # fmt: skip
    proc = run_cli(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]

    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs(client.get_experiment_by_name("rlvr_lightning").experiment_id)
    assert run.info.status == "FINISHED" and run.data.params["model.init_args.compute.packing"] == "True"
    history = {key: [m.value for m in client.get_metric_history(run.info.run_id, key)] for key in run.data.metrics}
    assert len(history["train/loss"]) == 2 and all(math.isfinite(v) for v in history["train/loss"])
    assert all(math.isfinite(v) for v in history["train/grad_norm"] + history["train/kl"])
    assert history["train/padding_frac"] == [0.0, 0.0]
    assert max(history["train/logprob_mismatch_max"]) < 1e-3
