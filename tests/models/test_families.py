"""Architecture families other than the embedded Qwen2 (`models.families`): a tiny Llama (untied LM head;
the family THR's paper shows its method on) and a tiny Gemma 3 (tied head, a √d-scaling embedding
module, a sliding-window layer whose window the sequences exceed).

Fast checks per family: the builder's model and tokenizer; THR's token weights computed by the module
against the definition; OAR-G on the family's own embeddings and KV cache. End to end per family: the
CLI with GRPO + THR + OAR-G (the `oar-g` and `thr` presets composed), vLLM rollouts and a probed
weight sync after every step.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from rlvr_lightning.attribution.oar import ScoringInput, oar_g_saliency, segment_boxed
from rlvr_lightning.models.embedded import TinyQwen2Spec, build_char_tokenizer, build_tiny_qwen2
from rlvr_lightning.models.embedded_task import train_test_split
from rlvr_lightning.models.families import FAMILIES, build_tiny, family_policy
from rlvr_lightning.models.warm_start import WarmStartConfig
from tests.conftest import REPO
from tests.e2e.test_presets import finished_run, preset_args
from tests.entry_points.test_cli import run_cli
from tests.shapers.test_thr import no_correct_in_group_1, thr_update

ARCHITECTURE = {"llama": "LlamaForCausalLM", "gemma3": "Gemma3ForCausalLM"}
TIED = {"llama": False, "gemma3": True}
SPEC = TinyQwen2Spec(num_hidden_layers=2)
TASK = train_test_split()[0][:4]  # the warm start memorises these four training problems


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def random_policy(family, tmp_path_factory) -> Path:
    return family_policy(family, tmp_path_factory.mktemp(f"{family}_random"), SPEC)


@pytest.fixture(scope="module")
def warm_policy(family, tmp_path_factory) -> Path:
    """The family warm-started on flawed demonstrations of `TASK` (~10 s): it answers each problem
    right a third of the time or so, so rollout groups are mixed and THR and OAR have work to do
    (a random init never answers right, and both would score nothing)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is faster, and far faster on a busy machine
    try:
        warm = WarmStartConfig(steps=120, warmup_steps=10, batch_size=8, lr=1e-2)
        return family_policy(family, tmp_path_factory.mktemp(f"{family}_warm"), SPEC, warm, TASK * 2)
    finally:
        torch.set_num_threads(threads)


def test_builder_gives_the_family_in_the_embedded_size_class(family, random_policy):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(random_policy)
    assert config.architectures == [ARCHITECTURE[family]]  # what vLLM picks its implementation by
    model = AutoModelForCausalLM.from_pretrained(random_policy, dtype=torch.float32)
    assert type(model).__name__ == ARCHITECTURE[family]
    head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert (head.data_ptr() == embed.data_ptr()) == TIED[family] == config.tie_word_embeddings
    tok = build_char_tokenizer()
    qwen2 = build_tiny_qwen2(tok, SPEC, seed=0)
    assert config.vocab_size == qwen2.config.vocab_size and config.hidden_size == qwen2.config.hidden_size
    assert config.num_hidden_layers == 2 and config.head_dim * config.num_attention_heads == config.hidden_size
    size = sum(p.numel() for p in model.parameters()) / sum(p.numel() for p in qwen2.parameters())
    assert 0.8 < size < 1.25, size
    text = "What is 14+20+0?\n14+20=34, 34+0=34.\\boxed{34} é"
    reloaded = AutoTokenizer.from_pretrained(random_policy)
    assert reloaded(text).input_ids == tok(text).input_ids
    assert reloaded.decode(reloaded(text).input_ids) == text
    if family == "gemma3":
        assert "sliding_attention" in config.layer_types and config.sliding_window < len(tok(text).input_ids)
    again = build_tiny(family, tok, SPEC, seed=0).state_dict()  # seeded: the same weights every time
    assert all(torch.equal(again[k], v) for k, v in model.state_dict().items())


