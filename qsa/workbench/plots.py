"""Design-review figures from tidy result tables, in one style, exported as PNG and SVG.

Every function takes a DataFrame whose rows are measured points (the columns of
`qsa.workbench.ops.measure` records, plus what a notebook adds) and returns the Figure and the
paths it wrote. Figures are built on `matplotlib.figure.Figure` with no pyplot state, so a sweep
or a notebook can make hundreds without leaking, and rendering is Agg (PNG) and the SVG backend
whatever the interactive backend is. Every figure carries a caption with the device, versions
and run, and runs without a GPU say in the title and caption that their times mean nothing.
"""

from __future__ import annotations

import functools
import json
import math
import os
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from qsa.measure.timing import METHOD_EVENTS, METHOD_GRAPH, METHOD_HOST
from qsa.workbench.notebooks import FUNCTIONAL_NOTE

FORMATS = ("png", "svg", "pdf")  # PNG for slides, SVG and PDF for documents
# The formats every figure is written in: PNG unless QSA_FIGURE_FORMATS (set by
# `qsa --figure-formats png,svg,pdf`, inherited by the notebooks a sweep runs) asks for more;
# results are committed as PNG.
FORMATS_ENV = "QSA_FIGURE_FORMATS"


def figure_formats() -> tuple[str, ...]:
    """The formats asked for (FORMATS_ENV), each one of FORMATS; a bad list is refused."""
    asked = tuple(f.strip() for f in os.environ.get(FORMATS_ENV, "png").split(",") if f.strip())
    bad = [f for f in asked if f not in FORMATS]
    if bad or not asked:
        raise ValueError(f"figure formats {bad or asked!r}: choose from {', '.join(FORMATS)}")
    return asked
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
           "#17becf", "#7f7f7f", "#bcbd22")
LINESTYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P")
STYLE: dict[str, Any] = {
    "font.size": 9, "axes.titlesize": 9.5, "axes.labelsize": 9, "figure.titlesize": 11,
    "legend.fontsize": 7.5, "legend.frameon": False, "xtick.labelsize": 8, "ytick.labelsize": 8,
    "axes.grid": True, "grid.alpha": 0.3, "grid.linewidth": 0.6, "axes.spines.top": False,
    "axes.spines.right": False, "lines.linewidth": 1.6, "lines.markersize": 4,
    "savefig.dpi": 200, "savefig.bbox": "tight",  # presentation resolution
    # Text stays text in the SVG (reviewable, greppable), and ids are stable across runs so a
    # regenerated figure only shows up in a diff when its content changed.
    "svg.fonttype": "none", "svg.hashsalt": "qsa-workbench",
}
US = "latency per call"  # the ticks carry the unit (`_duration`)


@dataclass(frozen=True)
class FigureResult:
    figure: Figure
    paths: tuple[Path, ...]


