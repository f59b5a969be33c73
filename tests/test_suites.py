"""Benchmark suites: every shipped suite parses, malformed files are refused by name, targets
are computed over verified rows of one run only (twins matched on the whole point), and a suite
runs end to end into the results store."""

import json

import pandas as pd
import pytest

from qsa.measure.results import load_runs
from qsa.workbench.suites import (SuiteError, Target, load_suite, parse_suite, run_suite,
                                  suite_names)


def test_every_shipped_suite_parses():
    names = suite_names()
    assert {"headline", "decode", "attention", "prefill", "smoke"} <= set(names)
    for name in names:
        s = load_suite(name)
        assert s.points or s.steps
    head = load_suite("headline")
    ops = {p["op"] for p in head.points}
    assert {"sparse_gqa_decode", "score_stacked", "kv_store"} <= ops
    assert any(p.get("selection") == "random" for p in head.points)
    assert len(head.targets) >= 10


def test_the_headline_suite_has_top_k_over_32k_and_8k_candidates():
    """256 rows (batch 64 x 4 verify rows) over 32K candidates is batch 64 x 128K context (one
    candidate group per 4 tokens); the 8K-candidate row (batch 64 x 32K) stays beside it."""
    head = load_suite("headline")
    topk = [(p["batch"], p["context"]) for p in head.points if p["op"] == "topk_expand"]
    assert (64, 131072) in topk and (64, 32768) in topk
    assert head.preset.rows_per_verify * 64 == 256
    assert 131072 // head.preset.compress_ratio == 32768
    named = {t.name: t.where for t in head.targets if t.where.get("op") == "topk_expand"}
    assert named["top-k + expand, 256 rows x 32K candidates (b64 x 128K), us"]["context"] \
        == 131072


def test_a_suite_that_is_not_valid_yaml_names_the_line():
    with pytest.raises(ValueError, match=r"t.yaml: not valid YAML: line 2, column 1: while parsing a flow sequence"):
        parse_suite("name: [x\n", "t.yaml")


