"""Every notebook runs under papermill with its defaults (CPU: tiny shapes, interpreter) and
files its results and figures; the README's CPU sweep runs end to end; notebook sources stay
well-formed jupytext with one papermill parameters cell."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pandas as pd
import pytest

# GPU hosts whose python is a bare torch environment have no notebook tooling: these tests are
# then skipped there, with this reason, rather than stopping the GPU run at collection.
jupytext = pytest.importorskip("jupytext", reason="notebook tooling (jupytext) not installed")
nbformat = pytest.importorskip("nbformat", reason="notebook tooling (nbformat) not installed")

from qsa.measure.results import load_runs, start_run
from qsa.workbench import notebooks as wb
from qsa.workbench.sweep import load_sweep, run_sweep
from support import DEVICE, FakeDevice

REPO = Path(__file__).resolve().parents[1]
HAS_GPU = DEVICE != "cpu"
NOTEBOOKS = sorted(p.stem for p in (REPO / "notebooks").glob("*.py"))
# The run kinds each measuring notebook files, and whether their rows are timings.
KINDS = {
    "selection_overlap": {"bench": True, "step": True},
    "decode_scoring_sweep": {"decode-scoring": True},
    "prefill_sweep": {"prefill": True, "prefill-step": True},
    "sparse_gqa_decode": {"sparse-gqa-decode": True},
    "block_config_tuning": {"config-tuning": True},
    "step_breakdown": {"step-breakdown": True},
    "formats": {"formats-capacity": False, "formats-attention-error": False,
                "formats-topk-recall": False},
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("notebooks")


def run(name: str, workdir: Path, **params) -> nbformat.NotebookNode:
    out = workdir / f"{name}.ipynb"
    nb = wb.execute_notebook(REPO / "notebooks" / f"{name}.py", out, params)
    assert out.is_file()
    saved = nbformat.read(out, as_version=4)
    assert not saved.metadata.papermill.get("exception")
    errors = [o for c in saved.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.output_type == "error"]
    assert not errors
    return nb


def outputs_text(nb: nbformat.NotebookNode) -> str:
    parts = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            parts.append(o.get("text", "") + str(o.get("data", {}).get("text/markdown", "")))
    return "".join(parts)


def test_the_notebook_set_is_the_one_tested() -> None:
    assert set(NOTEBOOKS) == set(KINDS) | {"design_review"}


@pytest.mark.parametrize("name", [  # one notebook in the default lane, the rest with --full
    n if n == "block_config_tuning" else pytest.param(n, marks=pytest.mark.slow)
    for n in sorted(KINDS)])
def test_notebook_runs_with_cpu_defaults_and_files_results(name: str, workdir: Path) -> None:
    root = workdir / "profiles"
    nb = run(name, workdir, results_root=str(root))
    if not HAS_GPU:
        assert "TIMES MEAN NOTHING" in outputs_text(nb)
    for kind, timed in KINDS[name].items():
        df = load_runs(root, kind=kind)
        assert len(df) > 0, f"{name} filed no {kind} rows"
        [run_id] = df["run_id"].unique()
        run_dir = root / df["device"].iloc[0] / run_id
        if timed:
            assert df["functional_only"].fillna(False).astype(bool).all() != HAS_GPU
            ok = (df[df["status"] == "ok"] if "status" in df  # tuner: verified candidates
                  else df[df["verified"]] if "verified" in df else df)
            value = "us" if "us" in df else "us_per_step"
            assert len(ok) > 0 and (ok[value] > 0).all()
        figures = sorted((run_dir / "figures").iterdir())
        assert figures, f"{kind}: no figures"
        stems = {p.stem for p in figures}
        for stem in stems:
            for ext in ("png", "svg"):
                path = run_dir / "figures" / f"{stem}.{ext}"
                assert path.stat().st_size > 2000, path
            svg = (run_dir / "figures" / f"{stem}.svg").read_text()
            assert ("times mean nothing" in svg) == (timed and not HAS_GPU)


@pytest.mark.slow
def test_design_review_draws_every_stored_kind(workdir: Path) -> None:
    """Runs after the measuring notebooks on their results, plus one stored GPU-style run."""
    root = workdir / "profiles"

    with start_run("decode-scoring", root=root, device=FakeDevice()) as gpu_run:
        for op, us in (("score_rowwise", 40.0), ("score_stacked", 10.0)):
            for c in (8192, 32768):
                gpu_run.add({"op": op, "preset": "qwen3.8-flash-next", "batch": 8,
                             "context": c, "rows": 4, "index_format": "bf16",
                             "kv_format": "bf16", "us": us * c / 8192, "p10_us": us,
                             "p90_us": us, "iqr_us": 0.5, "method": "graph_replay",
                             "cache_policy": "rotate", "functional_only": False,
                             "verified": True, "pct_bandwidth": 50.0, "pct_matrix": 2.0})
    run("design_review", workdir, results_root=str(root))
    stored = load_runs(root)
    for slug, part in stored.groupby("device"):
        review = root / slug / "review"
        index = (review / "index.md").read_text()
        for kind in part["kind"].unique():
            pngs = list((review / kind).glob("*.png"))
            assert pngs, f"no review figures for {kind} on {slug}"
            for png in pngs:
                assert f"({kind}/{png.name})" in index
                assert png.with_suffix(".svg").stat().st_size > 2000
    gpu_svg = (root / "nvidia-h200" / "review" / "decode-scoring" / "speedup.svg").read_text()
    assert "NVIDIA H200" in gpu_svg and "times mean nothing" not in gpu_svg


@pytest.mark.slow
def test_design_review_with_no_results_says_so(workdir: Path) -> None:
    nb = run("design_review", workdir / "empty", results_root=str(workdir / "nothing"))
    assert "no finished runs" in outputs_text(nb)


@pytest.mark.slow
def test_readme_cpu_sweep_produces_notebooks_table_and_figures(tmp_path: Path) -> None:
    summary = run_sweep(REPO / "sweeps" / "decode_scoring_cpu.yaml", tmp_path, progress=False)
    assert summary.ok and (summary.passed, summary.failed) == (2, 0), str(summary)
    assert len(list(summary.sweep_dir.glob("points/*/notebook.ipynb"))) == 2
    table = pd.read_parquet(summary.results_path)
    assert set(table["index_format"]) == {"bf16", "fp8"}
    assert len(table) == len(load_sweep(summary.sweep_dir)) == 2 * 2 * 2 * 2
    assert summary.report_notebook is not None and summary.report_notebook.is_file()
    assert (summary.figures_dir / "index.md").is_file()
    assert {p.stem for p in (summary.figures_dir / "decode-scoring").glob("*.png")} >= {
        "latency", "speedup"}
    text = str(summary)
    for where in ("results table:", "report notebook:", "figures:"):
        assert where in text


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_source_is_canonical_jupytext_with_one_parameters_cell(
        name: str, caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    import papermill

    path = REPO / "notebooks" / f"{name}.py"
    nb = jupytext.read(path)
    again = jupytext.reads(jupytext.writes(nb, "py:percent"), "py:percent")
    assert [(c.cell_type, c.source, c.metadata.get("tags")) for c in again.cells] == [
        (c.cell_type, c.source, c.metadata.get("tags")) for c in nb.cells]  # stable round trip
    assert nb.metadata["kernelspec"]["name"] == "python3"
    params = wb.notebook_parameters(nb)
    assert "figures_dir" in params and "results_root" in params
    ipynb = tmp_path / f"{name}.ipynb"
    nbformat.write(nb, ipynb)
    with caplog.at_level(logging.WARNING, logger="papermill"):
        inferred = papermill.inspect_notebook(str(ipynb))
    assert set(inferred) == set(params)
    assert not [r for r in caplog.records if "Unable to parse" in r.getMessage()]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_saving_a_notebook_with_the_repository_config_changes_nothing(name: str) -> None:
    """What JupyterLab's jupytext writes on save (with notebooks/jupytext.toml) is the file
    itself: no version stamps or other header churn in git."""
    from jupytext.config import load_jupytext_configuration_file

    config = load_jupytext_configuration_file(str(REPO / "notebooks" / "jupytext.toml"))
    path = REPO / "notebooks" / f"{name}.py"
    assert jupytext.writes(jupytext.read(path), "py:percent", config=config) == \
        path.read_text()


def test_default_results_root_is_the_repository_profiles_wherever_the_kernel_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # JupyterLab starts kernels in notebooks/
    assert wb.results_root(None) == REPO / "profiles"
    assert wb.results_root("out") == Path("out")


def test_unknown_parameters_are_refused(tmp_path: Path) -> None:
    with pytest.raises(wb.NotebookError, match="unknown parameters"):
        wb.execute_notebook(REPO / "notebooks" / "formats.py", None, {"contexts": [1]})


def test_grid_and_preset_helpers() -> None:
    profiles = {"p": {"batch": [1, 2], "context": [256]}}
    assert wb.grid(profiles, "p", batch=4, context=None) == {"batch": [4], "context": [256]}
    assert wb.grid(profiles, "p", batch=[8, 16])["batch"] == [8, 16]
    with pytest.raises(wb.NotebookError, match="unknown profile"):
        wb.grid(profiles, "gpu")
    p = wb.make_preset("qwen3.8-flash-next", {"topk_groups": 32})
    assert p.name == "qwen3.8-flash-next+topk_groups=32" and p.topk_groups == 32
    assert wb.make_preset("qwen3.8-flash-next", {}).name == "qwen3.8-flash-next"


@pytest.mark.gpu
def test_decode_notebook_on_gpu_times_with_graphs_and_rooflines(tmp_path: Path) -> None:
    root = tmp_path / "profiles"
    run("decode_scoring_sweep", tmp_path, profile="gpu", batch=[1, 8], context=[8192, 16384],
        index_format=["bf16", "fp8"], results_root=str(root))
    df = load_runs(root, kind="decode-scoring")
    assert len(df) == 2 * 2 * 2 * 2
    assert not df["functional_only"].any() and df["verified"].all()
    assert set(df["method"]) <= {"graph_replay", "device_events"}
    assert df["pct_bandwidth"].notna().all()
    run_dir = root / df["device"].iloc[0] / df["run_id"].iloc[0]
    svg = (run_dir / "figures" / "roofline_index_formatbf16.svg").read_text()
    assert "times mean nothing" not in svg
    print(json.dumps(df.groupby(["index_format", "batch", "context", "op"])["us"].median()
                     .round(2).reset_index().to_dict("records")))


@pytest.mark.slow
def test_tuning_notebook_tries_given_configs_against_the_current_entry(workdir: Path) -> None:
    root = workdir / "given-configs"
    nb = run("block_config_tuning", workdir, results_root=str(root),
             config='[{"num_warps": 2, "meta": {"BLOCK_N": 16}}, {"num_warps": 8}]')
    df = load_runs(root, kind="config-tuning")
    assert len(df) == 3 and df["is_current"].tolist() == [True, False, False]
    assert '"num_warps": 2' in df["config"].iloc[1] and '"BLOCK_N": 16' in df["config"].iloc[1]
    assert '"num_warps": 8' in df["config"].iloc[2]
    shown = "".join(str(o.get("data", {}).get("text/plain", "")) for c in nb.cells
                    for o in c.get("outputs", []))
    assert "beyond_noise" in shown and "table is unchanged" in outputs_text(nb)
