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


def test_points_name_their_implementation_where_a_run_has_two() -> None:
    """A run where some call ran the Gluon kernel says in each cell which implementation ran;
    a run of Triton calls only says nothing more."""
    import pandas as pd

    from qsa.workbench.report import points_table

    base = {"record": "point", "verified": True, "op": "sparse_gqa_decode", "batch": 64,
            "context": 131072, "rows": 4, "index_format": "bf16"}
    df = pd.DataFrame([{**base, "kv_format": "bf16", "us": 250.0, "impl": "triton"},
                       {**base, "kv_format": "fp8", "us": 125.0, "impl": "gluon"}])
    assert points_table(df).splitlines()[2] == (
        "| sparse_gqa_decode, b64 x 128K, 4 rows | 250.0 µs, triton | 125.0 µs (2.00x), gluon |")
    df["impl"] = "triton"
    assert points_table(df).splitlines()[2] == (
        "| sparse_gqa_decode, b64 x 128K, 4 rows | 250.0 µs | 125.0 µs (2.00x) |")