def styled(fn: Callable[..., FigureResult]) -> Callable[..., FigureResult]:
    """Build the whole figure under STYLE: matplotlib reads rcParams when each artist is made."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> FigureResult:
        with matplotlib.rc_context(STYLE):
            return fn(*args, **kwargs)

    return wrapper


# --- labels, captions, export ------------------------------------------------------------------


def is_functional(df: pd.DataFrame) -> bool:
    """True when the table holds times taken without a GPU (interpreter): they mean nothing.

    Tables without times (capacity, numerical error, recall) are exact on any device.
    """
    if "functional_only" in df and df["functional_only"].fillna(False).astype(bool).any():
        return True
    return ("us" in df and "device" in df
            and df["device"].astype(str).str.startswith("cpu").any())


def caption_for(df: pd.DataFrame, metas: Sequence[Mapping[str, Any]] = ()) -> str:
    """Device, versions, commit, runs and timing method of the rows, from the table and run.json.

    metas: the run.json dicts of the runs in `df` (as `load_run` returns them); without them
    the caption says what the table itself knows.
    """
    parts: list[str] = []
    devices = sorted({m["device"].get("name", m["device"].get("slug", "?")) for m in metas}
                     or set(df.get("device", pd.Series(dtype=object)).dropna().astype(str)))
    if devices:
        parts.append("device " + ", ".join(devices))
    versions = sorted({f"torch {m['versions'].get('torch')} · triton "
                       f"{m['versions'].get('triton')}" for m in metas if m.get("versions")})
    parts += versions
    commits = sorted({_commit_label(m.get("git") or {}) for m in metas} - {""})
    if commits:
        parts.append("commit " + ", ".join(commits))
    runs = sorted(set(df["run_id"].dropna().astype(str))) if "run_id" in df else []
    if runs:
        parts.append(f"run {runs[0]}" if len(runs) == 1 else f"{len(runs)} runs")
    functional = is_functional(df)
    if "method" in df:
        parts += [METHOD_WORDS.get(m, m) for m in sorted(set(df["method"].dropna().astype(str)))]
    if "cache_policy" in df and not functional:  # the interpreter has no cache to speak of
        parts.append(_cache_label(set(df["cache_policy"].dropna().astype(str))))
    text = " · ".join(parts)
    return f"{FUNCTIONAL_NOTE.upper()} · {text}" if functional else text


# The timing methods (`qsa.measure.timing`) in words, for captions read outside the team.
METHOD_WORDS = {
    METHOD_GRAPH: "timed by graph replay (each call captured in a CUDA/HIP graph, replayed; "
                  "device time per call)",
    METHOD_EVENTS: "timed by device events around each call",
    METHOD_HOST: "timed by the host clock (interpreter run)",
}


def _cache_label(policies: set[str]) -> str:
    """One phrase for the cache policies of a figure's points (each point has its own rotation
    size, so listing them would make the caption longer than the figure)."""
    if policies and all(p.startswith("rotate_") for p in policies):
        return "cold cache (inputs rotated past the last-level cache)"
    return "/".join(sorted(policies)) if len(policies) <= 2 else f"{len(policies)} cache policies"


def _commit_label(git: Mapping[str, Any]) -> str:
    commit = git.get("commit")
    if not commit:
        return ""
    return commit[:10] + (" (dirty)" if git.get("dirty") else "")


def save_figure(fig: Figure, out_dir: str | Path, name: str,
                formats: Sequence[str] | None = None) -> tuple[Path, ...]:
    """Write `<out_dir>/<name>.<fmt>` for each format (default: `figure_formats()`); SVG and
    PDF carry no date (stable diffs)."""
    formats = figure_formats() if formats is None else formats
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    with matplotlib.rc_context(STYLE):
        for fmt in formats:
            path = out / f"{name}.{fmt}"
            meta = {"Date": None} if fmt == "svg" else {"CreationDate": None} if fmt == "pdf" \
                else {}
            fig.savefig(path, format=fmt, metadata=meta)
            paths.append(path)
    return tuple(paths)


def _new_figure(ncols: int = 1, nrows: int = 1, *, width: float | None = None,
                height: float | None = None, sharey: bool = False
                ) -> tuple[Figure, np.ndarray]:
    width = width or min(4.2 * ncols + 1.2, 16)
    height = height or 3.4 * nrows + 0.9
    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, fig.subplots(nrows, ncols, sharey=sharey, squeeze=False)


def _finish(fig: Figure, df: pd.DataFrame, title: str, caption: str | None, out_dir: str | Path,
            name: str) -> FigureResult:
    """Title (marked when functional), caption under the axes, then export."""
    functional = is_functional(df)
    caption = caption_for(df) if caption is None else caption
    if functional and FUNCTIONAL_NOTE.upper() not in caption.upper():
        caption = f"{FUNCTIONAL_NOTE.upper()} · {caption}"
    fig.suptitle(f"{title} [{FUNCTIONAL_NOTE}]" if functional else title)
    # The caption lives below the axes: shrink the layout area to leave it room.
    caption = "\n".join(textwrap.wrap(caption, width=int(fig.get_figwidth() * 16)))
    lines = caption.count("\n") + 1
    frac = min(0.3, (0.14 + 0.13 * lines) / fig.get_figheight())
    fig.get_layout_engine().set(rect=(0, frac, 1, 1 - frac))
    fig.text(0.01, frac * 0.35, caption, ha="left", va="center", fontsize=6.8,
             color="#b22222" if functional else "0.3")
    return FigureResult(fig, save_figure(fig, out_dir, name))


def _num(v: float) -> str:
    """Compact numbers for cells and ticks: 3.2, 412, 30.9k, 4.45M."""
    if math.isnan(v):
        return "—"
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:.3g}M"
    if a >= 1e4:
        return f"{v / 1e3:.3g}k"
    if a >= 100:
        return f"{v:.0f}"
    return f"{v:.3g}"


def _duration(us: float) -> str:
    """A time given in µs, in the unit that reads best: 850 µs, 5000 µs, 12 ms, 1.5 s."""
    a = abs(us)
    if a >= 1e7:
        return f"{us / 1e6:.3g} s"
    if a >= 1e4:
        return f"{us / 1e3:.3g} ms"
    return f"{_num(us)} µs"


def _num_axis(ax: Any, axis: str = "y", fmt: Callable[[float], str] = _num) -> None:
    """Compact tick labels (`fmt`: `_duration` for an axis of µs)."""
    target = ax.yaxis if axis == "y" else ax.xaxis
    if target.get_scale() == "log":  # 1-2-5 ticks read better than every minor tick labelled
        target.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    target.set_major_formatter(FuncFormatter(lambda v, _pos: fmt(v)))
    target.set_minor_formatter(NullFormatter())


def _tokens(n: float) -> str:
    n = int(n)
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}M"
    if n >= 1024 and n % 1024 == 0:
        return f"{n >> 10}K"
    return str(n)


def _log2_axis(ax: Any, values: Sequence[float], axis: str = "x") -> None:
    """Log-2 scale with ticks at the measured values, labelled 8K, 16K, ..."""
    vals = sorted({float(v) for v in values if v and v > 0})
    if not vals:
        return
    set_ticks = ax.set_xticks if axis == "x" else ax.set_yticks
    if len(vals) > 1:  # one value: a linear axis with that one tick
        (ax.set_xscale if axis == "x" else ax.set_yscale)("log", base=2)
    set_ticks(vals, [_tokens(v) for v in vals])
    ax.minorticks_off()


def _check_columns(df: pd.DataFrame, *cols: str | None) -> None:
    missing = [c for c in cols if c is not None and c not in df]
    if missing:
        raise KeyError(f"table lacks column(s) {missing}; has {list(df.columns)}")
    if df.empty:
        raise ValueError("empty table: nothing to plot")


def _values(df: pd.DataFrame, col: str | None) -> list[Any]:
    return [None] if col is None else sorted(df[col].dropna().unique().tolist(), key=_sort_key)


def _sort_key(v: Any) -> tuple[int, Any]:
    return (0, v) if isinstance(v, (int, float, np.number)) else (1, str(v))


def _select(df: pd.DataFrame, col: str | None, value: Any) -> pd.DataFrame:
    return df if col is None else df[df[col] == value]


def _label(col: str | None, value: Any) -> str:
    if col is None:
        return ""
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # a count read from a column that also holds NaN: "batch 1"
    return f"{col} {_tokens(value)}" if col == "context" else f"{col} {value}"


# --- generic charts ----------------------------------------------------------------------------


@styled
def line_plot(df: pd.DataFrame, out_dir: str | Path, *, x: str, y: str, name: str, title: str,
              xlabel: str, ylabel: str, series: str | None = None, style: str | None = None,
              facet: str | None = None, band: tuple[str, str] | None = None,
              logx: bool = True, logy: bool = False, caption: str | None = None,
              yfmt: Callable[[float], str] = _num) -> FigureResult:
    """One line per (series, style) value pair, one panel per facet value.

    Colour follows `series`, line style follows `style`; `band` (low, high) columns shade a
    spread around each line (p10/p90 for latencies); `yfmt` labels the y ticks.
    """
    _check_columns(df, x, y, series, style, facet, *(band or ()))
    facets, series_vals, style_vals = _values(df, facet), _values(df, series), _values(df, style)
    fig, axes = _new_figure(len(facets), sharey=True)
    for ax, fv in zip(axes[0], facets):
        part = _select(df, facet, fv)
        for i, sv in enumerate(series_vals):
            for j, tv in enumerate(style_vals):
                pts = _select(_select(part, series, sv), style, tv).sort_values(x)
                pts = pts[pts[y].notna()]
                if pts.empty:
                    continue
                label = ", ".join(s for s in (_label(series, sv), _label(style, tv)) if s)
                ax.plot(pts[x], pts[y], color=PALETTE[i % len(PALETTE)],
                        linestyle=LINESTYLES[j % len(LINESTYLES)],
                        marker=MARKERS[j % len(MARKERS)], label=label or y)
                if band is not None:
                    ax.fill_between(pts[x], pts[band[0]], pts[band[1]], alpha=0.15,
                                    color=PALETTE[i % len(PALETTE)], linewidth=0)
        if logx:
            _log2_axis(ax, part[x].tolist())
        if logy:
            ax.set_yscale("log")
        _num_axis(ax, fmt=yfmt)
        ax.set_xlabel(xlabel)
        ax.set_title(_label(facet, fv))
    axes[0][0].set_ylabel(ylabel)
    _legend(fig, axes)
    return _finish(fig, df, title, caption, out_dir, name)


def _legend(fig: Figure, axes: np.ndarray) -> None:
    """One legend for the figure (every panel has the same series), outside on the right."""
    handles: dict[str, Any] = {}
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="outside right center")


@styled
def grouped_bars(df: pd.DataFrame, out_dir: str | Path, *, x: str, y: str, name: str, title: str,
                 ylabel: str, group: str | None = None, facet: str | None = None,
                 caption: str | None = None, value_fmt: str = "{:.3g}") -> FigureResult:
    """Bars of `y` per `x` value, side by side per `group` value, one panel per facet."""
    _check_columns(df, x, y, group, facet)
    facets, xs, groups = _values(df, facet), _values(df, x), _values(df, group)
    width = 0.8 / len(groups)
    fig, axes = _new_figure(len(facets), sharey=True)
    for ax, fv in zip(axes[0], facets):
        part = _select(df, facet, fv)
        for g, gv in enumerate(groups):
            sub = _select(part, group, gv).set_index(x)[y]
            if sub.index.has_duplicates:
                dup = sub.index[sub.index.duplicated()][0]
                raise ValueError(f"{name}: several rows per {x}={dup} in one bar group; "
                                 "filter the table first")
            heights = [float(sub.get(xv, np.nan)) for xv in xs]
            pos = np.arange(len(xs)) + (g - (len(groups) - 1) / 2) * width
            bars = ax.bar(pos, heights, width, color=PALETTE[g % len(PALETTE)],
                          label=_label(group, gv) or y)
            ax.bar_label(bars, labels=["" if math.isnan(h) else value_fmt.format(h)
                                       for h in heights], fontsize=6.5, padding=1)
        ax.set_xticks(np.arange(len(xs)), [str(v) for v in xs])
        ax.set_xlabel(x)
        ax.set_title(_label(facet, fv))
        _num_axis(ax)
    axes[0][0].set_ylabel(ylabel)
    if group is not None:
        _legend(fig, axes)
    return _finish(fig, df, title, caption, out_dir, name)


# --- the design-review charts ------------------------------------------------------------------


@styled
def latency_vs_context(df: pd.DataFrame, out_dir: str | Path, *, name: str = "latency_vs_context",
                       series: str | None = "batch", style: str | None = "op",
                       facet: str | None = "index_format", title: str | None = None,
                       caption: str | None = None) -> FigureResult:
    """Median µs per call against context, one line per batch (and op), p10-p90 shaded."""
    band = ("p10_us", "p90_us") if {"p10_us", "p90_us"} <= set(df.columns) else None
    return line_plot(df, out_dir, x="context", y="us", name=name,
                     title=title or "Latency per call vs context", xlabel="context (tokens)",
                     ylabel=US, series=series, style=style, facet=facet, band=band, logy=True,
                     caption=caption, yfmt=_duration)


@styled
def speedup_heatmap(df: pd.DataFrame, out_dir: str | Path, *, variant: str = "op",
                    baseline: Any = "score_rowwise", candidate: Any = "score_stacked",
                    rows: str = "batch", cols: str = "context", facet: str | None = "index_format",
                    name: str = "speedup", title: str | None = None,
                    caption: str | None = None) -> FigureResult:
    """Speedup baseline µs / candidate µs over rows x cols, one panel per facet value.

    Cells are judged by the test of `qsa.workbench.compare` (a bootstrap interval of the
    speedup): a cell whose interval includes 1 is printed as "≈", so colour alone never
    suggests a difference the measurement can not support.
    """
    from qsa.workbench.compare import compare

    _check_columns(df, variant, rows, cols, facet, "us")
    keys = [k for k in (facet, rows, cols) if k is not None]
    a, b = df[df[variant] == baseline], df[df[variant] == candidate]
    if a.empty or b.empty:
        raise ValueError(f"speedup needs rows with {variant}={baseline!r} and {candidate!r}; "
                         f"found {sorted(map(str, df[variant].unique()))}")
    table = compare(a, b, keys=keys, label_a=str(baseline), label_b=str(candidate)).table
    facets = _values(table, facet)
    fig, axes = _new_figure(len(facets), height=3.9)
    logs = np.log2(table["speedup"].replace([np.inf, -np.inf, 0], np.nan).dropna())
    span = max(0.25, float(logs.abs().max()) if len(logs) else 1.0)  # symmetric around 1x
    image = None
    for ax, fv in zip(axes[0], facets):
        part = _select(table, facet, fv)
        grid = part.pivot(index=rows, columns=cols, values="speedup").sort_index(
            key=lambda s: s.map(_sort_key)).sort_index(axis=1, key=lambda s: s.map(_sort_key))
        verdict = part.pivot(index=rows, columns=cols, values="verdict").reindex_like(grid)
        data = grid.to_numpy(dtype=float)
        image = ax.imshow(np.log2(data), cmap="RdBu", vmin=-span, vmax=span, aspect="auto",
                          origin="lower")
        for (i, j), v in np.ndenumerate(data):
            if not math.isnan(v):
                mark = "≈" if verdict.iat[i, j] == "same" else ""
                strong = abs(math.log2(v)) > 0.6 * span
                ax.text(j, i, f"{mark}{v:.2f}x", ha="center", va="center", fontsize=7.5,
                        color="white" if strong else "black")
        ax.set_xticks(range(grid.shape[1]),
                      [_tokens(c) if cols == "context" else str(c) for c in grid.columns])
        ax.set_yticks(range(grid.shape[0]), [str(r) for r in grid.index])
        ax.set_xlabel("context (tokens)" if cols == "context" else cols)
        ax.set_ylabel(rows)
        ax.set_title(_label(facet, fv))
        ax.grid(False)
    # Powers of two inside the span, and its ends: the bar reaches the largest cell's value.
    ticks = sorted({-span, span, *(t for t in range(-8, 9) if abs(t) < span - 0.5)})
    bar = fig.colorbar(image, ax=axes[0].tolist(), shrink=0.85, ticks=ticks,
                       label="speedup (log scale)")
    bar.ax.set_yticklabels([f"{2.0 ** t:.3g}x" for t in ticks])
    title = title or f"Speedup of {candidate} over {baseline}"
    return _finish(fig, df, f"{title} (>1: {candidate} faster; ≈ within noise)", caption,
                   out_dir, name)


def _pct_column(df: pd.DataFrame, *names: str) -> str | None:
    return next((n for n in names if n in df), None)


@styled
def ceiling_share_chart(df: pd.DataFrame, out_dir: str | Path, *, x: str = "context",
                        series: str | None = "batch", facet: str | None = "op",
                        name: str = "ceiling_share", title: str | None = None,
                        caption: str | None = None) -> FigureResult:
    """Percent of the measured copy bandwidth and of the matrix rate per point, against
    `x`: how close each point runs to the device's limits (not a roofline: `intensity_roofline`
    is that). A panel row with no data (kernels without matrix work, a functional run) is left
    out, and so is one op's panel without data in a row that others fill (the row-wise scorer's
    matrix rate); with no data at all, one panel says so.

    Fractions are of *measured* ceilings (`qsa.measure.device.measure_ceilings`), so 100% is
    "as fast as this device streams / multiplies in practice".
    """
    _check_columns(df, x, series, facet)
    facets, series_vals = _values(df, facet), _values(df, series)
    panels = []
    for col, ylabel in ((_pct_column(df, "pct_copy_bw", "pct_bandwidth"), "% of copy bandwidth"),
                        (_pct_column(df, "pct_matrix"), "% of matrix rate")):
        vals = pd.to_numeric(df[col], errors="coerce") if col is not None else None
        if vals is not None and (vals.fillna(0) > 0).any():
            panels.append((vals, ylabel))
    fig, axes = _new_figure(len(facets), max(1, len(panels)), sharey=False)
    if not panels:
        for ax in axes.flat:
            ax.text(0.5, 0.5, "no share of a measured ceiling\n(functional run, or no measured "
                    "ceilings)", ha="center", va="center", transform=ax.transAxes, fontsize=8,
                    color="0.4")
            ax.set_xticks([])
            ax.set_yticks([])
    for row_i, (vals, ylabel) in enumerate(panels):
        for col_i, fv in enumerate(facets):
            ax = axes[row_i][col_i]
            part = _select(df, facet, fv)
            if not (vals[part.index].fillna(0) > 0).any():
                ax.set_visible(False)
                continue
            for i, sv in enumerate(series_vals):
                sel = part if series is None else part[part[series] == sv]
                pts = pd.DataFrame({x: sel[x], "v": vals[sel.index]}).dropna().sort_values(x)
                if not pts.empty:
                    ax.plot(pts[x], pts["v"], color=PALETTE[i % len(PALETTE)], marker="o",
                            label=_label(series, sv) or ylabel)
            ax.axhline(100, color="0.2", linewidth=0.8, linestyle="--")
            ax.set_ylim(0, max(105.0, float(vals[part.index].max()) * 1.05))
            if x == "context":
                _log2_axis(ax, part[x].tolist())
            ax.set_xlabel("context (tokens)" if x == "context" else x)
            ax.set_ylabel(ylabel)
            if row_i == 0:
                ax.set_title(_label(facet, fv))
    _legend(fig, axes)
    return _finish(fig, df, title or "Share of the measured device limits", caption, out_dir,
                   name)


@styled
def intensity_roofline(df: pd.DataFrame, out_dir: str | Path, *, series: str = "op",
                       marker: str | None = "fmt", size: str | None = "batch",
                       name: str = "roofline_intensity", title: str | None = None,
                       caption: str | None = None) -> FigureResult:
    """The roofline proper: arithmetic intensity (FLOP/byte) against achieved TFLOP/s, log-log,
    one point per kernel and shape, under the device's measured roofs, each named (copy
    bandwidth, BF16 matrix, FP8 matrix; the numbers come from each row's own percentages, so
    the roofs are the ones the points were measured against). Colour follows `series`, the
    marker the index/KV formats, the marker's size `size` (the batch)."""
    _check_columns(df, series, "intensity_flop_per_byte", "achieved_tflops")
    need = ["intensity_flop_per_byte", "achieved_tflops", "pct_bandwidth", "pct_matrix"]
    num = df.assign(**{c: pd.to_numeric(df.get(c), errors="coerce") for c in need})
    pts = num.dropna(subset=need)
    pts = pts[(pts["intensity_flop_per_byte"] > 0) & (pts["achieved_tflops"] > 0)
              & (pts["pct_bandwidth"] > 0) & (pts["pct_matrix"] > 0)]
    fig, axes = _new_figure(1, width=7.6, height=4.8)
    ax = axes[0][0]
    if pts.empty:
        ax.text(0.5, 0.5, "no timed point with FLOPs and measured ceilings\n(functional run, "
                "or byte-only kernels)", ha="center", va="center", transform=ax.transAxes,
                fontsize=8, color="0.4")
        ax.set_xticks([])
        ax.set_yticks([])
        return _finish(fig, df, title or "Roofline", caption, out_dir, name)
    gbps = pts["achieved_tflops"] * 1e3 / pts["intensity_flop_per_byte"] / (
        pts["pct_bandwidth"] / 100)
    tflops = pts["achieved_tflops"] / (pts["pct_matrix"] / 100)
    lo = float(pts["intensity_flop_per_byte"].min()) / 3
    hi = max(float(pts["intensity_flop_per_byte"].max()) * 3, float(tflops.max()) * 1e3
             / float(gbps.min()) * 3)
    xs = np.geomspace(lo, hi, 200)
    bw_name = pts.get("bandwidth_ceiling", pd.Series("copy", pts.index)).astype(str)
    mx_name = pts.get("matrix_ceiling", pd.Series("matrix", pts.index)).astype(str)
    slopes = sorted({(n, round(b)) for n, b in zip(bw_name, gbps)}, key=lambda r: r[1])
    roofs = sorted({(n, round(m)) for n, m in zip(mx_name, tflops)}, key=lambda r: r[1])
    b_min = slopes[0][1]
    for n, b in slopes:
        ax.plot(xs, b * xs / 1e3, color="0.25", linewidth=1.0, linestyle=":")
        ax.text(xs[0] * 1.1, b * xs[0] * 1.1 / 1e3, f"{n} bandwidth {b:,} GB/s", fontsize=7,
                color="0.25", rotation=32, rotation_mode="anchor", va="bottom")
    for i, (n, m) in enumerate(roofs):
        ax.plot(xs, np.minimum(m, b_min * xs / 1e3), color="0.25", linewidth=1.0,
                linestyle=LINESTYLES[i % len(LINESTYLES)])
        ax.text(xs[-1] / 1.1, m * 1.06, f"{n.upper() if n in ('bf16', 'fp8') else n} matrix "
                f"{m:,} TFLOP/s", fontsize=7, color="0.25", ha="right", va="bottom")
    fmt = (pts["index_format"].astype(str) + "/" + pts["kv_format"].astype(str)
           if marker == "fmt" and {"index_format", "kv_format"} <= set(pts) else None)
    fmts = sorted(set(fmt)) if fmt is not None else [None]
    sizes = _values(pts, size) if size is not None and size in pts else [None]

    def area(v: Any) -> float:  # grows with log2 of the size column: 1, 8, 64 read apart
        return 16.0 if v is None else 16.0 + 12.0 * math.log2(max(float(v), 1.0))

    for i, sv in enumerate(_values(pts, series)):
        for j, f in enumerate(fmts):
            sel = pts[(pts[series] == sv) & ((fmt == f) if fmt is not None else True)]
            if sel.empty:
                continue
            ax.scatter(sel["intensity_flop_per_byte"], sel["achieved_tflops"],
                       s=[area(v) for v in (sel[size] if sizes != [None] else [None] * len(sel))],
                       color=PALETTE[i % len(PALETTE)], marker=MARKERS[j % len(MARKERS)],
                       label=f"{sv}" + (f" · {f}" if f else ""), zorder=3, alpha=0.85,
                       edgecolors="black", linewidths=0.4)
    handles, names = ax.get_legend_handles_labels()
    for v in sizes if sizes != [None] else []:  # the size key, in grey
        handles.append(ax.scatter([], [], s=area(v), color="0.6", edgecolors="black",
                                  linewidths=0.4))
        names.append(_label(size, v))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte moved)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_ylim(float(pts["achieved_tflops"].min()) / 3, float(tflops.max()) * 2)
    fig.legend(handles, names, loc="outside right center")
    return _finish(fig, df, title or "Roofline: every kernel and shape under the device's "
                   "measured limits", caption, out_dir, name)


