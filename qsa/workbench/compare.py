"""A/B comparison of two result sets, point by point, with a verdict from a statistical test.

Typical uses: the same sweep with `QSA_STACKED_DECODE_SCORER=0` and `=1`, or at two commits.
Points are matched on their shape columns. Each matched pair gets a 95% bootstrap confidence
interval of its speedup, the ratio of the medians A / B, resampling the per-sample times the
results store keeps (`scipy.stats.bootstrap`, percentile method, fixed seed): B is "faster"
when the whole interval lies above 1, "slower" when it lies below 1, else "same". The interval
covers the noise within each run only, not what changes from one process to the next.
Pairs that can not be compared honestly (different timing method or cache policy, an
interpreter run, an unverified kernel, too few stored samples, a graph replay whose sample was
too short for the replay's own cost to vanish) are "incomparable", never silently ranked.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats

from qsa.measure.files import atomic_write_bytes
from qsa.measure.results import INTERNAL_ENV, new_run_id
from qsa.measure.timing import METHOD_GRAPH, SIZING_HOST

DEFAULT_KEYS: tuple[str, ...] = ("op", "preset", "batch", "context", "rows", "index_format",
                                 "kv_format", "selection")
VERDICTS: tuple[str, ...] = ("faster", "slower", "same", "incomparable", "only_a", "only_b")
_TIMING_COLS = ("us", "p10_us", "p90_us", "iqr_us", "n_samples", "samples_us", "method",
                "cache_policy", "functional_only", "verified", "calls_per_sample", "sizing")
# A graph replay's own cost (about 10 us on the H200) is spread over the calls of a sample; a
# sample of at least this much device time keeps it near 1% of the per-call time.
MIN_HOST_SIZED_SAMPLE_US = 1000.0
CONFIDENCE = 0.95
RESAMPLES = 2000
MIN_SAMPLES = 5  # fewer stored samples make no interval worth the name
TEST = (f"{CONFIDENCE:.0%} bootstrap interval of the ratio of medians (scipy.stats.bootstrap, "
        f"percentile, {RESAMPLES:,} resamples of the stored per-sample times)")


def _ratio_of_medians(a: np.ndarray, b: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.median(a, axis=axis) / np.median(b, axis=axis)


def speedup_interval(samples_a: Sequence[float], samples_b: Sequence[float]
                     ) -> tuple[float, float]:
    """The `CONFIDENCE` bootstrap interval of median(A) / median(B) (seeded: the same samples
    always give the same interval, so a regenerated table does not change)."""
    res = stats.bootstrap((np.asarray(samples_a, float), np.asarray(samples_b, float)),
                          _ratio_of_medians, n_resamples=RESAMPLES, vectorized=True,
                          confidence_level=CONFIDENCE, method="percentile",
                          rng=np.random.default_rng(0))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def verdict(a: Mapping[str, Any], b: Mapping[str, Any]) -> tuple[str, float, float, str]:
    """(verdict of B against A, low and high end of the speedup interval, reason) for two
    records."""
    for side, rec in (("A", a), ("B", b)):
        if _flag(rec.get("functional_only")):
            return "incomparable", math.nan, math.nan, f"{side} is a functional (CPU) run"
        if "verified" in rec and not _flag(rec.get("verified")):
            return "incomparable", math.nan, math.nan, f"{side} failed verification"
        if not (rec.get("us", math.nan) > 0):
            return "incomparable", math.nan, math.nan, f"{side} has no timing"
        short = _short_host_sized_graph(rec)
        if short:
            return "incomparable", math.nan, math.nan, f"{side} {short}"
    taken = [(str(r.get("method", "")), str(r.get("cache_policy", ""))) for r in (a, b)]
    if taken[0] != taken[1]:
        return ("incomparable", math.nan, math.nan, "can not compare timings taken "
                f"differently: {'/'.join(taken[0])} vs {'/'.join(taken[1])}")
    samples = [_samples(r) for r in (a, b)]
    for side, x in zip("AB", samples):
        if len(x) < MIN_SAMPLES:
            return ("incomparable", math.nan, math.nan, f"{side} keeps {len(x)} per-sample "
                    f"times; the test needs {MIN_SAMPLES}")
    lo, hi = speedup_interval(*samples)
    return ("faster" if lo > 1 else "slower" if hi < 1 else "same"), lo, hi, ""


def _samples(rec: Mapping[str, Any]) -> np.ndarray:
    """A record's stored per-sample times (µs per call), positive and finite."""
    v = rec.get("samples_us")
    x = np.asarray([] if v is None or _nan(v) else v, dtype=float).ravel()
    return x[np.isfinite(x) & (x > 0)]


