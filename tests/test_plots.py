"""Figure export: files are written, and their content (axes, labels, series, annotations,
captions) is what the table says - checked on the Figure and in the SVG text."""

from __future__ import annotations

import json
from itertools import product
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib.collections import PolyCollection
from matplotlib.patches import Rectangle

from qsa.measure.results import start_run
from qsa.workbench import plots
from support import FakeDevice

BATCHES = (1, 4, 16)
CONTEXTS = (8192, 32768, 131072)
FORMATS = ("bf16", "fp8")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def decode_table(functional: bool = False) -> pd.DataFrame:
    """Decode-scoring records shaped like ops.measure's: stacked 2x faster except at batch 1."""
    rows = []
    for fmt, b, c, op in product(FORMATS, BATCHES, CONTEXTS, ("score_rowwise", "score_stacked")):
        us = 2.0 + b * c / 4096 / (2 if fmt == "fp8" else 1)
        if op == "score_stacked" and b > 1:
            us /= 2
        rows.append({"run_id": "20250101-000000-decode-scoring-abcdef",
                     "device": "cpu-interpreter" if functional else "nvidia-h200",
                     "kind": "decode-scoring", "op": op, "preset": "qwen3.8-flash-next",
                     "batch": b, "context": c, "rows": 4, "index_format": fmt,
                     "kv_format": "bf16", "us": us, "p10_us": us * 0.98, "p90_us": us * 1.02,
                     "iqr_us": us * 0.02, "samples_us": list(us * np.linspace(0.98, 1.02, 20)),
                     "method": "graph_replay",
                     "cache_policy": "rotate_150MiB_x3", "functional_only": functional,
                     "verified": True,
                     "pct_bandwidth": None if functional else min(95.0, 10 + b * c / 1e5),
                     "pct_matrix": None if functional else 3.0})
    return pd.DataFrame(rows)


def check_files(result: plots.FigureResult, title: str) -> str:
    """Every format written and non-trivial; returns the SVG text after checking the title."""
    png, svg, pdf = result.paths
    assert png.suffix == ".png" and svg.suffix == ".svg" and pdf.suffix == ".pdf"
    assert pdf.read_bytes()[:5] == b"%PDF-"
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 5000
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and "</svg>" in text
    assert title in text  # text stays text (svg.fonttype none)
    return text


def data_axes(fig) -> list:
    return [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]


def test_latency_vs_context_draws_one_line_per_batch_and_op(tmp_path: Path) -> None:
    df = decode_table()
    res = plots.latency_vs_context(df, tmp_path, title="Decode latency")
    svg = check_files(res, "Decode latency")
    axes = data_axes(res.figure)
    assert len(axes) == len(FORMATS)
    for ax, fmt in zip(axes, FORMATS):
        assert ax.get_title() == f"index_format {fmt}"
        assert len(ax.get_lines()) == len(BATCHES) * 2
        assert len([c for c in ax.collections if isinstance(c, PolyCollection)]) == 6  # p10-p90
        assert ax.get_xlabel() == "context (tokens)"
        assert [t.get_text() for t in ax.get_xticklabels()] == ["8K", "32K", "128K"]
        assert ax.get_yscale() == "log"
        line = next(ln for ln in ax.get_lines() if ln.get_label() == "batch 4, op score_stacked")
        want = df[(df.index_format == fmt) & (df.batch == 4) & (df.op == "score_stacked")]
        assert list(line.get_ydata()) == pytest.approx(want.sort_values("context")["us"].tolist())
    assert axes[0].get_ylabel() == "latency per call"
    fmt = axes[0].yaxis.get_major_formatter()
    assert [fmt(v) for v in (3.2, 5000, 12_000, 500_000, 2.5e7)] == [
        "3.2 µs", "5000 µs", "12 ms", "500 ms", "25 s"]  # ms past 10,000 µs, never "500k µs"
    legend = res.figure.legends[0]
    assert len(legend.get_texts()) == len(BATCHES) * 2
    assert "device nvidia-h200" in svg and "timed by graph replay (each call captured" in svg
    assert "cold cache (inputs rotated" in svg and "functional" not in svg.lower()