@styled
def comparison_chart(cmp: Any, out_dir: str | Path, *, name: str = "compare",
                     title: str | None = None) -> FigureResult:
    """A/B per point: speedup A/B as a bar (right of 1 = B faster), its bootstrap interval as
    whiskers, coloured by verdict; points only in one side or incomparable are counted in the
    caption, not drawn."""
    from qsa.workbench.compare import TEST

    colors = {"faster": "#2ca02c", "slower": "#d62728", "same": "0.6"}
    t = cmp.table[cmp.table["verdict"].isin(tuple(colors))].reset_index(drop=True)
    varying = [k for k in cmp.keys if cmp.table[k].nunique(dropna=False) > 1] or list(cmp.keys)
    labels = t[varying].apply(
        lambda r: " · ".join(_label(k, r[k]) for k in varying if pd.notna(r[k])), axis=1)
    fig, axes = _new_figure(1, width=8.5, height=max(2.6, 0.24 * len(t) + 1.4))
    ax = axes[0][0]
    if t.empty:
        ax.text(0.5, 0.5, "no comparable point", ha="center", va="center",
                transform=ax.transAxes, fontsize=8, color="0.4")
    else:
        err = np.vstack([(t["speedup"] - t["speedup_lo"]).clip(lower=0).fillna(0.0),
                         (t["speedup_hi"] - t["speedup"]).clip(lower=0).fillna(0.0)])
        ax.barh(range(len(t)), t["speedup"] - 1.0, left=1.0, xerr=err,
                color=[colors[v] for v in t["verdict"]], error_kw={"linewidth": 0.8})
        ax.set_yticks(range(len(t)), labels, fontsize=6.5)
        ax.invert_yaxis()
        ax.axvline(1.0, color="0.2", linewidth=0.8)
        ax.set_xlabel("speedup A/B (right of 1: B faster)")
        fig.legend(handles=[Patch(color=c, label=f"{v} ({int((t['verdict'] == v).sum())})")
                            for v, c in colors.items()], loc="outside right center")
    rest = cmp.table[~cmp.table["verdict"].isin(tuple(colors))]
    counts = ", ".join(f"{v} {int((rest['verdict'] == v).sum())}"
                       for v in sorted(set(rest["verdict"])))
    device = (cmp.device or {}).get("name") or (cmp.device or {}).get("slug")
    caption = " · ".join(x for x in (
        f"bars: median A / median B per point; whiskers: {TEST}; a point is faster or "
        "slower only when its interval excludes 1",
        f"not drawn: {counts}" if counts else "",
        f"device {device}" if device else "") if x)
    head = title or "A/B comparison" + (f" on {device}" if device else "")
    return _finish(fig, cmp.table.assign(us=cmp.table["us_a"]),
                   f"{head}: B = {cmp.label_b} against A = {cmp.label_a}", caption, out_dir,
                   name)


