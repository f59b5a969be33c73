"""Per-step roll-up: what one decode step, or one prefill chunk, of the model spends in QSA
kernels.

A decode step (MTP depth m) runs, per request, the target's QSA layers on m+1 verify rows each,
and the draft layer m times on one row (spec section 2). A prefill chunk of R rows runs the
target's QSA layers once each on the R rows, with the prefill kernels (matrix-tile scorer,
unsplit sparse GQA), and, with MTP, the draft layer once on the same R rows: engines run the
draft module over the prompt so that its own cache holds the chunk. The table gives every
kernel's µs per call, calls per step and share, summed; and, on a GPU, the same step captured
once as a graph and replayed, which includes the gaps between kernels that a server sees.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from qsa.measure.timing import METHOD_GRAPH, time_fn
from qsa.presets import ModelPreset, as_preset
from qsa.workbench.ops import Point, Prepared, measure_prepared, prepare
from qsa.workbench.registry import find, layer_pass
from qsa.workbench.verify import held_together

SUM_ROW = "sum of kernels"  # the summary row of a step frame (suite targets name it too)
# What each kernel row of a step carries about its inputs, the path the call took and the
# implementation that ran it.
STEP_INPUT_KEYS = ("overlap_measured", "union_ratio", "path", "impl", "cache_policy")


def step_total(steps: pd.DataFrame) -> float:
    """µs per step summed over the kernels, from a `step_breakdown` frame."""
    return float(steps.loc[steps["kernel"] == SUM_ROW, "us_per_step"].iloc[0])


@dataclass(frozen=True)
class StepCall:
    phase: str  # "target" or "draft"
    op: str
    rows: int
    calls_per_step: int
    index_format: str
    kv_format: str

    def point(self, preset: ModelPreset, batch: int, context: int, overlap: float = 0.0,
              trace: str | None = None) -> Point:
        """The measurable shape of this call in a step of `batch` requests at `context`, its
        rows' selections overlapping by `overlap` (target mean Jaccard of neighbours); with a
        `trace`, the target layers' sparse GQA replays its selections instead."""
        if trace is not None and self.phase == "target" and find(self.op).takes_selection:
            return Point(self.op, preset, batch, context, self.rows, self.index_format,
                         self.kv_format, selection="trace", trace=trace)
        return Point(self.op, preset, batch, context, self.rows, self.index_format,
                     self.kv_format, overlap=0.0 if trace is not None else overlap)


def step_calls(preset: ModelPreset, mtp: int, index_format: str, kv_format: str,
               draft_index_format: str = "bf16", draft_kv_format: str = "bf16", *,
               phase: str = "decode", rows: int | None = None) -> list[StepCall]:
    """The kernel calls of one decode step (`phase` "decode") or of one prefill chunk of `rows`
    rows per request (`phase` "prefill"), one entry per distinct (phase, op) call shape."""
    if mtp < 0:
        raise ValueError(f"mtp: must be >= 0, got {mtp}")
    ops = [s.name for s in layer_pass(phase)]  # the decode scorer as the runtime chooses it
    if phase == "prefill" and (rows is None or rows < 1):
        raise ValueError(f"rows: a prefill chunk needs its rows per request (>= 1), got {rows}")
    if phase == "decode" and rows is not None:
        raise ValueError("rows: a decode step's rows follow from MTP (mtp + 1 verify rows); "
                         "give rows only with phase prefill")
    target_rows, draft_rows, draft_calls = ((mtp + 1, 1, mtp) if phase == "decode"
                                            else (rows, rows, 1))
    calls = [StepCall("target", o, target_rows, len(preset.qsa_layers), index_format,
                      kv_format) for o in ops]
    if mtp and preset.draft_layers:
        calls += [StepCall("draft", o, draft_rows, draft_calls * preset.draft_layers,
                           draft_index_format, draft_kv_format) for o in ops]
    return calls