def test_speedup_heatmap_cells_and_noise_marks(tmp_path: Path) -> None:
    df = decode_table()
    res = plots.speedup_heatmap(df, tmp_path, title="Stacked vs row-wise")
    check_files(res, "Stacked vs row-wise")
    axes = data_axes(res.figure)
    assert len(axes) == len(FORMATS)
    texts = [t.get_text() for t in axes[0].texts]
    assert len(texts) == len(BATCHES) * len(CONTEXTS)
    # batch 1: identical times -> within noise, marked; batch > 1: a clear 2x
    assert texts.count("≈1.00x") == len(CONTEXTS)
    assert texts.count("2.00x") == 2 * len(CONTEXTS)
    assert [t.get_text() for t in axes[0].get_yticklabels()] == ["1", "4", "16"]
    assert axes[0].get_ylabel() == "batch" and axes[0].get_xlabel() == "context (tokens)"
    assert len(res.figure.axes) == len(FORMATS) + 1  # plus the colorbar
    bar = res.figure.axes[-1]
    ticks = [t.get_text() for t in bar.get_yticklabels()]
    assert ticks[-1] == "2x" and ticks[0] == "0.5x"  # the bar reaches the largest cell


def test_the_speedup_colour_bar_is_labelled_at_its_end(tmp_path: Path) -> None:
    df = decode_table()
    df.loc[df.op == "score_stacked", "us"] /= 1.5  # 3x at batch > 1: between powers of two
    df["samples_us"] = [list(u * np.linspace(0.98, 1.02, 20)) for u in df["us"]]
    res = plots.speedup_heatmap(df, tmp_path)
    ticks = [t.get_text() for t in res.figure.axes[-1].get_yticklabels()]
    assert ticks[-1] == "3x" and "2x" in ticks


def test_speedup_heatmap_needs_both_variants(tmp_path: Path) -> None:
    df = decode_table()
    with pytest.raises(ValueError, match="score_stacked"):
        plots.speedup_heatmap(df[df.op == "score_rowwise"], tmp_path)


def test_ceiling_share_chart_plots_fractions_per_series(tmp_path: Path) -> None:
    df = decode_table()
    df = df[df.index_format == "bf16"]
    res = plots.ceiling_share_chart(df, tmp_path, title="Limits test")
    check_files(res, "Limits test")
    axes = data_axes(res.figure)
    assert len(axes) == 4  # (bandwidth, matrix) x two ops
    bw, mx = axes[0], axes[2]
    assert bw.get_ylabel() == "% of copy bandwidth" and mx.get_ylabel() == "% of matrix rate"
    # one line per batch plus the 100% reference line
    assert len(bw.get_lines()) == len(BATCHES) + 1
    assert max(bw.get_lines()[-1].get_ydata()) == 100


def test_a_panel_without_data_is_left_out(tmp_path: Path) -> None:
    """The row-wise scorer does no matrix work: no all-zero "% of matrix rate" row."""
    df = decode_table()
    df = df[df.index_format == "bf16"].assign(pct_matrix=0.0)
    axes = data_axes(plots.ceiling_share_chart(df, tmp_path).figure)
    assert [ax.get_ylabel() for ax in axes] == ["% of copy bandwidth"] * 2
    # only the row-wise op lacks matrix work: its matrix panel alone is left out
    df.loc[df.op == "score_stacked", "pct_matrix"] = 3.0
    axes = data_axes(plots.ceiling_share_chart(df, tmp_path).figure)
    shown = [(ax.get_title() or "", ax.get_ylabel()) for ax in axes if ax.get_visible()]
    assert len(shown) == 3 and sum(label == "% of matrix rate" for _, label in shown) == 1


def test_functional_runs_say_so_and_plot_no_ceiling_share(tmp_path: Path) -> None:
    df = decode_table(functional=True)
    res = plots.ceiling_share_chart(df, tmp_path, name="roof")
    svg = check_files(res, "functional run - times mean nothing")
    assert "FUNCTIONAL RUN - TIMES MEAN NOTHING" in svg
    assert "cold cache" not in svg  # the interpreter has no cache to be cold
    ax = data_axes(res.figure)[0]
    assert not ax.get_lines() and "no share" in ax.texts[0].get_text()
    lat = plots.latency_vs_context(df, tmp_path, name="lat")
    assert "[functional run - times mean nothing]" in res.figure._suptitle.get_text()
    assert "FUNCTIONAL RUN" in lat.paths[1].read_text()


