"""The README documents the product: short, and its results blocks are exactly what
`qsa report` generates from the runs they name (so a table can not drift from its run)."""

from pathlib import Path

from qsa.workbench.report import BLOCK, update_readme

ROOT = Path(__file__).resolve().parents[1]


def test_readme_results_blocks_match_their_runs() -> None:
    readme = ROOT / "README.md"
    text, changed = update_readme(readme)
    assert BLOCK.search(readme.read_text()), "the README has no results block"
    assert not changed, f"regenerate with `qsa report --readme README.md`: {changed}"
    assert text == readme.read_text()


def test_readme_is_at_most_200_lines_and_has_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert "scripts/run.sh" in text and "scripts/test.sh" in text
