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


def test_a_step_run_reports_its_steps() -> None:
    """A `qsa step` run (kernel calls and step totals, no benchmark points) gives its step
    table, each format pair against the first, and no points table."""
    from qsa.workbench.report import run_tables

    body = run_tables(Path(__file__).resolve().parents[1]
                      / "profiles/nvidia-h200/20261206-005913-step-b90ee5")
    lines = body.splitlines()
    assert lines[2] == "| step | index/KV | summed | graph replay |"
    assert lines[4].startswith("| decode, b32 x 32K, overlap 0 | bf16/bf16 | 2,346 µs | ")
    assert lines[5].startswith("| decode, b32 x 32K, overlap 0 | fp8/fp8 | 1,782 µs (1.32x) | ")
    assert "kernel, shape" not in body