@pytest.mark.parametrize(("text", "message"), [
    ("name: x\ngrids: [{batch: 1}]", "'op' is required"),
    ("name: x\ngrids: [{op: compress, batchh: 1}]", "unknown keys ['batchh']"),
    ("name: x\ngrids: [{op: compress}]\ntargets: [{name: t, metric: ms, where: {}, min: 1}]",
     "metric 'ms'"),
    ("name: x\ngrids: [{op: compress}]\ntargets: [{name: t, metric: us, where: {}, min: 1, "
     "max: 2}]", "exactly one of min or max"),
    ("name: x\nsteps: [{batch: 1}]", "needs batch, context, formats"),
    ("name: x\nsteps: [{batch: 1, context: 64, formats: [bf16/bf16], phase: prefill}]",
     "a prefill step needs its rows"),
    ("name: x\nsteps: [{batch: 1, context: 64, formats: [bf16/bf16], rows: 8}]",
     "rows go with phase prefill"),
    ("name: x", "no grids and no steps"),
    ("name: x\ngrid: []", "unknown keys ['grid']"),
])
def test_malformed_suites_are_refused_by_name(text, message):
    with pytest.raises(SuiteError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_suite(text, "t.yaml")
    with pytest.raises(SuiteError, match="not found; suites: "):
        load_suite("no-such-suite")
    with pytest.raises(SuiteError, match="preset: head_dimm: not a preset field"):
        parse_suite("name: x\npreset: {head_dimm: 64}\ngrids: [{op: compress}]", "t.yaml")


def _rows() -> pd.DataFrame:
    base = {"record": "point", "op": "score_stacked", "context": 8192, "rows": 4,
            "kv_format": "bf16", "selection": "index"}
    return pd.DataFrame([
        {**base, "batch": 1, "index_format": "bf16", "us": 4.0, "verified": True},
        {**base, "batch": 1, "index_format": "fp8", "us": 2.0, "verified": True},
        {**base, "batch": 8, "index_format": "bf16", "us": 9.0, "verified": True},
        {**base, "batch": 8, "index_format": "fp8", "us": 6.0, "verified": True},
        {**base, "batch": 8, "index_format": "mxfp4", "us": None, "verified": False},
    ])


def test_targets_take_the_worst_verified_row_and_pair_twins_on_the_whole_point():
    rows = _rows()
    where = {"op": "score_stacked", "index_format": "fp8"}
    speed = Target("fp8 speedup", "us", where, 1.8, True, {"index_format": "bf16"}).evaluate(rows)
    assert speed["value"] == pytest.approx(1.5)  # batch 8: 9/6, not batch 1's 4/2 or 9/2
    assert speed["met"] is False and speed["miss_pct"] == pytest.approx(100 * 0.3 / 1.8)
    assert "batch=8" in speed["worst"]
    lat = Target("latency", "us", {"op": "score_stacked"}, 5.0, False).evaluate(rows)
    assert lat["value"] == 9.0 and lat["met"] is False and lat["unverified"] == 1
    ok = Target("b1", "us", {"batch": 1}, 5.0, False).evaluate(rows)
    assert ok["met"] is True and ok["miss_pct"] is None
    none = Target("mx", "us", {"index_format": "mxfp4"}, 5.0, False).evaluate(rows)
    assert none["value"] is None and none["met"] is None and none["unverified"] == 1


@pytest.mark.slow
def test_a_suite_runs_into_one_store_run(tmp_path):
    suite = parse_suite("""
name: tiny
preset: {name: qwen3.8-flash-next, head_dim: 64, topk_groups: 8, block_size: 16}
grids:
  - {op: score_stacked, batch: 2, context: 96, rows: 2, index_format: [bf16, fp8]}
  - {op: sparse_gqa_decode, batch: 2, context: 96, rows: 2, kv_format: fp8,
     selection: random}
targets:
  - {name: fp8 speedup, metric: us, where: {op: score_stacked, index_format: fp8},
     over: {index_format: bf16}, min: 0.000001}
  - {name: attention, metric: us, where: {op: sparse_gqa_decode}, max: 1.0e12}
  - {name: never measured, metric: us, where: {op: compress}, max: 1.0}
""", "tiny.yaml")
    directory, targets = run_suite(suite, tmp_path)
    df = load_runs(tmp_path, kind="suite")
    assert len(df) == 3 and df["verified"].all()
    for col in ("op", "index_format", "kv_format", "batch", "context", "rows", "median_us",
                "verified", "run_id", "selection"):
        assert col in df, col
    assert (df["run_id"] == directory.name).all()
    assert df.loc[df.op == "sparse_gqa_decode", "selection"].tolist() == ["random"]
    assert [t["met"] for t in targets] == [True, True, None]
    assert json.loads((directory / "targets.json").read_text()) == targets
    assert (directory / "roofline_intensity.svg").is_file()  # a figure with every run
    md = (directory / "targets.md").read_text()
    assert directory.name in md and "| never measured | n/a | <= 1 | not measured |" in md


def test_verify_only_checks_every_point_and_times_none(tmp_path):
    suite = parse_suite("""
name: check
preset: {name: qwen3.8-flash-next, head_dim: 64, topk_groups: 8, block_size: 16}
grids:
  - {op: [compress, kv_store], batch: 2, context: 48, rows: 2, kv_format: fp8}
steps:
  - {batch: 1, context: 48, formats: [bf16/bf16]}
targets:
  - {name: t, metric: us, where: {op: compress}, max: 1.0}
""", "check.yaml")
    directory, targets = run_suite(suite, tmp_path, verify_only=True)
    df = load_runs(tmp_path, kind="suite")
    assert sorted(df["op"]) == ["compress", "kv_store"] and df["verified"].all()
    assert df["us"].isna().all() and "median_us" not in df  # nothing timed, no step run
    assert targets == []
