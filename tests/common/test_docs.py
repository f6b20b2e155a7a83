"""The hand-written pages against the code: every built-in piece's docs section exists, the tables of the
algorithms page, the README and the configuration page list every registry, preset and piece, and the README
is a short guide whose links exist and whose worked example is the tested file (`docs/examples/my_pieces.py`)."""

from __future__ import annotations

import re

from rlvr_lightning.pieces import KINDS
from tests.conftest import REPO

EXAMPLES = REPO / "docs" / "examples"


def test_every_builtin_piece_names_a_docs_section_that_exists():
    anchors = {re.sub(r"[^\w\- ]", "", h.strip("# ").lower()).replace(" ", "-")
               for h in (REPO / "docs/algorithms.md").read_text().splitlines() if h.startswith("#")}  # fmt: skip
    for registry in KINDS:
        for piece in registry.pieces():
            if piece.fn.__module__.startswith("rlvr_lightning."):
                assert piece.anchor in anchors, (registry.kind, piece.name, piece.anchor)


def test_the_algorithms_pages_table_of_shared_pieces_lists_every_registry_and_piece():
    """Written by hand, it once listed five registries and none of a year's new pieces."""
    doc = (REPO / "docs/algorithms.md").read_text()
    assert f"one of {('one', 'two', 'three', 'four', 'five', 'six', 'seven', 'eight')[len(KINDS) - 1]} registries" in doc
    rows = {line.split("|")[2].strip().split()[0].strip("`"): line for line in doc.splitlines()
            if line.startswith("| ") and "`" in line.split("|")[2]}  # fmt: skip
    for registry in KINDS:
        listed = re.findall(r"`([^`]+)`", rows[registry.key].split("|")[3])
        assert listed == [p.name for p in registry.pieces() if p.fn.__module__.startswith("rlvr_lightning.")], registry.key


def test_the_readme_and_the_configuration_page_name_every_preset_and_builtin_piece():
    """Their tables of presets and pieces are written by hand: they must not drift from the code."""
    readme, config = (REPO / "README.md").read_text(), (REPO / "docs/configuration.md").read_text()
    for preset in sorted((REPO / "configs/algo").glob("*.yaml")):
        assert f"`{preset.stem}`" in readme, preset.stem
    for registry in KINDS:
        key = registry.key.rsplit(".", 1)[-1]
        rows = [line for page in (readme, config) for line in page.splitlines() if line.startswith(f"| `{key}` |")]
        assert len(rows) == 2, key
        for piece in registry.pieces():
            if piece.fn.__module__.startswith("rlvr_lightning."):
                assert all(f"`{piece.name}`" in row for row in rows), (key, piece.name)


def test_the_readme_is_a_short_guide_whose_links_exist_and_whose_example_is_the_tested_file():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert (EXAMPLES / "my_pieces.py").read_text() in readme
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.name} links {target}, which does not exist"