def test_step_stacked_bars_stack_each_kernel(tmp_path: Path) -> None:
    kernels = {"score_stacked": 30.0, "sparse_gqa_decode": 50.0, "topk_expand": 20.0}
    rows = [{"kernel": k, "us_per_step": v * b, "batch": b, "context": 32768,
             "functional_only": False, "device": "nvidia-h200"}
            for b in (1, 8) for k, v in kernels.items()]
    replay = pd.DataFrame([{"batch": b, "context": 32768, "us_per_step": 90.0 * b}
                           for b in (1, 8)])
    res = plots.step_stacked_bars(pd.DataFrame(rows), tmp_path, totals=replay,
                                  title="Step test")
    check_files(res, "Step test")
    ax = data_axes(res.figure)[0]
    bars = [p for p in ax.patches if isinstance(p, Rectangle)]
    assert len(bars) == 2 * len(kernels) + 2  # and a graph-replay bar beside each stack
    # the sum on each stack and the replay on its own bar: no marker across the sum's label
    assert [t.get_text() for t in ax.texts] == ["100 µs", "800 µs", "90 µs", "720 µs"]
    replay = bars[-2:]
    assert [b.get_height() for b in replay] == [90.0, 720.0]
    assert all(b.get_x() > 0.3 + i for i, b in enumerate(replay))
    assert bars[0].get_height() == 50.0  # the largest kernel at the bottom
    assert ax.get_ylabel() == "time per decode step (stack: sum of kernels)"
    labels = [t.get_text() for t in res.figure.legends[0].get_texts()]
    assert labels == ["topk_expand", "score_stacked", "sparse_gqa_decode",  # top to bottom
                      "graph replay of the whole decode step"]


def tuning_table() -> pd.DataFrame:
    rows = []
    for i, (bn, warps) in enumerate(product((16, 32, 64), (2, 4, 8))):
        cfg = {"meta": {"BLOCK_N": bn, "MAX_TILES": 8}, "num_warps": warps, "num_stages": 2,
               "amd": {}}
        ok = not (bn == 64 and warps == 2)
        rows.append({"candidate": i, "is_current": i == 0, "config": json.dumps(cfg),
                     "status": "ok" if ok else "OutOfResources",
                     "us": 10.0 + abs(bn - 32) / 4 + warps if ok else float("nan"),
                     "functional_only": False, "op": "score_stacked",
                     "device": "nvidia-h200"})
    return pd.DataFrame(rows)


def test_config_heatmap_marks_the_winner(tmp_path: Path) -> None:
    res = plots.config_heatmap(tuning_table(), tmp_path, title="Tuning test")
    svg = check_files(res, "Tuning test")
    ax = data_axes(res.figure)[0]
    assert {ax.get_ylabel(), ax.get_xlabel()} == {"BLOCK_N", "num_warps"}
    texts = [t.get_text() for t in ax.texts]
    assert len(texts) == 9 and texts.count("—") == 1  # the failed candidate has no time
    box = [p for p in ax.patches if isinstance(p, Rectangle) and not p.get_fill()]
    assert len(box) == 1
    assert "winner BLOCK_N=32, num_warps=2" in svg or "winner num_warps=2, BLOCK_N=32" in svg


def test_expand_config_accepts_the_default_marker() -> None:
    df = pd.DataFrame({"config": ["null", json.dumps({"meta": {"B": 1}, "num_warps": 4,
                                                       "amd": {"kpack": 1}})]})
    wide = plots.expand_config(df)
    assert wide.loc[1, "B"] == 1 and wide.loc[1, "num_warps"] == 4
    assert wide.loc[1, "amd_kpack"] == 1 and pd.isna(wide.loc[0, "B"])


def test_grouped_bars_one_bar_per_group_and_x(tmp_path: Path) -> None:
    df = pd.DataFrame([{"preset": p, "kv": kv, "index": ix, "tokens_per_gib": t}
                       for p in ("a", "b") for kv in ("bf16", "fp8")
                       for ix, t in (("bf16", 100.0), ("mxfp4", 120.0))])
    res = plots.grouped_bars(df, tmp_path, x="kv", y="tokens_per_gib", group="index",
                             facet="preset", name="cap", title="Capacity test",
                             ylabel="tokens per GiB")
    svg = check_files(res, "Capacity test")
    axes = data_axes(res.figure)
    assert len(axes) == 2
    assert len([p for p in axes[0].patches if isinstance(p, Rectangle)]) == 4
    assert "functional" not in svg.lower()  # no times in the table: exact on any device


