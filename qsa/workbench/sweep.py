"""Batch sweeps: a YAML spec expands to papermill runs, one process per point, across the GPUs.

Spec (see sweeps/*.yaml)::

    name: decode-scoring                  # names the sweep directory
    notebook: notebooks/decode_scoring_sweep.py
    devices: auto                         # auto | cpu | [0, 1, ...] (indices of visible GPUs)
    workers_per_device: 1                 # optional; CPU default: 1-2 workers in all
    timeout_s: 3600                       # optional, per notebook cell
    kernel_name: python3                  # optional Jupyter kernel
    env: {QSA_STACKED_DECODE_SCORER: "1"} # optional, exported to every point's process
    parameters: {profile: gpu}            # the same for every point
    grid:                                 # cartesian product, one point per combination
      index_format: [bf16, fp8, mxfp4]
      batch: [1, 2, 4, 8, 16, 32, 64]
    report:                               # optional: run once over the results at the end
      notebook: notebooks/design_review.py

Layout: `<out_root>/<device slug>/sweeps/<name>/` holds `sweep.json` (spec, code version,
summary), `points/<param=value__...>/` per point (params.json, the executed notebook.ipynb,
runner.log, results/ in the results-store layout, and point.json), the aggregated
`results.parquet`/`results.csv` of all passed points, and `report/` (executed report notebook
and figures).

Resumption: `point.json` is the done-marker, written atomically and last. A point is skipped
when its marker says passed for the same parameters, env and code version. The code version
is a hash of the qsa package sources and config tables, the notebook file, and the Python,
torch and triton versions - not the git commit: a content hash re-runs exactly when something
that shapes the numbers changed (not for a README edit), and needs no git on a GPU host that
received a copied tree. A point that is re-run starts from an empty directory, so a killed
sweep loses at most its points in flight and never leaves half a point behind or twice.

Failures: a point whose notebook raises is recorded (papermill's ename/evalue, the cell, the
traceback tail) and the sweep goes on. The rare kernel-port race of parallel papermill runs
("zmq ... Address already in use") is retried once.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import importlib.metadata
import itertools
import json
import os
import platform
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from qsa.workbench.notebook_run import (DEFAULT_KERNEL, NotebookError, execute_notebook,
                                        notebook_parameters, notebook_path)

if TYPE_CHECKING:
    import pandas as pd

MARKER = "point.json"
PARAMS = "params.json"
EXECUTED = "notebook.ipynb"
LOG = "runner.log"
RESULTS_DIR = "results"
RESULTS_PARAM = "results_root"
PORT_RACE = "Address already in use"
_PKG = Path(__file__).resolve().parents[1]
_NAME = re.compile(r"[a-z0-9][a-z0-9_-]*")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # colour codes in IPython tracebacks


class SweepError(ValueError):
    """A sweep spec that can not run as written."""


# --- spec --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepSpec:
    name: str
    notebook: Path
    grid: dict[str, list[Any]]
    parameters: dict[str, Any] = field(default_factory=dict)
    devices: Any = "auto"
    workers_per_device: int | None = None
    timeout_s: float | None = None
    kernel_name: str = DEFAULT_KERNEL
    env: dict[str, str] = field(default_factory=dict)
    report_notebook: Path | None = None
    report_parameters: dict[str, Any] = field(default_factory=dict)


def _resolve_notebook(name: str, spec_dir: Path) -> Path:
    for candidate in (Path(name), spec_dir / name, spec_dir.parent / name):
        if candidate.is_file():
            return candidate.resolve()
    return notebook_path(name).resolve()


def load_spec(path: str | Path) -> SweepSpec:
    """Read and check a spec: names, grid values, and that every parameter exists."""
    path = Path(path)
    raw = yaml.safe_load(path.read_text()) or {}
    known = {"name", "notebook", "grid", "parameters", "devices", "workers_per_device",
             "timeout_s", "kernel_name", "env", "report"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise SweepError(f"{path}: unknown keys {unknown}; known: {sorted(known)}")
    for key in ("name", "notebook"):
        if key not in raw:
            raise SweepError(f"{path}: missing {key!r}")
    if not _NAME.fullmatch(str(raw["name"])):
        raise SweepError(f"{path}: name must match [a-z0-9][a-z0-9_-]*, got {raw['name']!r}")
    grid = {str(k): (list(v) if isinstance(v, (list, tuple)) else [v])
            for k, v in (raw.get("grid") or {}).items()}
    empty = sorted(k for k, v in grid.items() if not v)
    if empty:
        raise SweepError(f"{path}: grid dimension(s) {empty} have no values")
    params = dict(raw.get("parameters") or {})
    overlap = sorted(set(grid) & set(params))
    if overlap:
        raise SweepError(f"{path}: {overlap} are both grid dimensions and fixed parameters")
    notebook = _resolve_notebook(str(raw["notebook"]), path.parent)
    names = notebook_parameters(notebook)
    bad = sorted((set(grid) | set(params)) - set(names))
    if bad:
        raise SweepError(f"{path}: {bad} are not parameters of {notebook.name} "
                         f"(it takes {sorted(names)})")
    if RESULTS_PARAM not in names:
        raise SweepError(f"{notebook.name} has no {RESULTS_PARAM!r} parameter; a sweep needs it "
                         "to file each point's results in the point's directory")
    if RESULTS_PARAM in grid or RESULTS_PARAM in params:
        raise SweepError(f"{path}: {RESULTS_PARAM!r} is set by the sweep, not the spec")
    report = raw.get("report") or {}
    if report and "notebook" not in report:
        raise SweepError(f"{path}: report needs a notebook")
    wpd = raw.get("workers_per_device")
    if wpd is not None and (not isinstance(wpd, int) or wpd < 1):
        raise SweepError(f"{path}: workers_per_device must be an integer >= 1, got {wpd!r}")
    return SweepSpec(
        name=str(raw["name"]), notebook=notebook, grid=grid, parameters=params,
        devices=raw.get("devices", "auto"), workers_per_device=wpd,
        timeout_s=raw.get("timeout_s"), kernel_name=str(raw.get("kernel_name", DEFAULT_KERNEL)),
        env={str(k): str(v) for k, v in (raw.get("env") or {}).items()},
        report_notebook=(_resolve_notebook(str(report["notebook"]), path.parent)
                         if report else None),
        report_parameters=dict(report.get("parameters") or {}))


# --- points ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepPoint:
    name: str
    directory: Path
    parameters: dict[str, Any]
    identity: dict[str, Any]  # what the marker must match (with the code version) to skip


def _slug(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return json.dumps(value)  # true / false / null, as the spec wrote them
    if isinstance(value, (list, tuple)):
        return "-".join(_slug(v) for v in value) or "none"
    if isinstance(value, Mapping):
        return "-".join(f"{k}-{_slug(v)}" for k, v in sorted(value.items())) or "none"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", str(value)).strip("-") or "none"


def _canonical(obj: Any) -> Any:
    """JSON round trip: tuples become lists, keys sort, so identities compare as data."""
    return json.loads(json.dumps(obj, sort_keys=True, default=str))


def _digest(obj: Any, n: int = 10) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:n]


def expand_points(spec: SweepSpec, sweep_dir: Path) -> list[SweepPoint]:
    """One point per grid combination, named `<dim>=<value>__...` in grid order."""
    dims = list(spec.grid)
    points, seen = [], set()
    for values in itertools.product(*(spec.grid[d] for d in dims)):
        params = {**spec.parameters, **dict(zip(dims, values))}
        identity = _canonical({"notebook": spec.notebook.name, "parameters": params,
                               "env": spec.env})
        name = "__".join(f"{d}={_slug(v)}" for d, v in zip(dims, values)) or "point"
        if len(name) > 120 or name in seen:  # long or ambiguous after slugging
            name = f"{name[:100]}__{_digest(identity)}"
        seen.add(name)
        points.append(SweepPoint(name, sweep_dir / "points" / name, params, identity))
    return points


def code_version(notebook: Path) -> str:
    """Hash of what shapes a point's numbers: qsa sources and config tables, the notebook,
    and the Python, torch and triton versions."""
    h = hashlib.sha256()
    files = sorted(p for p in _PKG.rglob("*") if p.is_file() and p.suffix in (".py", ".json")
                   and "__pycache__" not in p.parts)
    for p in files:
        h.update(str(p.relative_to(_PKG)).encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(b"notebook\0" + Path(notebook).read_bytes())
    for dist in ("torch", "triton"):
        try:
            h.update(f"{dist}={importlib.metadata.version(dist)}".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{dist}=none".encode())
    h.update(f"python={platform.python_version()}".encode())
    return h.hexdigest()[:16]


def read_marker(point_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((point_dir / MARKER).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def is_done(point: SweepPoint, version: str) -> bool:
    """A point counts as done only when it passed with the same parameters and code."""
    m = read_marker(point.directory)
    return (m is not None and m.get("status") == "passed" and m.get("code_version") == version
            and _canonical(m.get("identity")) == point.identity)


# --- devices -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Slot:
    """One worker's device: a label, the environment that selects it, variables to drop."""

    label: str
    env: dict[str, str]
    unset: tuple[str, ...] = ()