@styled
def step_stacked_bars(df: pd.DataFrame, out_dir: str | Path, *,
                      x: str | Sequence[str] = ("batch", "context"), stack: str = "kernel",
                      y: str = "us_per_step", totals: pd.DataFrame | None = None,
                      name: str = "step_breakdown", title: str | None = None,
                      caption: str | None = None, unit: str = "decode step") -> FigureResult:
    """Time per `unit` (a decode step, a prefill chunk), one bar per x value, stacked by
    `stack` (largest at the bottom); beside it the same stacks as shares, so small steps stay
    readable.

    totals: optional rows with the x columns and `y` (e.g. the graph replay of the whole
    step), drawn as a narrow bar beside each stack, each with its own value: the gap between
    the two is launch overhead.
    """
    xcols = [x] if isinstance(x, str) else list(x)
    _check_columns(df, *xcols, stack, y)

    def labels(frame: pd.DataFrame) -> pd.Series:
        if len(xcols) == 1:  # the axis label names the column
            return frame[xcols[0]].astype(str)
        return frame[xcols].apply(lambda r: " · ".join(_label(c, r[c]) for c in xcols), axis=1)

    data = df.assign(_x=labels(df))
    order_x = data.sort_values(xcols, key=lambda s: s.map(_sort_key))["_x"].unique().tolist()
    by_size = data.groupby(stack)[y].sum().sort_values(ascending=False)
    table = data.pivot_table(index="_x", columns=stack, values=y, aggfunc="sum").reindex(
        index=order_x, columns=by_size.index).fillna(0.0)
    fig, axes = _new_figure(2, width=max(8.0, 1.6 * len(order_x) + 5.5))
    ax, share_ax = axes[0]
    shares = table.div(table.sum(axis=1).replace(0.0, np.nan), axis=0) * 100
    bottom, share_bottom = np.zeros(len(order_x)), np.zeros(len(order_x))
    handles = []
    for i, part in enumerate(table.columns):
        h, sh = table[part].to_numpy(), shares[part].fillna(0.0).to_numpy()
        color = PALETTE[i % len(PALETTE)]
        handles.append(ax.bar(range(len(order_x)), h, 0.65, bottom=bottom, color=color,
                              label=str(part)))
        share_ax.bar(range(len(order_x)), sh, 0.65, bottom=share_bottom, color=color)
        bottom += h
        share_bottom += sh
    handles.reverse()  # the legend reads top to bottom, like the stack
    for i, total in enumerate(bottom):
        ax.text(i, total, _duration(total), ha="center", va="bottom", fontsize=7)
    if totals is not None and not totals.empty:
        at = totals.assign(_x=labels(totals)).set_index("_x")[y]
        pos = [order_x.index(k) for k in at.index if k in order_x]
        replay = [float(at[order_x[i]]) for i in pos]
        bars = ax.bar(np.asarray(pos, float) + 0.45, replay, 0.2, color="white",
                      edgecolor="black", hatch="///", linewidth=0.8,
                      label=f"graph replay of the whole {unit}")
        ax.bar_label(bars, labels=[_duration(v) for v in replay], fontsize=6.5, padding=1)
        handles.append(bars)
    for a in (ax, share_ax):
        a.set_xticks(range(len(order_x)), order_x, rotation=20 if len(order_x) > 3 else 0)
        a.set_xlabel(" x ".join(xcols))
    _num_axis(ax, fmt=_duration)
    _num_axis(share_ax)
    ax.set_ylabel(f"time per {unit} (stack: sum of kernels)")
    share_ax.set_ylabel(f"share of the {unit} (%)")
    share_ax.set_ylim(0, 100)
    fig.legend(handles=handles, loc="outside right center")
    return _finish(fig, df, title or "Per-step time by kernel", caption, out_dir, name)


