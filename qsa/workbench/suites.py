"""Named benchmark suites: grids of op points and decode steps, with the targets they are held
to, declared as data (one YAML file per suite in `qsa/workbench/suites/`).

`run_suite` measures every point (verified before it is timed) and every step into one
results-store run, then evaluates the targets over that run's rows only, so every ratio is a
side-by-side measurement. A target is `metric` over the rows matching `where`; with `over`, the
value is the metric of the twin row (the same row with the `over` fields changed) divided by
the row's own, i.e. a speedup. The worst matching row decides: the smallest value for a `min`
goal, the largest for a `max` goal.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import pandas as pd

from qsa.measure.files import load_yaml
from qsa.presets import DEFAULT_PRESET, ModelPreset, ShapeError, get_preset
from qsa.workbench.registry import REGISTRY

if TYPE_CHECKING:
    from qsa.measure.results import RunWriter

SUITE_DIR = Path(__file__).with_name("suites")
POINT_AXES = ("op", "batch", "context", "rows", "index_format", "kv_format", "selection",
              "overlap", "sharing")
STEP_KEYS = ("batch", "context", "mtp", "formats", "phase", "rows", "overlap")
METRICS = ("us", "pct_bandwidth", "achieved_tflops", "us_per_step")
# What makes two rows of a run the same measurement but for the fields a target's `over` changes.
IDENTITY = (*POINT_AXES, "record", "kernel", "phase", "mtp", "step_phase",
            "chunk_rows", "overlap_target")
# A grid that stands for every op's smoke points (`OpSpec.smoke`), declared with the ops.
SMOKE_GRID = {"registry": "smoke"}


class SuiteError(ValueError):
    """A suite file is malformed; the message names the file and the field."""


@dataclass(frozen=True)
class Target:
    name: str
    metric: str
    where: dict[str, Any]
    goal: float
    higher_is_better: bool
    over: dict[str, Any] | None = None

    def evaluate(self, rows: pd.DataFrame) -> dict[str, Any]:
        """Value (worst matching verified row), goal, met, and how far it is missed. Rows that
        failed verification are never timed; they are counted in `unverified`."""
        matched = _matching(rows, self.where)
        ok = matched["verified"].eq(True) if "verified" in matched else matched.index.isna()
        unverified = int((~ok).sum())
        good = rows[rows["verified"].eq(True)] if "verified" in rows else rows.iloc[0:0]
        values = []
        for _, r in (matched[ok] if self.metric in rows else matched.iloc[0:0]).iterrows():
            if self.over is None:
                values.append((float(r[self.metric]), _label(r)))
                continue
            same = {k: r[k] for k in IDENTITY if k in r and pd.notna(r[k])}
            twin = _matching(good, {**same, **self.over})
            if len(twin) == 1:
                values.append((float(twin[self.metric].iloc[0]) / float(r[self.metric]),
                               _label(r)))
        out: dict[str, Any] = {"target": self.name, "metric": self.metric, "goal": self.goal,
                               "direction": "min" if self.higher_is_better else "max",
                               "unverified": unverified}
        if not values:
            return {**out, "value": None, "met": None, "miss_pct": None, "worst": None,
                    "note": "no matching row in this run"}
        pick = min if self.higher_is_better else max
        value, worst = pick(values, key=lambda v: v[0])
        met = value >= self.goal if self.higher_is_better else value <= self.goal
        return {**out, "value": value, "met": met, "worst": worst,
                "miss_pct": None if met else 100 * abs(value - self.goal) / self.goal}


@dataclass(frozen=True)
class Suite:
    name: str
    description: str
    preset: ModelPreset
    points: tuple[dict[str, Any], ...]
    steps: tuple[dict[str, Any], ...]
    targets: tuple[Target, ...] = field(default=())


def _label(r: pd.Series) -> str:
    keys = [k for k in (*POINT_AXES, "kernel") if k in r and pd.notna(r[k])]
    return " ".join(f"{k}={r[k]}" for k in keys)


def _matching(rows: pd.DataFrame, where: dict[str, Any]) -> pd.DataFrame:
    mask = pd.Series(True, index=rows.index)
    for k, v in where.items():
        if k not in rows:
            return rows.iloc[0:0]
        mask &= rows[k] == v
    return rows[mask]


def _listed(v: Any) -> list[Any]:
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _expand(grid: dict[str, Any], where: str) -> list[dict[str, Any]]:
    unknown = set(grid) - set(POINT_AXES)
    if unknown:
        raise SuiteError(f"{where}: unknown keys {sorted(unknown)} (axes: {', '.join(POINT_AXES)})")
    if "op" not in grid:
        raise SuiteError(f"{where}: 'op' is required")
    axes = {k: _listed(grid[k]) for k in POINT_AXES if k in grid}
    return [dict(zip(axes, combo)) for combo in itertools.product(*axes.values())]


def smoke_points() -> list[dict[str, Any]]:
    """Every op's smoke points, expanded, each with its op: what the smoke suite runs
    (`SMOKE_GRID`) and the compile check compiles."""
    return [p for spec in REGISTRY for i, g in enumerate(spec.smoke)
            for p in _expand({"op": spec.name, **g}, f"{spec.name}: smoke[{i}]")]


def _grid_points(grid: dict[str, Any], where: str) -> list[dict[str, Any]]:
    return smoke_points() if grid == SMOKE_GRID else _expand(grid, where)


def _target(d: dict[str, Any], where: str) -> Target:
    if not isinstance(d, dict) or "name" not in d or "metric" not in d or "where" not in d:
        raise SuiteError(f"{where}: a target needs name, metric and where")
    if d["metric"] not in METRICS:
        raise SuiteError(f"{where}: metric {d['metric']!r} is not one of {', '.join(METRICS)}")
    if ("min" in d) == ("max" in d):
        raise SuiteError(f"{where}: give exactly one of min or max")
    unknown = set(d) - {"name", "metric", "where", "over", "min", "max"}
    if unknown:
        raise SuiteError(f"{where}: unknown keys {sorted(unknown)}")
    return Target(d["name"], d["metric"], dict(d["where"]), float(d.get("min", d.get("max"))),
                  "min" in d, dict(d["over"]) if d.get("over") else None)


def parse_suite(text: str, source: str) -> Suite:
    d = load_yaml(text, source)
    if not isinstance(d, dict) or "name" not in d:
        raise SuiteError(f"{source}: expected a mapping with a name")
    unknown = set(d) - {"name", "description", "preset", "grids", "steps", "targets"}
    if unknown:
        raise SuiteError(f"{source}: unknown keys {sorted(unknown)}")
    points = [p for i, g in enumerate(d.get("grids") or [])
              for p in _grid_points(g, f"{source}: grids[{i}]")]
    steps = []
    for i, s in enumerate(d.get("steps") or []):
        if set(s) - set(STEP_KEYS) or not {"batch", "context", "formats"} <= set(s):
            raise SuiteError(f"{source}: steps[{i}] needs batch, context, formats "
                             f"(and optionally mtp, phase, rows), got {sorted(s)}")
        if (s.get("phase", "decode") == "prefill") != ("rows" in s):
            raise SuiteError(f"{source}: steps[{i}]: rows go with phase prefill, and a prefill "
                             f"step needs its rows, got {sorted(s)}")
        steps.append(dict(s))
    targets = tuple(_target(t, f"{source}: targets[{i}]")
                    for i, t in enumerate(d.get("targets") or []))
    if not points and not steps:
        raise SuiteError(f"{source}: no grids and no steps")
    return Suite(d["name"], d.get("description", ""), _preset(d.get("preset"), source),
                 tuple(points), tuple(steps), targets)


def _preset(value: Any, source: str) -> ModelPreset:
    """`preset: NAME`, or a mapping {name: NAME, <field>: <value>, ...} of validated overrides
    (small shapes for CPU suites)."""
    try:
        if value is None or isinstance(value, str):
            return get_preset(value or DEFAULT_PRESET)
        if isinstance(value, dict):
            over = dict(value)
            return get_preset(over.pop("name", DEFAULT_PRESET), **over)
    except (ShapeError, TypeError) as e:
        raise SuiteError(f"{source}: preset: {e}") from None
    raise SuiteError(f"{source}: preset: expected a name or a mapping, got {value!r}")


def suite_names() -> list[str]:
    return sorted(p.stem for p in SUITE_DIR.glob("*.yaml"))


def load_suite(name_or_path: str | Path) -> Suite:
    """A suite by name (`headline`) or by the path of a YAML file."""
    path = Path(name_or_path)
    if not path.suffix:
        path = SUITE_DIR / f"{name_or_path}.yaml"
        if not path.is_file():
            raise SuiteError(f"suite {name_or_path!r}: not found; suites: "
                             f"{', '.join(suite_names())}")
    return parse_suite(path.read_text(), str(path))


def run_suite(suite: Suite, root: str | Path = "profiles",
              on_row: Callable[[dict[str, Any]], None] | None = None,
              verify_only: bool = False) -> tuple[Path, list[dict]]:
    """Measure the suite into one results-store run; returns the run directory and the
    evaluated targets (also written to `targets.json` there). A point that fails verification
    or launch is recorded with `verified` False and its error, never timed. `verify_only`:
    every point verified on one input set and not timed, steps and targets skipped (a quick
    check, or a run under a memory checker)."""
    from qsa.formats import format_pairs
    from qsa.measure.files import atomic_write_bytes
    from qsa.measure.results import start_run
    from qsa.workbench.ops import measure
    from qsa.workbench.step import SUM_ROW, step_breakdowns

    preset = dataclasses.asdict(suite.preset)
    with start_run("suite", root=root, extra={"suite": suite.name, "preset": preset,
                                               "points": len(suite.points),
                                               "steps": len(suite.steps),
                                               "verify_only": verify_only}) as run:
        for pt in suite.points:
            args = {"rows": suite.preset.rows_per_verify, **pt}
            try:
                rec = measure(args.pop("op"), preset=suite.preset, timed=not verify_only,
                              **args)
            except (AssertionError, ValueError, RuntimeError) as e:
                rec = {**pt, "verified": False, "error": f"{type(e).__name__}: {e}"}
            rec = {"record": "point", "suite": suite.name, "preset": suite.preset.name, **rec}
            run.add(rec)
            run.flush()
            if on_row:
                on_row(rec)
        for s in () if verify_only else suite.steps:
            for df in step_breakdowns(suite.preset, s["batch"], s["context"], s.get("mtp"),
                                      format_pairs(s["formats"]),
                                      phase=s.get("phase", "decode"), rows=s.get("rows"),
                                      overlaps=_listed(s.get("overlap", 0.0))):
                for r in df.to_dict("records"):
                    rec = {"record": "step", "suite": suite.name, "preset": suite.preset.name,
                           "batch": s["batch"], "context": s["context"], "mtp": s.get("mtp"),
                           "chunk_rows": s.get("rows"), "verified": True, **r}
                    run.add(rec)
                    if on_row and r["kernel"] == SUM_ROW:
                        on_row(rec)
                run.flush()
        rows = pd.DataFrame(run.records)
        results = [] if verify_only else [t.evaluate(rows) for t in suite.targets]
        if not verify_only:
            _figures(run)
        atomic_write_bytes(run.directory / "targets.json",
                           (json.dumps(results, indent=1) + "\n").encode())
        atomic_write_bytes(run.directory / "targets.md",
                           targets_markdown(results, run.run_id).encode())
    return run.directory, results


def _figures(run: RunWriter) -> None:
    """The run's design-review figures next to its results (the `suite` recipe of
    `qsa.workbench.plots`: the roofline of every point, each step's format pairs side by
    side), captioned from the run's own record (device, versions, commit)."""
    from qsa.workbench.plots import figures_for

    figures_for(pd.DataFrame(run.records), run.meta["kind"], run.directory, [run.meta])


def targets_markdown(results: list[dict[str, Any]], run_id: str) -> str:
    """The targets as a Markdown table (what the README's results table is pasted from)."""
    lines = [f"Targets of run `{run_id}` (worst matching row; ratios are side by side in the "
             "run).", "", "| target | value | goal | met | worst point |", "|---|---|---|---|---|"]
    for t in results:
        v = "n/a" if t["value"] is None else f"{t['value']:.4g}"
        goal = f"{'>=' if t['direction'] == 'min' else '<='} {t['goal']:g}"
        met = ("not measured" if t["met"] is None else "met" if t["met"]
               else f"missed by {t['miss_pct']:.1f}%")
        lines.append(f"| {t['target']} | {v} | {goal} | {met} | {t.get('worst') or ''} |")
    return "\n".join(lines) + "\n"
