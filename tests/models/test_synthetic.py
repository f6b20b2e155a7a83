"""The synthetic large-vocabulary Qwen2 builder (`rlvr_lightning.models.synthetic`), at a small vocabulary."""

from __future__ import annotations

import json

import pytest
import torch

from rlvr_lightning.data.sources import embedded_records
from rlvr_lightning.models.synthetic import SyntheticQwen2Spec, build_tokenizer, link, main, synthetic_policy_path

SPEC = SyntheticQwen2Spec(vocab_size=2048, hidden_size=64, num_attention_heads=1, num_key_value_heads=1,
                          intermediate_size=128, max_position_embeddings=256)  # fmt: skip


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RLVR_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


def test_builds_saves_and_reloads_through_hf_with_the_exact_vocabulary(cache):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = synthetic_policy_path(SPEC)
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == "qwen2" and model.config.num_hidden_layers == 2
    assert model.config.vocab_size == 2048 and model.get_output_embeddings().weight.shape == (2048, 64)
    assert len(tok) == 2048 and tok.pad_token_id == 0 and tok.eos_token_id == 1 == model.config.eos_token_id
    # Every id decodes to text, the last one included.
    assert all(tok.decode([i]) for i in (3, 300, 2047))
    logits = model(input_ids=torch.tensor([[5, 6, 7]])).logits
    assert logits.shape == (1, 3, 2048) and torch.isfinite(logits).all()


def test_the_embedded_task_prompts_round_trip(cache):
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(synthetic_policy_path(SPEC))
    for tok in (build_tokenizer(SPEC.vocab_size), reloaded):  # as built, and as the trainer and vLLM load it
        for record in embedded_records("test")[:100]:
            ids = tok(record.problem, add_special_tokens=False).input_ids
            assert max(ids) < 259  # bytes only: the filler tokens are never produced by encoding
            assert tok.decode(ids) == record.problem


def test_cached_by_spec_and_linked(cache):
    first = synthetic_policy_path(SPEC)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert synthetic_policy_path(SPEC) == first and (first / "model.safetensors").stat().st_mtime_ns == stamp
    other = synthetic_policy_path(SyntheticQwen2Spec(**{**SPEC.__dict__, "seed": 1}))  # any setting is in the key
    assert other != first and json.loads((other / "synthetic.json").read_text())["spec"]["seed"] == 1
    out = cache / "models" / "m"
    main(["--out", str(out), "--vocab-size", "2048", "--hidden-size", "64", "--heads", "1", "--kv-heads", "1",
          "--intermediate-size", "128", "--max-positions", "256"])  # fmt: skip
    assert out.is_symlink() and out.resolve() == first.resolve()
    link(out, other)  # re-pointed, not refused
    assert out.resolve() == other.resolve()
    (cache / "real").mkdir()
    with pytest.raises(FileExistsError):
        link(cache / "real", first)


def test_rejects_a_vocabulary_smaller_than_the_byte_alphabet():
    with pytest.raises(ValueError, match="vocab_size"):
        SyntheticQwen2Spec(vocab_size=100)
