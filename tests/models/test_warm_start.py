"""The embedded warm start (`models.warm_start`): an interrupted build resumes where its last saved state left it and
ends with the weights of an uninterrupted build, bit for bit; its progress shows with an ETA."""

from __future__ import annotations

import pytest
import torch

from rlvr_lightning.models import warm_start as ws
from rlvr_lightning.models.embedded import build_char_tokenizer, build_tiny_qwen2

CFG = ws.WarmStartConfig(steps=12, warmup_steps=2, batch_size=8)


def fresh_model(tokenizer):
    return build_tiny_qwen2(tokenizer, CFG.spec, seed=CFG.seed)


class Interrupted(Exception):
    pass


def test_an_interrupted_build_resumes_and_ends_bit_for_bit_as_an_uninterrupted_one(tmp_path, monkeypatch):
    tokenizer = build_char_tokenizer()
    whole = fresh_model(tokenizer)
    loss_whole = ws.warm_start(whole, tokenizer, CFG)

    saves = []
    real_save = ws.save_build_state

    def save_then_stop(directory, model, opt, rng, step):  # a kill right after the state of step 7 was saved
        real_save(directory, model, opt, rng, step)
        saves.append(step)
        if step == 7:
            raise Interrupted

    monkeypatch.setattr(ws, "save_build_state", save_then_stop)
    first = fresh_model(tokenizer)
    with pytest.raises(Interrupted):
        ws.warm_start(first, tokenizer, CFG, resume_dir=tmp_path / "partial", save_every_s=0.0)  # save every step
    assert saves == list(range(1, 8)) and (tmp_path / "partial" / "state.pt").is_file()

    monkeypatch.setattr(ws, "save_build_state", real_save)
    resumed = fresh_model(tokenizer)  # a new process: the model built afresh, then the saved state loaded
    loss_resumed = ws.warm_start(resumed, tokenizer, CFG, resume_dir=tmp_path / "partial")
    assert loss_resumed == loss_whole
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_progress_shows_the_steps_and_an_eta(capsys):
    tokenizer = build_char_tokenizer()
    ws.warm_start(fresh_model(tokenizer), tokenizer, CFG)
    err = capsys.readouterr().err
    assert "warm start" in err and "12/12" in err and "<" in err  # tqdm: done/total [elapsed<remaining, rate]
