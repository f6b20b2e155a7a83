"""Fixtures of the pieces' tests: the README's user module of pieces (`docs/examples/my_pieces.py`)."""

from __future__ import annotations

import pytest

from tests.conftest import REPO

EXAMPLES = REPO / "docs" / "examples"


@pytest.fixture
def my_pieces(monkeypatch):
    """The README's user module, importable as a user's would be (on the path, outside the package)."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import my_pieces

    return my_pieces
