"""`python -m rlvr_lightning list` (`catalogue`): every preset, algorithm and piece, with their knobs."""

from __future__ import annotations

import re
from types import SimpleNamespace

from rlvr_lightning.pieces import KINDS
from tests.conftest import REPO


def test_list_names_every_preset_algorithm_and_piece(capsys):
    from rlvr_lightning.catalogue import main

    main([])
    out = SimpleNamespace(stdout=capsys.readouterr().out)
    for preset in (REPO / "configs" / "algo").glob("*.yaml"):
        assert re.search(rf"^  {re.escape(preset.stem)} ", out.stdout, re.M), preset.stem
    import rlvr_lightning.algos as algos

    for name in algos.__all__:
        assert name == "RLVRModule" or re.search(rf"^  {name} ", out.stdout, re.M), name
    for registry in KINDS:
        assert f"--model.init_args.{registry.key}" in out.stdout
        for piece in (p for p in registry.pieces() if p.fn.__module__.startswith("rlvr_lightning.")):
            assert re.search(rf"^    {re.escape(piece.name)} .*\({re.escape(piece.docs)}\)$", out.stdout, re.M), piece.name
    # Each piece's knobs with their defaults, and each algorithm's pieces with the knobs it sets.
    assert "[knobs: clip_eps_low=0.2, clip_eps_high=0.2, dual_clip_c=None]" in out.stdout
    assert "[knobs: clip_eps_low=0.2, clip_eps_high=0.2, clip_cov_ratio=0.0002, clip_cov_lb=1.0, clip_cov_ub=5.0]" in out.stdout
    assert "[knobs: pass_at_k=4]" in out.stdout and "[knobs: tis_cap=2.0]" in out.stdout
    assert "policy_loss=ppo-clip(clip_eps_high=0.28)" in out.stdout  # DAPO's
    assert "policy_loss=gspo(clip_eps_low=0.0003, clip_eps_high=0.0004)" in out.stdout  # GSPO's
