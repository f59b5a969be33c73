"""Per-step roll-up: what one decode step of the model spends in QSA kernels.

A step (MTP depth m) runs, per request, the target's QSA layers on m+1 verify rows each, and the
draft layer m times on one row (spec section 2). The table gives every kernel's µs per call,
calls per step and share, summed; and, on a GPU, the same step captured once as a graph and
replayed, which includes the gaps between kernels that a server sees.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from qsa.measure.timing import time_fn
from qsa.presets import ModelPreset, as_preset
from qsa.workbench.ops import Point, Prepared, measure_prepared, prepare

# Kernels of one layer pass, in execution order; the scorer is chosen like the runtime does.
LAYER_OPS: tuple[str, ...] = ("compress", "kv_store", "score", "topk_expand",
                              "sparse_gqa_decode")


def decode_scorer_op() -> str:
    """`QSA_STACKED_DECODE_SCORER=0` selects the row-wise kernel (A/B runs, escape hatch)."""
    return "score_rowwise" if os.environ.get("QSA_STACKED_DECODE_SCORER", "1") == "0" \
        else "score_stacked"


@dataclass(frozen=True)
class StepCall:
    phase: str  # "target" or "draft"
    op: str
    rows: int
    calls_per_step: int
    index_format: str
    kv_format: str


def step_calls(preset: ModelPreset, mtp: int, index_format: str, kv_format: str,
               draft_index_format: str = "bf16", draft_kv_format: str = "bf16"
               ) -> list[StepCall]:
    """The kernel calls of one decode step, one entry per distinct (phase, op) call shape."""
    if mtp < 0:
        raise ValueError(f"mtp: must be >= 0, got {mtp}")
    score = decode_scorer_op()
    ops = [score if o == "score" else o for o in LAYER_OPS]
    calls = [StepCall("target", o, mtp + 1, len(preset.qsa_layers), index_format, kv_format)
             for o in ops]
    if mtp and preset.draft_layers:
        calls += [StepCall("draft", o, 1, mtp * preset.draft_layers, draft_index_format,
                           draft_kv_format) for o in ops]
    return calls


def step_breakdown(preset: str | ModelPreset, batch: int, context: int, mtp: int | None = None,
                   index_format: str = "bf16", kv_format: str = "bf16",
                   device: str | None = None, graph: bool = True,
                   samples: int | None = None, progress: bool = False) -> pd.DataFrame:
    """`mtp` defaults to the preset's draft depth. One row per (phase, kernel): µs per call, calls per step, µs per step and share of the
    summed step; then a `sum` row and, where graphs work, a `graph replay` row."""
    p = as_preset(preset)
    if mtp is not None:
        p = p.replace(mtp_draft_tokens=mtp)  # validated: verify rows 1..8
    calls = step_calls(p, p.mtp_draft_tokens, index_format, kv_format)
    preps: list[tuple[StepCall, Prepared]] = []
    rows = []
    if progress:
        from tqdm.auto import tqdm

        calls = tqdm(calls, desc="step kernels", unit="kernel")
    for c in calls:
        prep = prepare(Point(c.op, p, batch, context, c.rows, c.index_format, c.kv_format),
                       device)
        rec = measure_prepared(prep, samples=samples)
        preps.append((c, prep))
        rows.append({"phase": c.phase, "kernel": c.op, "rows": c.rows,
                     "calls_per_step": c.calls_per_step, "us_per_call": rec["us"],
                     "us_per_step": rec["us"] * c.calls_per_step,
                     "method": rec["method"], "functional_only": rec["functional_only"]})
    df = pd.DataFrame(rows)
    total = df["us_per_step"].sum()
    df["share"] = df["us_per_step"] / total
    summary = [{"phase": "step", "kernel": "sum of kernels", "us_per_step": total, "share": 1.0,
                "method": df["method"].iloc[0], "functional_only": bool(df["functional_only"].any())}]
    if graph and not bool(df["functional_only"].any()):
        t = time_fn(lambda i: _run_step(preps, i), 1, method="graph")
        summary.append({"phase": "step", "kernel": "graph replay", "us_per_step": t.median_us,
                        "share": t.median_us / total, "method": t.method,
                        "functional_only": t.functional_only})
    return pd.concat([df, pd.DataFrame(summary)], ignore_index=True)


def _run_step(preps: list[tuple[StepCall, Prepared]], i: int) -> None:
    """One whole step: every layer's calls in order, each on its own rotation set, as the
    model's other layers would leave the caches cold."""
    n_calls = max(c.calls_per_step for c, _ in preps)
    for layer in range(n_calls):
        for c, prep in preps:
            if layer < c.calls_per_step:
                prep.call((i * n_calls + layer) % prep.n_sets, None)


def step_comparison(frames: list[pd.DataFrame], figure: Path, title: str) -> pd.DataFrame:
    """Steps of several format pairs measured in one run: summed and graph-replayed µs per
    step, each with its speedup against the first pair; and a stacked bar figure of where each
    step's time goes (per kernel and phase), so a review sees which kernel a format moved."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    for df in frames:
        total = df[df["kernel"] == "sum of kernels"]["us_per_step"]
        graph = df[df["kernel"] == "graph replay"]["us_per_step"]
        rows.append({"index_format": df["index_format"].iloc[0],
                     "kv_format": df["kv_format"].iloc[0],
                     "sum_us": float(total.iloc[0]),
                     "graph_us": float(graph.iloc[0]) if len(graph) else float("nan")})
    cmp = pd.DataFrame(rows)
    cmp["speedup_sum"] = cmp["sum_us"].iloc[0] / cmp["sum_us"]
    cmp["speedup_graph"] = cmp["graph_us"].iloc[0] / cmp["graph_us"]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    labels = [f"{r.index_format} index\n{r.kv_format} K/V" for r in cmp.itertuples()]
    parts = sorted({(p, k) for df in frames for p, k in
                    zip(df["phase"], df["kernel"]) if p != "step"})
    bottom = [0.0] * len(frames)
    for phase, kernel in parts:
        vals = []
        for df in frames:
            m = df[(df["phase"] == phase) & (df["kernel"] == kernel)]["us_per_step"]
            vals.append(float(m.sum()))
        ax.bar(labels, vals, bottom=bottom, label=f"{phase}: {kernel}")
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, r in enumerate(cmp.itertuples()):
        ax.text(i, bottom[i], f"{r.sum_us:,.0f} µs\nx{r.speedup_sum:.2f}", ha="center",
                va="bottom", fontsize=8)
    ax.set_ylabel("µs per decode step (sum of kernels)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_ylim(0, max(bottom) * 1.15)
    fig.tight_layout()
    fig.savefig(figure, dpi=120)
    plt.close(fig)
    return cmp
