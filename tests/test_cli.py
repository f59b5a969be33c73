"""The `qsa` command line: help lists the commands, bad values are refused by name, and a bench
run lands in the results store."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from qsa.cli import app
from qsa.measure.results import load_runs

runner = CliRunner()


def test_help_lists_commands():
    out = runner.invoke(app, ["--help"]).output
    for cmd in ("bench", "step", "tune", "profile", "sweep", "run", "capacity", "offload-check",
                "ceilings", "info", "ab", "compile-check"):
        assert cmd in out


def test_bad_values_are_named():
    res = runner.invoke(app, ["bench", "--batch", "1x"])
    assert res.exit_code != 0 and "'1x' is not an integer" in res.output


def test_bench_writes_a_verified_run(tmp_path):
    res = runner.invoke(app, ["bench", "--op", "score_stacked,topk_expand", "--batch", "2",
                              "--context", "40", "--rows", "2", "--index-format", "mxfp4",
                              "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    df = load_runs(tmp_path, kind="bench")
    assert sorted(df["op"]) == ["score_stacked", "topk_expand"]
    assert df["verified"].all() and (df["index_format"] == "mxfp4").all()


def test_capacity_table_prints_ratios():
    res = runner.invoke(app, ["capacity", "--gib", "8"])
    assert res.exit_code == 0, res.output
    assert "mxfp4" in res.output
    assert "1.647" in res.output  # FP8 K/V, BF16 index, BF16 draft counted: spec section 5


def test_one_shape_commands_refuse_lists_and_bad_env():
    res = runner.invoke(app, ["step", "--context", "8K,32K"])
    assert res.exit_code != 0 and "takes one value" in res.output
    res = runner.invoke(app, ["step", "--phase", "prefill"])
    assert res.exit_code != 0 and "a prefill chunk needs its rows" in res.output
    res = runner.invoke(app, ["step", "--phase", "verify", "--rows", "8"])
    assert res.exit_code != 0 and "is not one of decode, prefill" in res.output
    res = runner.invoke(app, ["bench", "--env", "QSA_STACKED_DECODE_SCORER"])
    assert res.exit_code != 0 and "is not NAME=VALUE" in res.output


def _qsa(args, env_drop=("TRITON_INTERPRET",), timeout=300):
    """`python -m qsa.cli ARGS` in a fresh process (the interpreter choice happens at start)."""
    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    return subprocess.run([sys.executable, "-m", "qsa.cli", *args], capture_output=True,
                          text=True, env=env, timeout=timeout,
                          cwd=Path(__file__).resolve().parents[1])


def test_a_user_error_is_one_line_and_exit_2_and_verbose_shows_the_traceback():
    res = _qsa(["step", "--preset", "nope"])
    assert res.returncode == 2
    assert "error: preset: unknown preset 'nope'" in res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    res = _qsa(["--verbose", "step", "--preset", "nope"])
    assert res.returncode != 0 and "Traceback" in res.stderr and "ShapeError" in res.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
def test_without_a_gpu_bench_chooses_the_interpreter_itself(tmp_path):
    res = _qsa(["bench", "--op", "compress", "--batch", "1", "--context", "48", "--rows", "2",
                "--out", str(tmp_path)])
    assert res.returncode == 0, res.stderr[-2000:]
    assert "Triton interpreter" in res.stderr and "functional" in res.stdout
    df = load_runs(tmp_path, kind="bench")
    assert df["verified"].all() and df["functional_only"].all()


@pytest.mark.slow
def test_notebook_runs_a_py_notebook_with_parameters_and_refuses_typos(tmp_path):
    nb = "tests/fixtures/notebooks/sweep_point.py"
    out = tmp_path / "run.ipynb"
    res = _qsa(["notebook", nb, "-p", "value=3", "-p", f"results_root={tmp_path / 'store'}",
                "--out", str(out)], env_drop=())
    assert res.returncode == 0, res.stderr[-2000:]
    assert out.is_file() and (load_runs(tmp_path / "store")["value"] == 3).all()
    run_dir = next((tmp_path / "store").glob("*/*-sweep-fixture-*"))
    assert f"results: {run_dir}" in res.stdout  # where the results went
    assert "Executing" in res.stderr  # papermill's per-cell progress
    res = _qsa(["notebook", nb, "-p", "valu=3"], env_drop=())
    assert res.returncode == 2 and "unknown parameters ['valu']" in res.stderr
    if not torch.cuda.is_available():
        res = _qsa(["notebook", "decode_scoring_sweep", "-p", "profile=gpu"])
        assert res.returncode == 2 and "profile=gpu asked for" in res.stderr


@pytest.mark.slow
def test_compare_two_runs_writes_the_table_and_the_figure(tmp_path):
    for _ in range(2):
        res = runner.invoke(app, ["bench", "--op", "compress", "--batch", "1", "--context", "48",
                                  "--rows", "2", "--out", str(tmp_path / "store")])
        assert res.exit_code == 0, res.output
    a, b = sorted((tmp_path / "store").glob("*/*-bench-*"))
    inputs = {p: p.stat().st_mtime_ns for run in (a, b) for p in run.rglob("*")}
    res = runner.invoke(app, ["compare", str(a), str(b), "--out", str(tmp_path / "cmp")])
    assert res.exit_code == 0, res.output
    assert "matched on" in res.output and "incomparable 1" in res.output  # interpreter times
    assert (tmp_path / "cmp" / "compare.csv").is_file()
    assert (tmp_path / "cmp" / "compare.png").is_file()
    res = runner.invoke(app, ["compare", str(a), str(b), "--root", str(tmp_path / "store")])
    assert res.exit_code == 0, res.output
    (made,) = (tmp_path / "store").glob("*/compare/*-compare-*")
    assert {p.name for p in made.iterdir()} >= {"compare.csv", "compare.json", "compare.png"}
    assert {p: p.stat().st_mtime_ns for run in (a, b) for p in run.rglob("*")} == inputs
    res = _qsa(["compare", str(tmp_path), str(b)])
    assert res.returncode == 2 and "neither a run" in res.stderr
    res = _qsa(["compare", str(a), str(b), "--out", str(b / "cmp")])
    assert res.returncode == 2 and "is inside input B" in res.stderr
    assert len(res.stderr.splitlines()) == 2 and not (b / "cmp").exists()


def _one_line_error(res, text: str) -> None:
    """Exit 2, the error on one line (and the --verbose hint), no traceback."""
    assert res.returncode == 2, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and text in lines[0], lines
    assert "Traceback" not in res.stdout + res.stderr


def test_a_malformed_sweep_spec_names_its_line_and_column(tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text("name: x\nnotebook: decode_scoring_sweep\ngrid: {batch: [1, 8}\n")
    res = _qsa(["sweep", str(spec), "--out", str(tmp_path / "out")])
    _one_line_error(res, f"{spec}: not valid YAML: line 3, column 20: while parsing a flow")
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
def test_tune_write_without_a_gpu_is_refused_before_the_search(tmp_path):
    res = _qsa(["tune", "score_stacked", "--write", "--out", str(tmp_path)], timeout=60)
    _one_line_error(res, "--write: no GPU")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("args, text", [
    (["--batch", "-1"], "batch: must be >= 1, got -1"),
    (["--index-format", "int4"], "index format 'int4' is not one of"),
])
def test_bench_refuses_a_bad_shape_or_format_before_a_run_opens(tmp_path, args, text):
    res = _qsa(["bench", "--op", "compress", "--context", "48", "--rows", "2", *args,
                "--out", str(tmp_path)])
    _one_line_error(res, text)
    assert not any(tmp_path.iterdir())


def test_offload_check_names_the_page_count_given():
    _one_line_error(_qsa(["offload-check", "--pages", "-3"]), "--pages: must be >= 1, got -3")


@pytest.mark.slow
def test_help_pages_do_not_announce_the_interpreter():
    for args in (["--help"], ["bench", "--help"], ["tune", "--help"]):
        res = _qsa(args)
        assert res.returncode == 0 and "no GPU" not in res.stderr + res.stdout, args


@pytest.mark.slow
def test_a_failing_notebook_cell_is_one_line_naming_the_executed_notebook(tmp_path):
    out = tmp_path / "run.ipynb"
    res = _qsa(["notebook", "tests/fixtures/notebooks/sweep_point.py", "-p", "fail_values=[2]",
                "-p", "value=2", "-p", f"results_root={tmp_path}", "--out", str(out)],
               env_drop=())
    assert res.returncode == 1
    (line,) = [x for x in res.stdout.splitlines() if "raised" in x]
    assert "ValueError: deliberate failure at value=2" in line and str(out) in line
    assert "Traceback" not in res.stdout + res.stderr and out.is_file()


def test_piped_tables_are_not_cut_and_counts_print_as_integers():
    wide = {f"column_{i}": ["a value long enough to need room"] for i in range(4)}
    code = ("import pandas as pd; from qsa.cli import _print_frame; "
            f"_print_frame(pd.DataFrame({{**{wide!r}, 'context': [16384.0], 'us': [3.25]}}), 't')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "COLUMNS": ""})
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.count("a value long enough to need room") == 4
    assert "16384" in res.stdout and "1.638e+04" not in res.stdout and "3.25" in res.stdout


def test_tune_candidates_inline_or_from_a_file(tmp_path, monkeypatch):
    """`qsa tune --candidates` hands the parsed changes to the tuner; bad JSON, a non-list and
    a combination with --all are refused by name."""
    import pandas as pd

    import qsa.workbench.tune as tune_mod

    seen = []

    def fake_tune(op, **kw):
        seen.append(kw["candidates"])
        return pd.DataFrame([{"candidate": 0, "status": "ok", "us": 1.0, "p10_us": 1.0,
                              "p90_us": 1.0, "config": "{}"}])

    monkeypatch.setattr(tune_mod, "tune", fake_tune)
    changes = [{"meta": {"SLOTS": 1}}, {"num_warps": 8}]
    path = tmp_path / "c.json"
    path.write_text(json.dumps(changes))
    for given in (json.dumps(changes), str(path)):
        res = runner.invoke(app, ["tune", "sparse_gqa_decode", "--candidates", given,
                                  "--out", str(tmp_path / "store")])
        assert res.exit_code == 0, res.output
    assert seen == [changes, changes]
    path.with_name("bad.json").write_text("[{")
    for bad, msg in (("[{", "inline JSON is not valid JSON"),
                     ('{"num_warps": 8}', "expected a JSON list"),
                     (str(path.with_name("bad.json")), "bad.json is not valid JSON"),
                     (str(tmp_path / "missing.json"), "neither inline JSON nor a readable file"),
                     ("x" * 300, "neither inline JSON nor a readable file")):
        res = runner.invoke(app, ["tune", "sparse_gqa_decode", "--candidates", bad])
        text = "".join(res.output.replace("│", " ").split())  # the error box wraps lines
        assert res.exit_code != 0 and "".join(msg.split()) in text, res.output
    res = runner.invoke(app, ["tune", "--all", "--candidates", "[]"])
    assert res.exit_code != 0 and "one op's changes" in res.output


def test_tune_all_covers_a_prefill_chunk(tmp_path, monkeypatch):
    """`qsa tune --all --phase prefill` hands the tuner every kernel call of one prefill chunk
    (--rows rows per request, one request by default) for each format pair, the draft layer's
    included; --phase without --all and a chunk past its context are refused by name."""
    import pandas as pd

    import qsa.workbench.tune as tune_mod

    seen = []

    def fake_tune_all(points, **kw):
        seen.extend(points)
        return pd.DataFrame([{"op": pt.op, "status": "tuned"} for pt in points])

    monkeypatch.setattr(tune_mod, "tune_all", fake_tune_all)
    res = runner.invoke(app, ["tune", "--all", "--phase", "prefill", "--rows", "64",
                              "--context", "256", "--formats", "bf16/bf16,fp8/fp8",
                              "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert {pt.op for pt in seen} == {"compress", "kv_store", "score_prefill", "topk_expand",
                                      "sparse_gqa_prefill"}
    assert {(pt.batch, pt.context, pt.rows) for pt in seen} == {(1, 256, 64)}
    assert {pt.kv_format for pt in seen if pt.op == "sparse_gqa_prefill"} == {"bf16", "fp8"}
    res = runner.invoke(app, ["tune", "sparse_gqa_prefill", "--phase", "prefill"])
    assert res.exit_code != 0 and "with --all only" in res.output
    for args, msg in ((["--rows", "512", "--context", "256"], "do not fit a context of 256"),
                      (["--phase", "prefil"], "'prefil' is not one of decode, prefill")):
        res = runner.invoke(app, ["tune", "--all", "--phase", "prefill", *args,
                                  "--out", str(tmp_path)])
        assert res.exit_code != 0 and msg in res.output, res.output


def test_sweep_summary_prints_bracketed_errors_verbatim(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    """A failed point's error quotes shapes in brackets ("expected [blocks, 16, 8, 128]"); the
    summary must show them, not take them for markup."""
    import qsa.workbench.sweep as sweep_mod

    class Summary:
        ok = False

        def __str__(self) -> str:
            return "  FAILED value=1: KernelInputError: expected [blocks, 16, 8, 128], got [3]"

    monkeypatch.setattr(sweep_mod, "run_sweep", lambda *a, **k: Summary())
    res = CliRunner().invoke(app, ["sweep", str(tmp_path / "spec.yaml")])
    assert res.exit_code == 1
    assert "expected [blocks, 16, 8, 128], got [3]" in res.output, res.output


def test_the_main_job_ends_with_the_command_that_opens_the_notebooks(monkeypatch):
    """`qsa run` installs only [dev]: it prints how to get JupyterLab, or just how to open it
    where it is installed already."""
    import importlib.util

    from qsa.workbench import notebook_run, sweep

    class Done:
        ok = True

        def __str__(self) -> str:
            return "sweep done"

    monkeypatch.setattr(sweep, "run_sweep", lambda spec, out: Done())
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "jupyterlab" else find(name, *a))
    res = runner.invoke(app, ["run"])
    assert res.exit_code == 0, res.output
    root = notebook_run.NOTEBOOK_DIR.parent
    line = res.output.strip().splitlines()[-1]
    assert line.startswith("open the notebooks in JupyterLab: ")
    assert f"pip install -c {root / 'constraints.txt'} -e '{root}[lab]' && " in line
    assert line.endswith(f"jupyter lab {notebook_run.NOTEBOOK_DIR}")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert notebook_run.lab_command().endswith(f"jupyter lab {notebook_run.NOTEBOOK_DIR}")
    assert "pip install" not in notebook_run.lab_command()