@pytest.mark.slow
def test_figures_for_run_regenerates_every_figure(tmp_path: Path) -> None:
    records = decode_table().drop(columns=["run_id", "device", "kind"]).to_dict("records")
    with start_run("decode-scoring", root=tmp_path, device=FakeDevice()) as run:
        run.add_many(records)
    paths = plots.figures_for_run(run.directory)
    names = sorted(p.name for p in paths)
    assert names == sorted(f"{n}.{ext}" for n in ("latency", "speedup",
                                                   "ceiling_share_index_formatbf16",
                                                   "ceiling_share_index_formatfp8")
                           for ext in plots.FORMATS)
    assert all(p.parent == run.directory / "figures" for p in paths)
    svg = (run.directory / "figures" / "latency.svg").read_text()
    assert "NVIDIA H200" in svg and "torch 2.11.0" in svg and run.run_id in svg
    assert plots.figures_for(pd.DataFrame(), "decode-scoring", tmp_path) == []
    assert plots.figures_for(decode_table(), "unknown-kind", tmp_path) == []


def test_figures_script_finds_runs_below_a_folder(tmp_path: Path) -> None:
    import runpy

    with start_run("formats-attention-error", root=tmp_path, device=FakeDevice()) as run:
        run.add_many([{"context": c, "fp8_dtype": "float8_e4m3fn", "rel_err_mean": 0.05,
                       "rel_err_min": 0.04, "rel_err_max": 0.06} for c in (1024, 4096)])
    script = Path(__file__).resolve().parents[1] / "scripts" / "figures.py"
    main = runpy.run_path(str(script))["main"]
    assert main([str(tmp_path)]) == 0
    assert (run.directory / "figures" / "attention_error.svg").is_file()


@pytest.mark.slow
def test_recipes_never_mix_presets_in_one_figure(tmp_path: Path) -> None:
    one = decode_table()
    two = one.assign(preset="qwen3.8-flash-next-tp2", us=one["us"] / 2)
    figs = plots.figures_for(pd.concat([one, two], ignore_index=True), "decode-scoring", tmp_path)
    names = sorted(f.paths[0].stem for f in figs)
    assert "latency_presetqwen3.8-flash-next" in names
    assert "speedup_presetqwen3.8-flash-next-tp2" in names
    assert len(figs) == 2 * (2 + len(FORMATS))  # latency, speedup, ceiling shares per format
    lat = next(f for f in figs if f.paths[0].stem == "latency_presetqwen3.8-flash-next-tp2")
    assert "preset qwen3.8-flash-next-tp2" in lat.figure._suptitle.get_text()
    assert len(data_axes(lat.figure)[0].get_lines()) == len(BATCHES) * 2


def test_intensity_roofline_draws_the_measured_roofs_and_every_point(tmp_path: Path) -> None:
    rows = pd.DataFrame([
        {"op": "score_stacked", "index_format": f, "kv_format": "bf16", "us": 100.0,
         "intensity_flop_per_byte": i, "achieved_tflops": t, "pct_bandwidth": 100 * t * 1e3
         / i / 4088, "pct_matrix": 100 * t / 795, "device": "nvidia-h200", "method": "graph"}
        for f, i, t in (("bf16", 1.0, 3.9), ("fp8", 1.9, 6.0), ("mxfp4", 3.7, 5.5))
    ] + [{"op": "score_prefill", "index_format": "bf16", "kv_format": "bf16", "us": 700.0,
          "intensity_flop_per_byte": 900.0, "achieved_tflops": 346.8,
          "pct_bandwidth": 100 * 346.8e3 / 900 / 4088, "pct_matrix": 100 * 346.8 / 795,
          "device": "nvidia-h200", "method": "graph"}])
    res = plots.intensity_roofline(rows, tmp_path, title="Roofline test")
    svg = check_files(res, "Roofline test")
    assert "copy bandwidth 4,088 GB/s" in svg and "matrix 795 TFLOP/s" in svg
    ax = data_axes(res.figure)[0]
    assert ax.get_xscale() == ax.get_yscale() == "log"
    assert sum(len(c.get_offsets()) for c in ax.collections) == 4  # every point drawn