def thr_by_definition(policy, rollout, pad_id: int) -> torch.Tensor:
    """s [N, T] of every token of every group, straight from the definition, independently of the
    library's forward and LM-head capture: h from the model's last hidden state (the final norm's
    output), π from its logits,
        s_{j,k} = Σ_{i∈O+} Σ_k' ⟨g_{i,k'}, g_{j,k}⟩ ⟨h_{i,k'}, h_{j,k}⟩,  g = (e_y − π) on V*."""
    t = rollout.tensors(pad_id)
    with torch.no_grad():
        out = policy(input_ids=t.input_ids, attention_mask=t.attention_mask, position_ids=t.position_ids,
                     output_hidden_states=True)  # fmt: skip
    P, T = t.prompt_width, t.response_mask.shape[1]
    hidden = out.hidden_states[-1][:, P - 1 : P - 1 + T].double()
    # The last hidden state is what the LM head reads: it gives the model's logits.
    torch.testing.assert_close(policy.lm_head(hidden.float()), out.logits[:, P - 1 : P - 1 + T], rtol=1e-4, atol=1e-4)
    probs = (out.logits[:, P - 1 : P - 1 + T].double() / rollout.sampling.temperature).softmax(-1)
    tokens = t.input_ids[:, P:]
    scores = torch.zeros(t.response_mask.shape, dtype=torch.float64)
    G = rollout.group_size
    for group in range(rollout.num_sequences // G):
        where = [
            (n, k) for n in range(group * G, (group + 1) * G) for k in range(len(rollout.completions[n].token_ids))
        ]
        vocab = sorted({int(tokens[n, k]) for n, k in where})
        g = torch.stack([(torch.tensor(vocab) == tokens[n, k]).double() - probs[n, k, vocab] for n, k in where])
        h = torch.stack([hidden[n, k] for n, k in where])
        correct = torch.tensor([bool(rollout.correct[n]) for n, _ in where])
        s = ((g @ g.T) * (h @ h.T))[:, correct].sum(1)
        for (n, k), value in zip(where, s):
            scores[n, k] = value
    return scores


def task_like_completions(rollout) -> None:
    """Completions in the warm start's own format (`a+b=s,s±c`), where its π is peaked on the group's
    tokens, so that THR depends on the LM head and its inputs (on random tokens g ≈ e_y and hardly does);
    group 1 without a correct rollout."""
    tok = build_char_tokenizer()
    texts = ["3+4=7,7-", "3+4=7", "3+4=8,8", "3+", "10+1=11", "10+1=12,", "10+2", "10+1=11,"]  # ≤ MAX_LEN tokens
    for comp, text in zip(rollout.completions, texts, strict=True):
        comp.token_ids = tok(text).input_ids
        comp.logprobs = [0.0] * len(comp.token_ids)
        comp.sampled_mask = [True] * len(comp.token_ids)
        comp.finish_reason = "length" if len(comp.token_ids) == rollout.sampling.max_tokens else "stop"
    no_correct_in_group_1(rollout)


def test_thr_weights_of_the_module_follow_the_definition(warm_policy):
    """GRPO + THR (p = 0.3, every token dominant) through the module's own path: the LM-head inputs read
    in the update's forward and the head the callback picks. |THR| = |Â·s| of the mixed group's tokens
    (the logged statistics) must be those of the definition on this architecture, and each token's
    weight 1 + p·sign(Â·s), every other token's 1."""
    p = 0.3
    run = thr_update(warm_policy, p, 4, task_like_completions)
    module, rollout, advantages = run.module, run.rollout, run.advantages
    assert run.read_in_update
    mask = rollout.tensors(0).response_mask.bool()
    s = thr_by_definition(module.policy, rollout, module.trainer.datamodule.tokenizer.pad_token_id)
    expected = torch.where(mask, 1 + p * torch.sign(advantages.double()[:, None] * s), 1.0)
    expected[4:] = 1.0  # group 1 has no correct rollout: no THR
    got = run.weights[:, : mask.shape[1]]
    clear = s.abs() > 1e-4 * s.abs().max()  # a sign is only defined away from 0
    assert clear[:4][mask[:4]].float().mean() > 0.9
    torch.testing.assert_close(got[mask & clear], expected[mask & clear].float())
    assert (got[:4][mask[:4]] == 1 + p).any() and (got[:4][mask[:4]] == 1 - p).any()
    # The signs alone hardly depend on h and the head (s is mostly > 0); the magnitudes do.
    thr = (advantages.double()[:, None] * s)[:4][mask[:4]].abs()
    assert run.metrics["thr/tokens"] == thr.numel()
    for key, value in (("abs_max", thr.max()), ("abs_p50", thr.quantile(0.5)), ("abs_p90", thr.quantile(0.9))):
        assert run.metrics[f"thr/{key}"] == pytest.approx(value.item(), rel=1e-3), key


def test_oar_g_on_the_family_embeddings_and_cache(random_policy):
    """OAR-G feeds the input-embedding module's output back as `inputs_embeds` and differentiates it:
    on this family that must be the model's own input (Gemma 3's module scales by √d); scores with the
    clean pass's KV cache reused equal full forwards (Gemma 3's sliding layers: full forwards); and the
    `pad` baseline is the pad token's input embedding, so a reasoning token that is the pad token has
    saliency exactly 0."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(random_policy, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(random_policy)
    pad = tok.pad_token_id
    with torch.no_grad():  # HF zero-inits the pad row (`padding_idx`); a released checkpoint's need not be 0
        model.get_input_embeddings().weight[pad].normal_(std=0.02, generator=torch.Generator().manual_seed(0))
    prompt = tok(TASK[0].prompt()).input_ids
    with torch.no_grad():
        ids = torch.tensor([prompt])
        torch.testing.assert_close(
            model(inputs_embeds=model.get_input_embeddings()(ids)).logits, model(input_ids=ids).logits
        )
    responses = ["14+20=34,34+0=34.\\boxed{34}", "14+20=34, so the sum is 34 and then 34+0=35.\\boxed{35}"]
    inputs = [segment_boxed(prompt, tok(r).input_ids, tok, "\\boxed{") for r in responses]
    x = inputs[0]
    with_pad = x.ids[: x.r0 + 1] + [pad] + x.ids[x.r0 + 1 :]  # the pad token as the 2nd reasoning token
    inputs.append(ScoringInput(with_pad, x.r0, x.r1 + 1, x.a0 + 1))

    def saliency(reuse: bool, baseline: str) -> list[torch.Tensor]:
        gens = [torch.Generator().manual_seed(i) for i in range(len(inputs))]
        return oar_g_saliency(model, inputs, pad, sigma=1e-2, generators=gens, baseline=baseline, reuse_prefix=reuse)

    full, reused = saliency(False, "zero"), saliency(True, "zero")
    for a, b in zip(full, reused):
        assert torch.isfinite(a).all() and (a > 0).all()
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-12)
    from_pad = saliency(True, "pad")[2]
    assert from_pad[1] == 0.0 and (from_pad[[0, *range(2, len(from_pad))]] > 0).all()


THR_KEYS = ("thr/tokens", "thr/dominant_frac", "thr/positive_frac", "thr/negative_frac", "thr/abs_p50",
            "thr/abs_p90", "thr/abs_max", "thr/abs_entropy_spearman")  # fmt: skip
OAR_KEYS = ("oar/scored", "oar/no_answer_span_frac", "oar/weight_p50", "oar/weight_min", "oar/weight_max",
            "oar/suppressed_frac", "oar/boosted_frac")  # fmt: skip


@pytest.mark.e2e
def test_grpo_with_thr_and_oar_g_trains_the_family_end_to_end(tmp_path, monkeypatch, family, warm_policy):
    """Two GRPO steps with THR and OAR-G through the CLI, as a user composes the presets (`oar-g.yaml`
    then `thr.yaml`: their shapers sections merge, THR's GRPO settings win, so the KL reference is loaded
    too), on the family's warm start and its four problems. Every weight sync is probed (engine and
    trainer log-probs of one completion must agree, and move together). lr 1e-3, not the presets'
    3e-5: a step that large makes a weight the sync misses show in the engine's log-probs (at 3e-5,
    skipping Gemma 3's q/k norms stays below every tolerance here)."""
    task = tmp_path / "task.jsonl"
    task.write_text(
        "".join(json.dumps({"problem": p.prompt(), "answer": str(p.value), "id": p.id}) + "\n" for p in TASK)
    )
    name = f"{family}-grpo-thr-oar-g"
    args = [
        *preset_args(tmp_path, "oar-g", warm_policy, max_response_length=40), "--config", "configs/algo/thr.yaml",
        "--trainer.logger.init_args.run_name", name, "--data.train_data", str(task), "--data.val_data", "null",
        "--rollout_batches", "2", "--rollout.sync.check_every", "1", "--model.init_args.optim.lr", "1e-3",
    ]  # fmt: skip
    # The CLI runs in tmp_path, where `import rlvr_lightning` falls to the venv's editable install, which
    # may name another checkout: this one's code goes first.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = run_cli(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run, history = finished_run(tmp_path, name)
    assert run.data.tags["algorithm"] == "GRPO" and run.data.params["model.init_args.kl_coef"] == "0.001"
    params = run.data.params  # the two presets' shapers sections merge: OAR-G's and THR's options both hold
    assert params["model.init_args.shapers.oar.method"] == "gradient" and params["model.init_args.shapers.thr.p"] == "0.2"

    def values(key: str) -> list[float]:
        assert [m.step for m in history[f"train/{key}"]] == [0, 1], key
        return [m.value for m in history[f"train/{key}"]]

    assert values("policy_version") == [1.0, 2.0]
    # Both syncs probed and passed (a failed probe stops the run with WeightSyncError) ...
    assert max(values("sync_probe_max_abs_diff")) <= 1e-3
    # ... and the second batch was sampled by the synced engine with the trainer's log-probs, on every
    # token of every rollout (finer than the one-sequence probe: it catches a sync that misses q/k norms).
    assert max(values("logprob_mismatch_max")) < 1e-3
    for key in THR_KEYS + OAR_KEYS:
        assert all(math.isfinite(v) for v in values(key)), key
    assert max(values("thr/tokens")) > 0  # mixed groups were scored from captured LM-head inputs
    assert max(values("oar/scored")) > 0  # rollouts were attributed by input-embedding gradients
    assert min(values("oar/weight_min")) > 0
    export = Path(run.data.tags["export/final"])
    assert json.loads((export / "config.json").read_text())["architectures"] == [ARCHITECTURE[family]]