def _parse_ids(text: str | None) -> list[str] | None:
    if text is None:
        return None
    return [t.strip() for t in text.split(",") if t.strip()]


def visible_gpus() -> tuple[str, str, list[str]]:
    """(vendor, env var that selects a GPU, ids of the GPUs this process may use).

    NVIDIA: CUDA_VISIBLE_DEVICES. AMD: ROCR_VISIBLE_DEVICES (what proton expects), unless the
    caller narrowed the GPUs with HIP_/CUDA_VISIBLE_DEVICES, whose ids are then kept.
    """
    import torch

    if not torch.cuda.is_available():
        return "cpu", "", []
    count = torch.cuda.device_count()
    if torch.version.hip is None:
        var, vendor = "CUDA_VISIBLE_DEVICES", "nvidia"
    else:
        vendor = "amd"
        var = next((v for v in ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
                    if v in os.environ), "ROCR_VISIBLE_DEVICES")
    ids = _parse_ids(os.environ.get(var)) or [str(i) for i in range(count)]
    return vendor, var, ids[:count]


def default_cpu_workers() -> int:
    """Interpreter runs are single-threaded numpy: 2 workers when there are cores for it."""
    return 2 if (os.cpu_count() or 1) >= 4 else 1


def _cpu_slots(n: int) -> list[Slot]:
    threads = str(max(1, (os.cpu_count() or 1) // n))
    env = {"CUDA_VISIBLE_DEVICES": "-1", "HIP_VISIBLE_DEVICES": "-1", "TRITON_INTERPRET": "1",
           "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    return [Slot(f"cpu#{i}", env) for i in range(n)]


def resolve_slots(devices: Any, workers_per_device: int | None = None,
                  jobs: int | None = None) -> list[Slot]:
    """Worker slots for `devices` ("auto", "cpu", or GPU indices); `jobs` caps the total."""
    if jobs is not None and jobs < 1:
        raise SweepError(f"jobs must be >= 1, got {jobs}")
    if devices == "cpu":
        return _cpu_slots(jobs or workers_per_device or default_cpu_workers())
    vendor, var, ids = visible_gpus()
    if devices == "auto":
        chosen = ids
    elif isinstance(devices, (list, tuple)) and devices:
        try:
            chosen = [ids[int(i)] for i in devices]
        except (IndexError, ValueError):
            raise SweepError(f"devices {devices} are not indices of the {len(ids)} visible "
                             f"GPUs") from None
    else:
        raise SweepError(f"devices must be 'auto', 'cpu' or a list of GPU indices, "
                         f"got {devices!r}")
    if not chosen:
        return _cpu_slots(jobs or workers_per_device or default_cpu_workers())
    per = workers_per_device or 1
    order = [gpu for _ in range(per) for gpu in chosen]  # spread workers over GPUs first
    n = jobs or len(order)
    threads = str(max(1, (os.cpu_count() or 1) // n))
    slots = []
    for i in range(n):
        gpu = order[i % len(order)]
        # With ROCR selecting the GPU, HIP_/CUDA_VISIBLE_DEVICES would index into its list.
        unset = (("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
                 if var == "ROCR_VISIBLE_DEVICES" else ())
        slots.append(Slot(f"{vendor}:{gpu}", {var: gpu, "OMP_NUM_THREADS": threads}, unset))
    return slots


def device_slug_for(slots: Sequence[Slot]) -> str:
    """The results-store directory of the sweep's device, as the first worker sees it.

    Asked in a child process, so the driver never creates a GPU context it would hold (and
    take memory on that GPU) for the whole sweep.
    """
    if all(s.label.startswith("cpu") for s in slots):
        return "cpu-interpreter"
    out = subprocess.run([sys.executable, "-c", "from qsa.measure.device import detect_device; "
                          "print(detect_device().slug)"], capture_output=True, text=True,
                         env=_child_env(slots[0], {}), check=True, timeout=300)
    return out.stdout.strip().splitlines()[-1]


# --- running -----------------------------------------------------------------------------------


def _utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat()


def _write_json(path: Path, data: Any) -> None:
    from qsa.measure.files import atomic_write_bytes

    atomic_write_bytes(path, (json.dumps(data, indent=2, sort_keys=True, default=str)
                              + "\n").encode())


def _reset_point_dir(directory: Path) -> None:
    """Empty a point before (re-)running it; the marker goes first, so a crash mid-way can
    never leave a marker next to stale files."""
    (directory / MARKER).unlink(missing_ok=True)
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)


def _log_tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except FileNotFoundError:
        return ""


def _child_env(slot: Slot, spec_env: Mapping[str, str]) -> dict[str, str]:
    env = {**os.environ, **spec_env, **slot.env, "PYTHONUNBUFFERED": "1",
           "QSA_SWEEP_PARENT": str(os.getpid())}
    return {k: v for k, v in env.items() if k not in slot.unset}


def run_point(point: SweepPoint, spec: SweepSpec, version: str, slot: Slot,
              stop: threading.Event | None = None) -> dict[str, Any]:
    """Run one point in its own process and return its marker; one retry on the port race."""
    marker: dict[str, Any] = {}
    for attempt in (1, 2):
        _reset_point_dir(point.directory)
        _write_json(point.directory / PARAMS, {
            "notebook": str(spec.notebook), "parameters": point.parameters,
            "identity": point.identity, "code_version": version, "kernel_name": spec.kernel_name,
            "timeout_s": spec.timeout_s, "slot": slot.label, "attempt": attempt})
        with open(point.directory / LOG, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "qsa.workbench.sweep", "run-point",
                                     str(point.directory)], stdout=log, stderr=subprocess.STDOUT,
                                    env=_child_env(slot, spec.env), stdin=subprocess.DEVNULL)
            while True:
                try:
                    proc.wait(timeout=0.2)
                    break
                except subprocess.TimeoutExpired:
                    if stop is not None and stop.is_set():
                        proc.terminate()
        marker = read_marker(point.directory) or {}
        if not marker:
            marker = _marker(point, version, slot, "failed", attempt=attempt, error={
                "ename": "RunnerExited", "evalue": f"point runner exited with code "
                f"{proc.returncode} before recording a result", "log_tail": _log_tail(
                    point.directory / LOG)})
            _write_json(point.directory / MARKER, marker)
        error_text = json.dumps(marker.get("error") or {}) + _log_tail(point.directory / LOG)
        if marker["status"] == "failed" and attempt == 1 and PORT_RACE in error_text:
            continue
        break
    return marker


def _marker(point_or_params: SweepPoint | Mapping[str, Any], version: str, slot: Slot | str,
            status: str, **extra: Any) -> dict[str, Any]:
    identity = (point_or_params.identity if isinstance(point_or_params, SweepPoint)
                else point_or_params["identity"])
    return {"status": status, "identity": identity, "code_version": version,
            "slot": slot if isinstance(slot, str) else slot.label, "finished_at": _utc_now(),
            **extra}


def _die_with_parent() -> None:
    """Linux: get SIGKILLed when the sweep driver dies, so a killed sweep leaves no runner
    behind to race its resumption (the notebook kernel exits when its parent, us, is gone)."""
    parent = os.environ.get("QSA_SWEEP_PARENT")
    if not sys.platform.startswith("linux") or parent is None:
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # the driver died before prctl took effect
        os._exit(1)


def _finished_runs(results_root: Path) -> list[str]:
    runs = []
    for run_file in sorted(results_root.glob("*/*/run.json")):
        if json.loads(run_file.read_text()).get("status") == "finished":
            runs.append(str(run_file.parent.relative_to(results_root)))
    return runs


def _run_point_process(point_dir: Path) -> int:
    """Body of the point runner process: execute the notebook, then write the marker last."""
    from papermill.exceptions import PapermillExecutionError

    _die_with_parent()
    p = json.loads((point_dir / PARAMS).read_text())
    version, slot, t0 = p["code_version"], p["slot"], time.monotonic()
    started = _utc_now()
    results_root = point_dir / RESULTS_DIR
    common = {"attempt": p["attempt"], "started_at": started,
              "env": {k: v for k, v in os.environ.items() if k != "QSA_SWEEP_PARENT" and (
                  k.startswith(("QSA_", "TRITON_")) or k.endswith("VISIBLE_DEVICES"))}}
    try:
        execute_notebook(p["notebook"], point_dir / EXECUTED,
                         {**p["parameters"], RESULTS_PARAM: str(results_root)},
                         kernel_name=p["kernel_name"], timeout_s=p["timeout_s"])
    except PapermillExecutionError as exc:
        error = {"ename": exc.ename, "evalue": exc.evalue, "cell_index": exc.cell_index,
                 "traceback": _ANSI.sub("", "\n".join(exc.traceback[-8:]))}
    except Exception as exc:  # kernel died, timeout, bad parameters: all recorded, none fatal
        error = {"ename": type(exc).__name__, "evalue": str(exc),
                 "traceback": "".join(traceback.format_exception(exc)[-8:])}
    else:
        runs = _finished_runs(results_root) if results_root.is_dir() else []
        if runs:
            _write_json(point_dir / MARKER, _marker(
                p, version, slot, "passed", runs=runs, duration_s=time.monotonic() - t0,
                **common))
            return 0
        error = {"ename": "NoResults", "evalue": f"the notebook finished but wrote no finished "
                 f"run under {results_root} (it must pass {RESULTS_PARAM} to start_run)"}
    _write_json(point_dir / MARKER, _marker(p, version, slot, "failed", error=error,
                                            duration_s=time.monotonic() - t0, **common))
    return 1


# --- results of a sweep ------------------------------------------------------------------------


def load_sweep(sweep_dir: str | Path, kind: str | None = None) -> pd.DataFrame:
    """Results of every passed point, through the results store, with a `sweep_point` column."""
    import pandas as pd

    from qsa.measure.results import RUN_COLUMNS, load_runs

    frames = []
    for marker_path in sorted(Path(sweep_dir).glob(f"points/*/{MARKER}")):
        marker = json.loads(marker_path.read_text())
        if marker.get("status") != "passed":
            continue
        df = load_runs(marker_path.parent / RESULTS_DIR, kind=kind)
        if not df.empty:
            df.insert(len(RUN_COLUMNS), "sweep_point", marker_path.parent.name)
            frames.append(df)
    if not frames:
        return pd.DataFrame(columns=[*RUN_COLUMNS, "sweep_point"])
    return pd.concat(frames, ignore_index=True)


def _write_table(df: pd.DataFrame, sweep_dir: Path) -> Path | None:
    import io

    from qsa.measure.files import atomic_write_bytes

    if df.empty:
        return None
    atomic_write_bytes(sweep_dir / "results.csv", df.to_csv(index=False).encode())
    buf = io.BytesIO()
    try:
        df.to_parquet(buf, index=False)
    except (TypeError, ValueError):  # points of different notebooks may not form one table
        return sweep_dir / "results.csv"
    atomic_write_bytes(sweep_dir / "results.parquet", buf.getvalue())
    return sweep_dir / "results.parquet"


@dataclass
class SweepSummary:
    name: str
    sweep_dir: Path
    total: int
    passed: int
    failed: int
    skipped: int
    failures: list[dict[str, Any]]
    results_path: Path | None = None
    report_notebook: Path | None = None
    figures_dir: Path | None = None
    report_error: str | None = None

    @property
    def ok(self) -> bool:
        return self.failed == 0 and self.report_error is None

    def __str__(self) -> str:
        lines = [f"sweep {self.name}: {self.total} points - passed {self.passed}, failed "
                 f"{self.failed}, skipped {self.skipped} (already done)",
                 f"  points (executed notebooks, per-point results): {self.sweep_dir / 'points'}"]
        for f in self.failures:
            lines.append(f"  FAILED {f['point']}: {f['ename']}: {str(f['evalue'])[:300]}")
        if self.results_path:
            lines.append(f"  results table: {self.results_path}")
        if self.report_notebook:
            lines.append(f"  report notebook: {self.report_notebook}")
        if self.figures_dir:
            lines.append(f"  figures: {self.figures_dir}")
        if self.report_error:
            lines.append(f"  REPORT FAILED: {self.report_error}")
        return "\n".join(lines)


def run_sweep(spec_path: str | Path, out_root: str | Path = "profiles", jobs: int | None = None,
              resume: bool = True, progress: bool = True) -> SweepSummary:
    """Run every point of a spec (skipping done ones when `resume`), then the report."""
    from tqdm.auto import tqdm

    spec = load_spec(spec_path)
    slots = resolve_slots(spec.devices, spec.workers_per_device, jobs)
    sweep_dir = Path(out_root).resolve() / device_slug_for(slots) / "sweeps" / spec.name
    sweep_dir.mkdir(parents=True, exist_ok=True)
    version = code_version(spec.notebook)
    points = expand_points(spec, sweep_dir)
    todo = [p for p in points if not (resume and is_done(p, version))]
    meta = {"spec": str(Path(spec_path).resolve()), "notebook": str(spec.notebook),
            "code_version": version, "slots": [s.label for s in slots],
            "started_at": _utc_now(), "status": "running", "points": len(points)}
    _write_json(sweep_dir / "sweep.json", meta)

    free: queue.Queue[Slot] = queue.Queue()
    for s in slots:
        free.put(s)
    stop = threading.Event()

    def work(point: SweepPoint) -> tuple[SweepPoint, dict[str, Any]]:
        slot = free.get()
        try:
            return point, run_point(point, spec, version, slot, stop)
        finally:
            free.put(slot)

    passed, failures = 0, []
    skipped = len(points) - len(todo)
    bar = tqdm(total=len(points), initial=skipped, desc=spec.name, unit="point",
               disable=not progress, dynamic_ncols=True)
    bar.set_postfix(passed=0, failed=0, skipped=skipped)
    pool = ThreadPoolExecutor(max_workers=len(slots))
    try:
        futures = [pool.submit(work, p) for p in todo]
        for fut in as_completed(futures):
            point, marker = fut.result()
            if marker.get("status") == "passed":
                passed += 1
            else:
                err = marker.get("error") or {}
                failures.append({"point": point.name, "ename": err.get("ename"),
                                 "evalue": err.get("evalue"), "cell_index": err.get("cell_index")})
            bar.set_postfix(passed=passed, failed=len(failures), skipped=skipped, refresh=False)
            bar.update(1)
    except BaseException:
        stop.set()  # Ctrl-C: stop the runners, keep every finished point
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        bar.close()

    summary = SweepSummary(spec.name, sweep_dir, len(points), passed, len(failures), skipped,
                           failures)
    summary.results_path = _write_table(load_sweep(sweep_dir), sweep_dir)
    if spec.report_notebook is not None and summary.results_path is not None:
        _run_report(spec, sweep_dir, summary)
    meta.update(status="finished", finished_at=_utc_now(), passed=passed, failed=len(failures),
                skipped=skipped, failures=failures, report_error=summary.report_error)
    _write_json(sweep_dir / "sweep.json", meta)
    return summary


def _run_report(spec: SweepSpec, sweep_dir: Path, summary: SweepSummary) -> None:
    """Execute the report notebook over the sweep's stored results (no device needed)."""
    from papermill.exceptions import PapermillExecutionError

    report = sweep_dir / "report"
    shutil.rmtree(report, ignore_errors=True)
    out_nb = report / f"{spec.report_notebook.stem}.ipynb"
    params = {**spec.report_parameters, "sweep_dir": str(sweep_dir),
              "figures_dir": str(report / "figures")}
    try:
        execute_notebook(spec.report_notebook, out_nb, params, kernel_name=spec.kernel_name,
                         timeout_s=spec.timeout_s)
    except PapermillExecutionError as exc:
        summary.report_error = f"{exc.ename}: {exc.evalue}"
    except (NotebookError, RuntimeError, OSError) as exc:
        summary.report_error = f"{type(exc).__name__}: {exc}"
    summary.report_notebook = out_nb if out_nb.exists() else None
    summary.figures_dir = report / "figures" if (report / "figures").is_dir() else None


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "run-point":
        sys.exit(_run_point_process(Path(sys.argv[2])))
    sys.exit("usage: python -m qsa.workbench.sweep run-point <point dir> (internal; run "
             "sweeps with `qsa sweep`)")