def expand_config(df: pd.DataFrame, column: str = "config") -> pd.DataFrame:
    """The JSON config column as columns: each meta key, num_warps, num_stages, amd keys."""
    def flat(text: Any) -> dict[str, Any]:
        cfg = (json.loads(text) if isinstance(text, str) else text) or {}  # "null": default
        out = dict(cfg.get("meta", {}))
        out.update({k: cfg[k] for k in ("num_warps", "num_stages") if k in cfg})
        out.update({f"amd_{k}": v for k, v in (cfg.get("amd") or {}).items()})
        return out

    wide = pd.DataFrame([flat(v) for v in df[column]], index=df.index)
    return df.join(wide.drop(columns=[c for c in wide if c in df]))


@styled
@styled
def candidate_spread(df: pd.DataFrame, out_dir: str | Path, *, name: str = "candidates",
                     title: str | None = None, caption: str | None = None) -> FigureResult:
    """Every verified candidate of a tuning run, fastest first: median µs with its p10-p90
    band, the current table entry in red, so a review sees how far the winner stands out of
    the run's noise. Failed candidates (did not compile, wrong result) are counted in the
    title, not drawn."""
    _check_columns(df, "config", "us", "status")
    ok = df[df["status"] == "ok"].sort_values("us")
    labels = [_config_label(c) for c in ok["config"]]
    fig, axes = _new_figure(width=9.0, height=max(3.0, 0.28 * len(ok) + 1.6))
    ax = axes[0][0]
    y = np.arange(len(ok))[::-1]
    current = ok["is_current"].fillna(False).astype(bool).to_numpy() if "is_current" in ok \
        else np.zeros(len(ok), bool)
    colors = [PALETTE[1] if c else PALETTE[0] for c in current]
    lo = (ok["us"] - ok["p10_us"]).clip(lower=0) if "p10_us" in ok else None
    hi = (ok["p90_us"] - ok["us"]).clip(lower=0) if "p90_us" in ok else None
    ax.barh(y, ok["us"], color=colors, height=0.65,
            xerr=None if lo is None else [lo.to_numpy(), hi.to_numpy()], capsize=2)
    ax.set_yticks(y, labels, fontsize=6.5)
    ax.set_xlabel("median time per call (bar: p10-p90)")
    _num_axis(ax, "x", _duration)
    failed = int((df["status"] != "ok").sum())
    head = title or "Tuning candidates"
    return _finish(fig, df, f"{head}: {len(ok)} verified, {failed} failed "
                            "(current entry in red)", caption, out_dir, name)


