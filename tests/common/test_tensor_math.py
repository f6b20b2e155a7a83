"""The shared tensor formulas (`tensor_math`) at their edges: the binary KL between equal policies and where one
has no mass."""

from __future__ import annotations

import math

import pytest
import torch


def test_the_binary_kl_is_zero_between_equal_policies_and_infinite_where_one_has_no_mass():
    from rlvr_lightning.tensor_math import binary_kl

    logp = torch.tensor([0.0, math.log(0.3), -math.inf, math.log(0.3)])
    logq = torch.tensor([0.0, math.log(0.3), -math.inf, -math.inf])
    d = binary_kl(logp, logq)
    assert d[:3].tolist() == [0.0, 0.0, 0.0] and d[3].item() == math.inf
    assert binary_kl(torch.tensor([0.0]), torch.tensor([math.log(0.5)])).item() == pytest.approx(math.log(2))