def _short_host_sized_graph(rec: Mapping[str, Any]) -> str:
    """Why a graph-replay record's median carries part of the replay's own cost, or "".

    Before samples were sized by device time (records without `sizing`), a graph held as many
    calls as the host could launch in 1 ms, often 1-7 for a few-us kernel, so each call
    carried a share of the replay's cost that moved with the host
    (profiles/nvidia-h200/timing-sizing/NOTES.md). Such a record is kept out of comparisons
    when its sample held less than MIN_HOST_SIZED_SAMPLE_US of calls."""
    if rec.get("method") != METHOD_GRAPH:
        return ""
    sizing = rec.get("sizing")
    calls = rec.get("calls_per_sample")
    if (not _nan(sizing) and sizing != SIZING_HOST) or _nan(calls):
        return ""
    sample_us = float(calls) * float(rec["us"])
    if sample_us >= MIN_HOST_SIZED_SAMPLE_US:
        return ""
    return (f"is a graph replay sized by host launch time: {int(calls)} calls per sample "
            f"({sample_us:.0f} us), so each call carries part of the replay's own cost; "
            "re-run it (samples are now sized by device time)")


def _flag(v: Any) -> bool:
    return False if v is None or _nan(v) else bool(v)


def _nan(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


@dataclass(frozen=True)
class Comparison:
    """Per-point table (keys, A and B timings, speedup = A µs / B µs, verdict) and its summary."""

    table: pd.DataFrame
    keys: tuple[str, ...]
    label_a: str
    label_b: str
    device: Mapping[str, Any] | None = None  # the run.json device record of both runs

    @property
    def counts(self) -> dict[str, int]:
        vc = self.table["verdict"].value_counts()
        return {v: int(vc.get(v, 0)) for v in VERDICTS}

    @property
    def geomean_speedup(self) -> float:
        """Geometric mean of A/B over the comparable points (nan when there are none)."""
        ok = self.table[self.table["verdict"].isin(("faster", "slower", "same"))]["speedup"]
        return float(np.exp(np.log(ok).mean())) if len(ok) else math.nan

    def summary(self) -> str:
        c = self.counts
        matched = c["faster"] + c["slower"] + c["same"] + c["incomparable"]
        lines = [f"B = {self.label_b} against A = {self.label_a}, matched on "
                 f"{', '.join(self.keys)}: {matched} points",
                 f"  verdict: {TEST}; faster or slower when it excludes 1",
                 f"  faster {c['faster']} · slower {c['slower']} · same within noise "
                 f"{c['same']} · incomparable {c['incomparable']}",
                 f"  only in A {c['only_a']} · only in B {c['only_b']}"]
        if not math.isnan(self.geomean_speedup):
            lines.append(f"  geometric-mean speedup A/B over comparable points: "
                         f"{self.geomean_speedup:.3f}x")
        reasons = self.table.loc[self.table["verdict"] == "incomparable", "reason"]
        if len(reasons):
            lines.append(f"  incomparable because: {reasons.value_counts().index[0]}"
                         + (" (and others)" if reasons.nunique() > 1 else ""))
        return "\n".join(lines)


def _unique_points(df: pd.DataFrame, keys: Sequence[str], side: str) -> pd.DataFrame:
    dup = df.duplicated(list(keys), keep=False)
    if dup.any():
        first = df.loc[dup, list(keys)].iloc[0].to_dict()
        raise ValueError(f"result set {side} has {int(dup.sum())} rows sharing keys, e.g. "
                         f"{first}; add the column that tells them apart to `keys`, or keep one "
                         "run per point with latest_per_point()")
    return df


def compare(a: pd.DataFrame, b: pd.DataFrame, *, keys: Sequence[str] | None = None,
            label_a: str = "A", label_b: str = "B",
            device: Mapping[str, Any] | None = None) -> Comparison:
    """Match A and B on `keys` (default: the DEFAULT_KEYS both have) and judge each pair."""
    keys = tuple(keys) if keys is not None else tuple(k for k in DEFAULT_KEYS
                                                       if k in a and k in b)
    missing = [k for k in keys if k not in a or k not in b]
    if not keys or missing:
        raise KeyError(f"compare needs key columns present in both sets; missing {missing}")
    cols = [c for c in _TIMING_COLS if c in a or c in b]
    left = _unique_points(a, keys, label_a).reindex(columns=[*keys, *cols])
    right = _unique_points(b, keys, label_b).reindex(columns=[*keys, *cols])
    merged = left.merge(right, on=list(keys), how="outer", suffixes=("_a", "_b"),
                        indicator=True)
    rows = []
    for rec in merged.to_dict("records"):
        ra = {c: rec.get(f"{c}_a") for c in cols}
        rb = {c: rec.get(f"{c}_b") for c in cols}
        if rec["_merge"] == "left_only":
            v, lo, hi, reason = "only_a", math.nan, math.nan, ""
        elif rec["_merge"] == "right_only":
            v, lo, hi, reason = "only_b", math.nan, math.nan, ""
        else:
            v, lo, hi, reason = verdict(ra, rb)
        us_a, us_b = ra.get("us"), rb.get("us")
        speedup = (us_a / us_b if not _nan(us_a) and not _nan(us_b) and us_b > 0 else math.nan)
        rows.append({**{k: rec[k] for k in keys}, "us_a": us_a, "us_b": us_b,
                     "iqr_us_a": ra.get("iqr_us"), "iqr_us_b": rb.get("iqr_us"),
                     "speedup": speedup, "speedup_lo": lo, "speedup_hi": hi, "verdict": v,
                     "reason": reason})
    table = pd.DataFrame(rows, columns=[*keys, "us_a", "us_b", "iqr_us_a", "iqr_us_b",
                                        "speedup", "speedup_lo", "speedup_hi", "verdict",
                                        "reason"])
    return Comparison(table, keys, label_a, label_b, device)


def run_differences(meta_a: Mapping[str, Any], meta_b: Mapping[str, Any]) -> dict[str, Any]:
    """What differs between two runs' run.json: env toggles (not the workbench's own
    variables, `INTERNAL_ENV`, which older runs recorded), git commit, versions, device."""
    out: dict[str, Any] = {}
    env_a, env_b = meta_a.get("env") or {}, meta_b.get("env") or {}
    env = {k: (env_a.get(k), env_b.get(k)) for k in sorted(set(env_a) | set(env_b))
           if env_a.get(k) != env_b.get(k) and k not in INTERNAL_ENV}
    if env:
        out["env"] = env
    for key in ("git", "versions"):
        a, b = meta_a.get(key) or {}, meta_b.get(key) or {}
        diff = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
        if diff:
            out[key] = diff
    slug_a, slug_b = meta_a["device"]["slug"], meta_b["device"]["slug"]
    if slug_a != slug_b:
        out["device"] = (slug_a, slug_b)
    return out


def _run_label(meta: Mapping[str, Any], diff: Mapping[str, Any], side: int) -> str:
    """A label naming what sets this run apart: its env toggles, or its revision (as `qsa ab`
    records it: HEAD~1, working tree) and commit, else its run id."""
    parts = [f"{k}={v[side]}" for k, v in diff.get("env", {}).items()]
    git = diff.get("git", {})
    if "commit" in git or "revision" in git:
        commit = (meta.get("git") or {}).get("commit")
        name = f"commit {commit[:10] if commit else 'unknown'}"
        revision = (meta.get("git") or {}).get("revision")
        parts.append(f"{revision} ({name})" if revision else name)
    return ", ".join(parts) or meta["run_id"]


def load_result_set(path: str | Path) -> tuple[pd.DataFrame, dict[str, Any]]:
    """The measured points of a stored run (a folder with run.json) or of a sweep (a folder
    with sweep.json: every passed point, newest run per point), and a run.json-like record
    (device, env, git, versions, run_id) of it. Suite step rows are left out: they are not
    points."""
    from qsa.measure.results import RUN_FILE, load_run

    path = Path(path)
    if (path / RUN_FILE).is_file():
        df, meta = load_run(path)
    elif (path / "sweep.json").is_file():
        from qsa.workbench.sweep import load_sweep

        df = latest_per_point(load_sweep(path))
        if df.empty:
            raise ValueError(f"{path}: the sweep has no passed point to compare")
        runs = sorted(path.glob(f"points/*/results/*/*/{RUN_FILE}"))
        first = json.loads(runs[0].read_text()) if runs else {}
        meta = {"run_id": json.loads((path / "sweep.json").read_text()).get("name", path.name),
                "device": first.get("device") or {"slug": str(df["device"].iloc[0])},
                **{k: first.get(k) or {} for k in ("env", "git", "versions")}}
    else:
        raise ValueError(f"{path}: neither a run (no run.json) nor a sweep (no sweep.json)")
    if "record" in df:
        df = df[df["record"] == "point"].reset_index(drop=True)
    return df, meta


def compare_runs(run_a: str | Path, run_b: str | Path, *,
                 keys: Sequence[str] | None = None) -> tuple[Comparison, dict[str, Any]]:
    """Compare two stored runs or sweeps; also returns what differs between them (env, commit,
    ...)."""
    (da, ma), (db, mb) = load_result_set(run_a), load_result_set(run_b)
    diff = run_differences(ma, mb)
    if "device" in diff:
        raise ValueError(f"runs are from different devices {diff['device']}; an A/B needs one "
                         "device")
    return compare(da, db, keys=keys, label_a=_run_label(ma, diff, 0),
                   label_b=_run_label(mb, diff, 1), device=mb["device"]), diff


def output_folder(out: str | Path | None, root: str | Path, cmp: Comparison,
                  inputs: Sequence[str | Path]) -> Path:
    """Where a comparison's files go: `out`, or a new `<root>/<device slug>/compare/<id>`;
    never inside an input (a committed run must stay as it was measured). Refused with a
    ValueError before anything is created."""
    slug = (cmp.device or {}).get("slug", "unknown-device")
    folder = Path(out) if out is not None else Path(root) / slug / "compare" / new_run_id(
        "compare")
    for side, path in zip("AB", inputs):
        if folder.resolve().is_relative_to(Path(path).resolve()):
            raise ValueError(f"--out: {folder} is inside input {side} ({path}); a comparison "
                             "is written to a folder of its own")
    return folder


def write_comparison(cmp: Comparison, diff: Mapping[str, Any], folder: Path,
                     run_a: str | Path, run_b: str | Path) -> Path:
    """`compare.csv` (the per-point table) and `compare.json` (the inputs, the test, the counts
    and what differs), so the folder says what it compared; returns the CSV's path."""
    folder.mkdir(parents=True, exist_ok=True)
    table = folder / "compare.csv"
    atomic_write_bytes(table, cmp.table.to_csv(index=False).encode())
    index = {"a": str(run_a), "b": str(run_b), "label_a": cmp.label_a, "label_b": cmp.label_b,
             "keys": list(cmp.keys), "test": TEST, "counts": cmp.counts,
             "geomean_speedup": None if math.isnan(cmp.geomean_speedup)
             else cmp.geomean_speedup, "differs": diff, "device": dict(cmp.device or {})}
    atomic_write_bytes(folder / "compare.json",
                       (json.dumps(index, indent=1, default=str) + "\n").encode())
    return table


# Columns that also tell points apart when present: a forced split count, an FP8 flavour, and
# the env toggles of the measured call.
POINT_COLUMNS: tuple[str, ...] = ("split", "fp8_dtype", "env")


def latest_per_point(df: pd.DataFrame, keys: Sequence[str] | None = None) -> pd.DataFrame:
    """Keep, for each point, the rows of the newest run that measured it (run ids sort by
    start time), so re-measured points do not appear twice in a figure or a comparison.
    keys: what identifies a point; default DEFAULT_KEYS plus POINT_COLUMNS, where present."""
    keys = [k for k in (keys or (*DEFAULT_KEYS, *POINT_COLUMNS)) if k in df]
    if not keys or "run_id" not in df or df.empty:
        return df
    newest = df.groupby(keys, dropna=False)["run_id"].transform("max")
    return df[df["run_id"] == newest].reset_index(drop=True)