def _config_label(config: str) -> str:
    """`BLOCK_N=64 SLOTS=1 w4 s3` from a stored config's JSON."""
    d = json.loads(config)
    meta = " ".join(f"{k}={v}" for k, v in sorted(d.get("meta", {}).items()))
    amd = " ".join(f"{k}={v}" for k, v in sorted(d.get("amd", {}).items()))
    return " ".join(x for x in (meta, f"w{d.get('num_warps')} s{d.get('num_stages')}", amd) if x)


def config_heatmap(df: pd.DataFrame, out_dir: str | Path, *, rows: str | None = None,
                   cols: str | None = None, value: str = "us", name: str = "config_heatmap",
                   title: str | None = None, caption: str | None = None) -> FigureResult:
    """Best `value` over the other config knobs for each (rows, cols) pair; the winner boxed.

    rows/cols default to the two config knobs with the most distinct values. Configs that
    failed verification are excluded (a wrong kernel's time is not a candidate).
    """
    wide = expand_config(df) if "config" in df else df.copy()
    if "status" in wide:  # tuner tables: "ok" = verified and timed
        wide = wide[wide["status"] == "ok"]
    if "verified" in wide:
        wide = wide[wide["verified"].fillna(False).astype(bool)]
    knobs = [c for c in wide.columns if c not in df.columns]
    ranked = sorted(knobs, key=lambda c: -wide[c].nunique())
    rows = rows or (ranked[0] if ranked else None)
    cols = cols or (next((c for c in ranked if c != rows), None))
    if rows is None or cols is None:
        raise ValueError(f"config_heatmap needs two config knobs; found {knobs}")
    _check_columns(wide, rows, cols, value)
    grid = wide.groupby([rows, cols])[value].min().unstack(cols)
    fig, axes = _new_figure(width=max(5.0, 0.9 * grid.shape[1] + 3.0), height=4.2)
    ax = axes[0][0]
    data = grid.to_numpy(dtype=float)
    image = ax.imshow(data, cmap="viridis_r", aspect="auto", origin="lower")
    best = np.unravel_index(np.nanargmin(data), data.shape)
    for (i, j), v in np.ndenumerate(data):
        ax.text(j, i, _num(v), ha="center", va="center", fontsize=7.5,
                color="0.3" if math.isnan(v) or (i, j) == best else "white")
    ax.add_patch(Rectangle((best[1] - 0.5, best[0] - 0.5), 1, 1, fill=False, edgecolor="#d62728",
                           linewidth=2.2))
    ax.set_xticks(range(grid.shape[1]), [str(c) for c in grid.columns])
    ax.set_yticks(range(grid.shape[0]), [str(r) for r in grid.index])
    ax.set_xlabel(cols)
    ax.set_ylabel(rows)
    ax.grid(False)
    what = "time (µs)" if value == "us" or value.endswith("_us") else value
    bar = fig.colorbar(image, ax=ax, label=f"best {what} over the other knobs")
    _num_axis(bar.ax)
    best_label = f"{rows}={grid.index[best[0]]}, {cols}={grid.columns[best[1]]}"
    return _finish(fig, df, f"{title or 'Config space'}: winner {best_label}", caption,
                   out_dir, name)


# --- recipes: which figures a run of each kind gets ---------------------------------------------

Recipe = Callable[[pd.DataFrame, Path, str], list[FigureResult]]


def _per(df: pd.DataFrame, col: str) -> list[tuple[str, str, pd.DataFrame]]:
    """(name suffix, title label, part) per value of `col` when it varies, so each figure holds
    one value; one whole-table entry when it does not."""
    if col not in df or df[col].nunique(dropna=False) <= 1:
        return [("", "", df)]
    return [(f"_{col}{v}", f", {_label(col, v)}", df[df[col] == v]) for v in _values(df, col)]


def _split(df: pd.DataFrame, *cols: str) -> list[tuple[str, str, pd.DataFrame]]:
    """`_per` over several columns: one part per combination of the values that vary, so rows
    of different presets, formats or shapes never share a line or a heat-map cell."""
    parts = [("", "", df)]
    for col in cols:
        parts = [(s + s2, t + t2, p2) for s, t, p in parts for s2, t2, p2 in _per(p, col)]
    return parts


def _has_fractions(df: pd.DataFrame) -> bool:
    """Roofline charts only where there are fractions: functional runs have none."""
    cols = [c for c in ("pct_copy_bw", "pct_bandwidth", "pct_matrix") if c in df]
    return any(pd.to_numeric(df[c], errors="coerce").notna().any() for c in cols)


def _decode_scoring(df: pd.DataFrame, out: Path, caption: str) -> list[FigureResult]:
    figs = []
    for sfx, label, part in _split(df, "preset", "kv_format", "rows"):
        figs.append(latency_vs_context(part, out, name=f"latency{sfx}", caption=caption,
                                       title=f"Decode scoring: latency per call{label}"))
        if {"score_rowwise", "score_stacked"} <= set(part["op"]):
            figs.append(speedup_heatmap(part, out, name=f"speedup{sfx}", caption=caption,
                                        title=f"Decode scoring: stacked over row-wise{label}"))
        for fsfx, flabel, fpart in _per(part, "index_format") if _has_fractions(part) else ():
            figs += _limits(fpart, out, caption, f"{sfx}{fsfx}", f"Decode scoring{label}{flabel}")
    return figs


def _limits(df: pd.DataFrame, out: Path, caption: str, sfx: str, what: str,
            series: str = "batch", facet: str = "op") -> list[FigureResult]:
    """The two charts of how close points run to the device: the roofline proper (where the
    table has intensities) and the share of each measured ceiling against context."""
    figs = []
    if "intensity_flop_per_byte" in df:
        figs.append(intensity_roofline(df, out, name=f"roofline{sfx}", caption=caption,
                                       title=f"{what}: roofline"))
    figs.append(ceiling_share_chart(df, out, name=f"ceiling_share{sfx}", series=series,
                                    facet=facet, caption=caption,
                                    title=f"{what}: share of the measured device limits"))
    return figs


def _prefill(df: pd.DataFrame, out: Path, caption: str) -> list[FigureResult]:
    figs = []
    for sfx, label, part in _split(df, "preset", "batch", "index_format", "kv_format"):
        figs.append(latency_vs_context(part, out, name=f"latency{sfx}", series="rows",
                                       style=None, facet="op", caption=caption,
                                       title=f"Prefill: latency per call{label}"))
        if _has_fractions(part):
            figs += _limits(part, out, caption, sfx, f"Prefill{label}", series="rows")
    return figs


def _sparse_gqa_decode(df: pd.DataFrame, out: Path, caption: str) -> list[FigureResult]:
    figs = []
    for sfx, label, part in _split(df, "preset", "rows", "index_format"):
        figs.append(latency_vs_context(part, out, name=f"latency{sfx}", series="split",
                                       style="kv_format", facet="batch", caption=caption,
                                       title=f"Sparse GQA decode: latency per call{label}"))
        if {"bf16", "fp8"} <= set(part["kv_format"]):
            best = part.loc[part.groupby(["kv_format", "batch", "context"])["us"].idxmin()]
            figs.append(speedup_heatmap(best, out, variant="kv_format", baseline="bf16",
                                        candidate="fp8", facet=None, name=f"speedup_fp8{sfx}",
                                        caption=caption, title="Sparse GQA decode: FP8 over "
                                        f"BF16 tiles (best split each){label}"))
        if _has_fractions(part):
            figs += _limits(part, out, caption, sfx, f"Sparse GQA decode{label}",
                            facet="kv_format")
    return figs