def step_breakdown(preset: str | ModelPreset, batch: int, context: int, mtp: int | None = None,
                   index_format: str = "bf16", kv_format: str = "bf16",
                   device: str | None = None, graph: bool = True,
                   samples: int | None = None, progress: bool = False, *,
                   phase: str = "decode", rows: int | None = None,
                   overlap: float = 0.0, trace: str | None = None) -> pd.DataFrame:
    """`mtp` defaults to the preset's draft depth; `phase` "prefill" rolls up one chunk of
    `rows` rows per request ending at `context`; `overlap`: how much neighbouring rows'
    selections overlap (target mean Jaccard; 0 independent rows). One row per (phase,
    kernel): µs per call, calls per step, µs per step and share of the summed step, the
    measured overlap and, for sparse GQA, the path the call chose; then a `sum` row and,
    where graphs work, a `graph replay` row. `trace`: a uniform selection trace of this
    shape whose selections the target layers' sparse GQA replays (`trace_shape`)."""
    p = as_preset(preset)
    if mtp is not None:
        p = p.replace(mtp_draft_tokens=mtp)  # validated: verify rows 1..8
    calls = step_calls(p, p.mtp_draft_tokens, index_format, kv_format, phase=phase, rows=rows)
    preps: list[tuple[StepCall, Prepared]] = []
    rows = []
    n_calls = len(calls)
    if progress:
        from tqdm.auto import tqdm

        calls = tqdm(calls, desc="step kernels", unit="kernel")
    with held_together(n_calls):  # the graph replay below holds every call's inputs at once
        for c in calls:
            prep = prepare(c.point(p, batch, context, overlap, trace), device)
            rec = measure_prepared(prep, samples=samples)
            preps.append((c, prep))
            rows.append({"phase": c.phase, "kernel": c.op, "rows": c.rows,
                         "calls_per_step": c.calls_per_step, "us_per_call": rec["us"],
                         "us_per_step": rec["us"] * c.calls_per_step,
                         "method": rec["method"], "calls_per_sample": rec["calls_per_sample"],
                         "sizing": rec["sizing"], "functional_only": rec["functional_only"],
                         **{k: rec.get(k) for k in STEP_INPUT_KEYS}})
    df = pd.DataFrame(rows)
    total = df["us_per_step"].sum()
    df["share"] = df["us_per_step"] / total
    summary = [{"phase": "step", "kernel": SUM_ROW, "us_per_step": total, "share": 1.0,
                "method": df["method"].iloc[0], "functional_only": bool(df["functional_only"].any())}]
    if graph and not bool(df["functional_only"].any()):
        t = time_fn(lambda i: _run_step(preps, i), 1, method="graph")
        # A call that can not be captured leaves the whole step timed by events, host gaps
        # included: it is not a graph replay and is not labelled as one.
        label = "graph replay" if t.method == METHOD_GRAPH else f"whole step ({t.method})"
        summary.append({"phase": "step", "kernel": label, "us_per_step": t.median_us,
                        "share": t.median_us / total, "method": t.method,
                        "calls_per_sample": t.calls_per_sample, "sizing": t.sizing,
                        "functional_only": t.functional_only, "note": t.note})
    return pd.concat([df, pd.DataFrame(summary)], ignore_index=True)


def step_breakdowns(preset: str | ModelPreset, batch: int, context: int, mtp: int | None,
                    pairs: Sequence[tuple[str, str]], progress: bool = False, *,
                    phase: str = "decode", rows: int | None = None,
                    overlaps: Sequence[float] = (0.0,), trace: str | None = None
                    ) -> Iterator[pd.DataFrame]:
    """`step_breakdown` for each overlap and (index format, KV format) pair, in order, each
    frame tagged with its pair, overlap target and step phase: the side-by-side step of
    `qsa step --formats --overlap` and of suites."""
    for ov in overlaps:
        for idx, kv in pairs:
            yield step_breakdown(preset, batch, context, mtp, idx, kv, progress=progress,
                                 phase=phase, rows=rows, overlap=ov, trace=trace).assign(
                index_format=idx, kv_format=kv, step_phase=phase, overlap_target=ov)


def trace_shape(trace: str, preset: ModelPreset) -> tuple[int, int, int]:
    """(requests, context, rows per request) of a trace a step can replay: every request of
    the same context and rows, since the step's other calls are measured at one shape."""
    from qsa.trace import TraceError, read_trace

    t = read_trace(trace, preset)
    ctx, rows = set(t.context_lens.tolist()), set(t.rows_per_request)
    if len(ctx) != 1 or len(rows) != 1:
        raise TraceError(f"{trace}: a step replays a uniform trace (one context and one row "
                         f"count for every request); this one has contexts {sorted(ctx)[:4]} "
                         f"and rows {sorted(rows)[:4]} (qsa bench --trace replays any trace)")
    return t.context_lens.numel(), ctx.pop(), rows.pop()


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
    step, each with its speedup against the first pair; and `figure` (its folder and stem;
    PNG and SVG), the kernels of every pair stacked side by side with the graph replay marked,
    so a review sees which kernel a format moved."""
    from qsa.workbench.plots import step_stacked_bars

    both = pd.concat(frames, ignore_index=True)
    if "overlap_target" not in both:
        both["overlap_target"] = 0.0
    steps = both[both["phase"] == "step"].pivot_table(
        index=["index_format", "kv_format", "overlap_target"], columns="kernel",
        values="us_per_step", sort=False)
    cmp = pd.DataFrame({"sum_us": steps[SUM_ROW],
                        "graph_us": steps.get("graph replay", float("nan"))}).reset_index()
    cmp["speedup_sum"] = cmp["sum_us"].iloc[0] / cmp["sum_us"]
    cmp["speedup_graph"] = cmp["graph_us"].iloc[0] / cmp["graph_us"]
    both["index/KV"] = both["index_format"] + "/" + both["kv_format"]
    if both["overlap_target"].nunique() > 1:
        both["index/KV"] += " J" + both["overlap_target"].map("{:g}".format)
    calls = both[both["phase"] != "step"]
    step_stacked_bars(calls.assign(call=calls["kernel"] + " (" + calls["phase"] + ")"),
                      figure.parent, x="index/KV", stack="call",
                      totals=both[both["kernel"] == "graph replay"], name=figure.stem,
                      title=title)
    return cmp