def test_the_roofline_names_its_roofs_and_tells_batches_apart(tmp_path: Path) -> None:
    rows = pd.DataFrame([
        {"op": "sparse_gqa_decode", "index_format": "bf16", "kv_format": kv, "batch": b,
         "us": 100.0, "intensity_flop_per_byte": 2.0 * b ** 0.5, "achieved_tflops": t,
         "pct_bandwidth": 100 * t * 1e3 / (2.0 * b ** 0.5) / 4088,
         "pct_matrix": 100 * t / roof, "bandwidth_ceiling": "copy", "matrix_ceiling": kv,
         "method": "graph_replay"}
        for kv, roof in (("bf16", 795.0), ("fp8", 1580.0)) for b, t in ((1, 2.0), (64, 12.0))])
    res = plots.intensity_roofline(rows, tmp_path, caption="device NVIDIA H200")
    texts = [t.get_text() for t in data_axes(res.figure)[0].texts]
    assert {"copy bandwidth 4,088 GB/s", "BF16 matrix 795 TFLOP/s",
            "FP8 matrix 1,580 TFLOP/s"} <= set(texts)
    sizes = {float(sz) for c in data_axes(res.figure)[0].collections
             if len(c.get_offsets()) for sz in c.get_sizes()}
    assert len(sizes) == 2  # batch 1 and batch 64 drawn at different sizes
    legend = [t.get_text() for t in res.figure.legends[0].get_texts()]
    assert "batch 1" in legend and "batch 64" in legend


def _tune_table(knobs: int) -> pd.DataFrame:
    """A `qsa tune` run's rows: the current entry first, candidates, one failed candidate."""
    rows = []
    for i, (bn, w) in enumerate(product((32, 64, 128), (2, 4) if knobs > 1 else (4,))):
        cfg = {"meta": {"BLOCK_N": bn}, "num_warps": w, "num_stages": 3, "amd": {}}
        us = 100.0 + abs(bn - 64) / 4 + (10 if w == 2 else 0)
        rows.append({"candidate": i, "is_current": i == 0, "config": json.dumps(cfg),
                     "status": "ok", "us": us, "p10_us": us - 1, "p90_us": us + 2,
                     "op": "sparse_gqa_decode", "preset": "qwen3.8-flash-next", "batch": 64,
                     "context": 131072, "rows": 4, "index_format": "bf16", "kv_format": "fp8",
                     "arch": "sm90", "method": "graph_replay", "functional_only": False,
                     "device": "nvidia-h200"})
    rows.append({**rows[-1], "candidate": len(rows), "is_current": False, "status":
                 "OutOfResources", "us": float("nan"), "config": json.dumps(
                     {"meta": {"BLOCK_N": 512}, "num_warps": 4, "num_stages": 6, "amd": {}})})
    return pd.DataFrame(rows)


def test_tune_runs_draw_the_ranked_candidates_and_the_config_space(tmp_path: Path) -> None:
    figs = plots.figures_for(_tune_table(2), "tune", tmp_path)
    stems = sorted(p.stem for f in figs for p in f.paths)
    assert any(s.startswith("candidates") for s in stems)
    assert any(s.startswith("config_heatmap") for s in stems)
    spread = next(f for f in figs if f.paths[0].stem.startswith("candidates"))
    ax = spread.figure.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert len(labels) == 6 and labels[0].startswith("BLOCK_N=")  # the failed one not drawn
    assert "6 verified, 1 failed" in spread.figure._suptitle.get_text()
    # one knob varied: the ranking alone, no heat map
    one = plots.figures_for(_tune_table(1), "tune", tmp_path / "one")
    assert [p.stem.startswith("candidates") for f in one for p in f.paths[:1]] == [True]


def test_step_runs_draw_decode_steps_and_prefill_chunks_apart(tmp_path: Path) -> None:
    base = {"preset": "qwen3.8-flash-next", "index_format": "bf16", "kv_format": "bf16",
            "batch": 1, "context": 65536, "mtp": 3, "method": "graph_replay",
            "functional_only": False, "device": "nvidia-h200"}
    rows = []
    for phase, chunk in (("decode", None), ("prefill", 4096)):
        for k, us in (("compress", 5.0), ("sparse_gqa", 50.0)):
            rows.append({**base, "step_phase": phase, "chunk_rows": chunk, "phase": "target",
                         "kernel": k, "us_per_step": us * 12})
        rows.append({**base, "step_phase": phase, "chunk_rows": chunk, "phase": "step",
                     "kernel": "graph replay", "us_per_step": 640.0})
    figs = plots.figures_for(pd.DataFrame(rows), "step", tmp_path)
    stems = sorted(f.paths[0].stem for f in figs)
    assert len(stems) == 2 and stems[0].startswith("prefill_step") \
        and stems[1].startswith("step_breakdown")
    prefill = next(f for f in figs if f.paths[0].stem.startswith("prefill_step"))
    assert data_axes(prefill.figure)[0].get_ylabel() == \
        "time per prefill chunk (stack: sum of kernels)"
    # two format pairs of one shape: also side by side, in one figure per phase
    fp8 = [{**r, "index_format": "fp8", "kv_format": "fp8"} for r in rows]
    both = plots.figures_for(pd.DataFrame(rows + fp8), "step", tmp_path / "both")
    side = sorted(f.paths[0].stem for f in both if f.paths[0].stem.startswith("step_formats"))
    assert side == ["step_formats_step_phasedecode", "step_formats_step_phaseprefill"]