def _config_tuning(df: pd.DataFrame, out: Path, caption: str) -> list[FigureResult]:
    """One heat map per tuned shape: the best over shapes would mean nothing."""
    return [config_heatmap(part, out, name=f"config_heatmap{sfx}", caption=caption,
                           title=f"Config space of {part['op'].iloc[0]}{label}")
            for sfx, label, part in _split(df, "op", "preset", "batch", "context", "rows",
                                           "index_format", "kv_format", "arch")]


def _stacked_steps(df: pd.DataFrame, out: Path, caption: str, split: tuple[str, ...],
                   x: tuple[str, ...], name: str, what: str,
                   unit: str = "decode step") -> list[FigureResult]:
    """Kernel rows stacked as `<kernel> (<phase>)`, one bar per `x` value and one figure per
    `split` combination; the step rows (sum, graph replay) are totals, not parts."""
    figs = []
    for sfx, label, part in _split(df, *split):
        is_step = part["phase"] == "step" if "phase" in part else pd.Series(False, part.index)
        calls = part[~is_step]
        if "phase" in calls:
            calls = calls.assign(call=calls["kernel"] + " (" + calls["phase"] + ")")
        replay = part[is_step & (part["kernel"] == "graph replay")]
        figs.append(step_stacked_bars(calls, out, x=x,
                                      stack="call" if "call" in calls else "kernel",
                                      totals=replay, name=f"{name}{sfx}", caption=caption,
                                      title=f"{what}, {part['preset'].iloc[0]}{label}",
                                      unit=unit))
    return figs


def _step_breakdown(df: pd.DataFrame, out: Path, caption: str) -> list[FigureResult]:
    return _stacked_steps(df, out, caption, ("preset", "index_format", "kv_format", "mtp",
                                             "overlap_target"),
                          ("batch", "context"), "step_breakdown", "Per-step µs by kernel")


def _step_run(df: pd.DataFrame, out: Path, caption: str) -> list[FigureResult]:
    """A `qsa step` run: decode steps and prefill chunks, each drawn as such, and the format
    pairs of one shape side by side when there are several."""
    phase = df["step_phase"] if "step_phase" in df else pd.Series("decode", df.index)
    figs = []
    if (phase != "prefill").any():
        figs += _step_breakdown(df[phase != "prefill"], out, caption)
    if (phase == "prefill").any():
        figs += _prefill_step(df[phase == "prefill"], out, caption)
    return figs + _formats_side_by_side(df, out, caption, "step_formats")


def _formats_side_by_side(df: pd.DataFrame, out: Path, caption: str,
                          name: str) -> list[FigureResult]:
    """Each step shape measured in several index/KV format pairs: the kernels of every pair
    stacked side by side, the graph replay of the whole step beside each, so a review sees
    which kernel a format moved."""
    if "step_phase" not in df:
        df = df.assign(step_phase="decode")
    df = df.assign(**{"index/KV": df["index_format"] + "/" + df["kv_format"]})
    figs = []
    for sfx, label, part in _split(df, "step_phase", "preset", "batch", "context",
                                   "chunk_rows", "mtp", "overlap_target"):
        if part["index/KV"].nunique() < 2:
            continue
        prefill = (part["step_phase"] == "prefill").any()
        unit = "prefill chunk" if prefill else "decode step"
        first = part.iloc[0]
        shape = (f"batch {first['batch']} x {_tokens(first['context'])}"
                 + (f", chunk {int(first['chunk_rows'])} rows" if prefill else
                    f", MTP {int(first['mtp'])}" if pd.notna(first.get("mtp")) else ""))
        calls = part[part["phase"] != "step"]
        figs.append(step_stacked_bars(
            calls.assign(call=calls["kernel"] + " (" + calls["phase"] + ")"), out,
            x="index/KV", stack="call", unit=unit, name=f"{name}{sfx}", caption=caption,
            totals=part[part["kernel"] == "graph replay"],
            title=f"Time per {unit} by kernel and format, {part['preset'].iloc[0]}, {shape}"))
    return figs


def _suite(df: pd.DataFrame, out: Path, caption: str) -> list[FigureResult]:
    """A `qsa bench --suite` run: every point under the device's roofs, and each step entry's
    format pairs side by side."""
    record = df["record"] if "record" in df else pd.Series("point", df.index)
    points, steps = df[record == "point"], df[record == "step"]
    name = str(df["suite"].iloc[0]) if "suite" in df else "suite"
    figs = overlap_figures(points, out, caption, title=f"Suite {name}: sparse GQA per-row and "
                           "shared against the rows' overlap")
    if "intensity_flop_per_byte" in points:  # a functional run's says it has no roofs
        figs.append(intensity_roofline(points, out, caption=caption,
                                       title=f"Suite {name}: every point under the device's "
                                       "measured roofs"))
    return figs + (_formats_side_by_side(steps, out, caption, "step") if len(steps) else [])


def _tune(df: pd.DataFrame, out: Path, caption: str) -> list[FigureResult]:
    """A `qsa tune` run: the candidates ranked with their noise, and the config heat map
    where at least two knobs varied."""
    figs = []
    for sfx, label, part in _split(df, "op", "batch", "context", "rows", "index_format",
                                   "kv_format", "arch"):
        title = f"Tuning {part['op'].iloc[0]}{label}"
        figs.append(candidate_spread(part, out, name=f"candidates{sfx}", title=title,
                                     caption=caption))
        ok = part[part["status"] == "ok"]
        knobs = expand_config(ok).drop(columns=ok.columns)
        if int((knobs.nunique() > 1).sum()) >= 2:  # else the ranking says it all
            figs.append(config_heatmap(part, out, name=f"config_heatmap{sfx}", caption=caption,
                                       title=title))
    return figs


def overlap_figures(df: pd.DataFrame, out: Path, caption: str | None = None,
                    title: str = "Sparse GQA, per-row and shared, against the rows' overlap"
                    ) -> list[FigureResult]:
    """The overlap figure of a run's sparse GQA points when they span several overlaps."""
    if "path" not in df or "overlap_target" not in df:
        return []
    pts = df[df["path"].notna() & df["us"].notna()] if "us" in df else df.iloc[0:0]
    if pts.empty or pts["overlap_target"].nunique() < 2:
        return []
    return [overlap_curves(pts, out, title=title, caption=caption)]


def _bench(df: pd.DataFrame, out: Path, caption: str) -> list[FigureResult]:
    """A `qsa bench` run: every point under the device's measured roofs (a GPU run), and the
    sparse GQA points against their overlap where they span several."""
    if "intensity_flop_per_byte" not in df or not _has_fractions(df):
        return overlap_figures(df, out, caption)
    return overlap_figures(df, out, caption) + [intensity_roofline(df[df["verified"].fillna(False).astype(bool)]
                               if "verified" in df else df, out, caption=caption,
                               title="Every point under the device's measured roofs")]