def test_suite_runs_caption_the_device_and_draw_each_steps_formats(tmp_path: Path) -> None:
    meta = {"device": {"slug": "nvidia-h100-80gb-hbm3", "name": "NVIDIA H100 80GB HBM3"},
            "versions": {"torch": "2.11.0", "triton": "3.6.0"}, "git": {"commit": "unknown"}}
    step = [{"record": "step", "suite": "headline", "preset": "qwen3.8-flash-next",
             "batch": 32, "context": 32768, "mtp": 3, "index_format": f, "kv_format": f,
             "phase": ph, "kernel": k, "us_per_step": us, "method": "graph_replay",
             "functional_only": False}
            for f in ("bf16", "fp8") for ph, k, us in (("target", "sparse_gqa_decode", 1500.0),
                                                       ("step", "graph replay", 1600.0))]
    point = {"record": "point", "suite": "headline", "op": "score_stacked", "batch": 64,
             "index_format": "bf16", "kv_format": "bf16", "us": 10.0,
             "intensity_flop_per_byte": 2.0, "achieved_tflops": 4.0, "pct_bandwidth": 50.0,
             "pct_matrix": 1.0, "method": "graph_replay", "functional_only": False}
    figs = plots.figures_for(pd.DataFrame([point, *step]), "suite", tmp_path, [meta])
    assert sorted(f.paths[0].stem for f in figs) == ["roofline_intensity", "step"]
    for f in figs:
        svg = f.paths[1].read_text()
        assert "device NVIDIA H100 80GB HBM3" in svg and "torch 2.11.0" in svg
        assert "timed by graph replay" in svg


def test_profile_runs_draw_timing_against_the_profiler(tmp_path: Path) -> None:
    df = pd.DataFrame([{"op": "score_stacked", "profiler": "torch", "timing_us": 10.0,
                        "profiler_median_us": 10.4, "agree_within_noise": True,
                        "device": "nvidia-h200", "functional_only": False},
                       {"op": "score_stacked", "profiler": "proton", "timing_us": 10.1,
                        "profiler_median_us": 14.0, "agree_within_noise": False,
                        "device": "nvidia-h200", "functional_only": False}])
    [fig] = plots.figures_for(df, "profile", tmp_path)
    svg = check_files(fig, "timing module vs profiler")
    assert "score_stacked (torch): agree" in svg and "score_stacked (proton): differ" in svg
    heights = sorted(round(p.get_height(), 1) for p in fig.figure.axes[0].patches)
    assert heights == [10.0, 10.1, 10.4, 14.0]


def test_figures_are_png_unless_more_formats_are_asked_for(tmp_path, monkeypatch) -> None:
    """Results are committed as PNG: that is the default; `--figure-formats` (the
    environment variable it sets) adds SVG/PDF, and an unknown format is refused by name."""
    from matplotlib.figure import Figure

    from qsa.workbench import plots

    fig = Figure()
    fig.subplots().plot([0, 1])
    monkeypatch.delenv(plots.FORMATS_ENV, raising=False)
    assert [p.suffix for p in plots.save_figure(fig, tmp_path, "a")] == [".png"]
    monkeypatch.setenv(plots.FORMATS_ENV, "png,svg")
    assert [p.suffix for p in plots.save_figure(fig, tmp_path, "b")] == [".png", ".svg"]
    monkeypatch.setenv(plots.FORMATS_ENV, "png,tiff")
    with pytest.raises(ValueError, match="tiff"):
        plots.save_figure(fig, tmp_path, "c")