def _profile(df: pd.DataFrame, out: Path, caption: str) -> list[FigureResult]:
    """A `qsa profile` run: the op's main kernel as the timing module and the profiler saw
    it, side by side per profiler, the run's noise in the title."""
    _check_columns(df, "op", "profiler", "timing_us", "profiler_median_us")
    long = pd.concat([
        df.assign(source="timing module", us=df["timing_us"]),
        df.assign(source="profiler", us=df["profiler_median_us"])], ignore_index=True)
    long["point"] = long["op"] + " · " + long["profiler"]
    agree = df["agree_within_noise"].map({True: "agree", False: "differ"}) \
        if "agree_within_noise" in df else pd.Series("", df.index)
    verdict = ", ".join(f"{o} ({p}): {a}" for o, p, a in zip(df["op"], df["profiler"], agree))
    return [grouped_bars(long, out, x="point", y="us", group="source", name="profile_crosscheck",
                         title=f"Main kernel, timing module vs profiler: {verdict}",
                         ylabel="median µs per call", caption=caption)]


def _prefill_step(df: pd.DataFrame, out: Path, caption: str) -> list[FigureResult]:
    return _stacked_steps(df, out, caption, ("preset", "index_format", "kv_format", "batch",
                                             "overlap_target"),
                          ("chunk_rows", "context"), "prefill_step",
                          "Time per prefill chunk by kernel", unit="prefill chunk")


def _capacity(df: pd.DataFrame, out: Path, caption: str) -> list[FigureResult]:
    part = df[df["draft"] == "bf16"] if "draft" in df else df
    return [grouped_bars(p, out, x="kv", y="tokens_per_gib", group="index", facet="preset",
                         name=f"capacity{sfx}", caption=caption, ylabel="tokens per GiB of pool",
                         title=f"KV pool capacity by cache format (BF16 draft layer "
                               f"counted){label}", value_fmt="{:,.0f}")
            for sfx, label, p in _split(part, "gib")]


def _attention_error(df: pd.DataFrame, out: Path, caption: str) -> list[FigureResult]:
    return [line_plot(p, out, x="context", y="rel_err_mean", band=("rel_err_min", "rel_err_max"),
                      series="fp8_dtype", name=f"attention_error{sfx}", caption=caption,
                      xlabel="context (tokens)", ylabel="relative L2 error of the output",
                      title=f"Sparse GQA output error: FP8 K/V vs BF16 K/V{label}")
            for sfx, label, p in _split(df, "preset", "batch", "rows")]


def _topk_recall(df: pd.DataFrame, out: Path, caption: str) -> list[FigureResult]:
    return [line_plot(p, out, x="context", y="recall_mean", band=("recall_min", "recall_max"),
                      series="index_format", name=f"topk_recall{sfx}", caption=caption,
                      xlabel="context (tokens)", ylabel="top-k recall vs BF16 keys",
                      title=f"Top-k recall of quantized index keys{label}")
            for sfx, label, p in _split(df, "preset", "batch", "rows", "topk_groups")]


RECIPES: dict[str, Recipe] = {
    "decode-scoring": _decode_scoring,
    "prefill": _prefill,
    "sparse-gqa-decode": _sparse_gqa_decode,
    "config-tuning": _config_tuning,
    "step-breakdown": _step_breakdown,
    "prefill-step": _prefill_step,
    "step": _step_run,
    "tune": _tune,
    "profile": _profile,
    "bench": _bench,
    "suite": _suite,
    "formats-capacity": _capacity,
    "formats-attention-error": _attention_error,
    "formats-topk-recall": _topk_recall,
}


def figures_for(df: pd.DataFrame, kind: str, out_dir: str | Path,
                metas: Sequence[Mapping[str, Any]] = ()) -> list[FigureResult]:
    """Every figure the recipe of `kind` makes from `df`; an unknown kind makes none."""
    recipe = RECIPES.get(kind)
    if recipe is None or df.empty:
        return []
    return recipe(df, Path(out_dir), caption_for(df, metas))


def figures_for_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Regenerate every figure of one stored run (default: `<run dir>/figures`)."""
    from qsa.measure.results import load_run

    df, meta = load_run(run_dir)
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "figures"
    results = figures_for(df, meta["kind"], out, [meta])
    return [p for r in results for p in r.paths]


def break_even(part: pd.DataFrame, x: str = "overlap_measured", y: str = "us") -> float | None:
    """The overlap at which the shared path starts to beat the per-row one (linear between the
    two measured overlaps where the sign of per-row minus shared changes); None when one path
    wins everywhere or either is missing."""
    by = {s: g.groupby(x)[y].median() for s, g in part.groupby("path")}
    if not {"per-row", "shared"} <= set(by):
        return None
    diff = (by["per-row"] - by["shared"]).dropna().sort_index()
    xs, ds = diff.index.to_numpy(), diff.to_numpy()
    for i in range(1, len(ds)):
        if ds[i - 1] <= 0 < ds[i]:
            return float(xs[i - 1] + (xs[i] - xs[i - 1]) * -ds[i - 1] / (ds[i] - ds[i - 1]))
    return None


@styled
def overlap_curves(df: pd.DataFrame, out_dir: str | Path, *, name: str = "overlap",
                   title: str, caption: str | None = None) -> FigureResult:
    """Sparse GQA µs per call against the measured overlap of neighbouring rows' selections,
    one panel per (op, shape), a line per path (per-row, shared, and the per-call choice)
    and K/V format, the break-even overlap of each format marked."""
    _check_columns(df, "op", "context", "rows", "kv_format", "us", "overlap_measured",
                   "sharing", "path")
    df = df[df["us"].notna()].assign(
        line=lambda d: d["sharing"].where(d["sharing"] != "auto", "per-call choice"),
        panel=lambda d: (d["op"].str.replace("sparse_gqa_", "") + " " + d["batch"].astype(str)
                         + " x " + d["context"].map(_tokens) + ", " + d["rows"].astype(str)
                         + " rows per request"))
    panels, lines, kvs = _values(df, "panel"), _values(df, "line"), _values(df, "kv_format")
    fig, axes = _new_figure(len(panels))
    for ax, pv in zip(axes[0], panels):
        part = df[df["panel"] == pv]
        for j, kv in enumerate(kvs):
            fmt_part = part[part["kv_format"] == kv]
            for i, line in enumerate(lines):
                pts = fmt_part[fmt_part["line"] == line].sort_values("overlap_measured")
                if not pts.empty:
                    ax.plot(pts["overlap_measured"], pts["us"], color=PALETTE[i % len(PALETTE)],
                            linestyle=LINESTYLES[j % len(LINESTYLES)],
                            marker=MARKERS[j % len(MARKERS)], label=f"{line}, {kv} K/V")
            at = break_even(fmt_part[fmt_part["sharing"] != "auto"])
            if at is not None:
                ax.axvline(at, color="0.35", linestyle=LINESTYLES[j % len(LINESTYLES)],
                           linewidth=0.9)
                ax.annotate(f"break-even {kv}: {at:.2f}", (at, 1.0), xycoords=("data",
                            "axes fraction"), rotation=90, va="top", ha="right", fontsize=7)
        ax.set_yscale("log")
        _num_axis(ax)
        ax.set_xlim(0, 1)
        ax.set_xlabel("measured mean Jaccard of neighbouring rows' selections")
        ax.set_title(pv)
    axes[0][0].set_ylabel("µs per call")
    _legend(fig, axes)
    return _finish(fig, df, title, caption, out_dir, name)
