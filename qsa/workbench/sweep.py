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
status, summary, and the spec's points with their identities), `sweep.lock`,
`points/<param=value__...>/` per point (params.json, the executed notebook.ipynb, runner.log,
results/ in the results-store layout, manifest.json and point.json), the aggregated
`results.parquet`/`results.csv` of the spec's passed points, and `report/` (executed report
notebook and figures).

The table: built from the points of the spec only, each at most once (a spec can not list a
grid value twice, and a point is looked up by its one folder name), from its folder when the
folder's marker is for that point's parameters. Any other folder under points/ - a copy such as
`points/<point>.bak`, or a point dropped from a narrowed grid - is left out of the table and
reported (a warning, `left_out` in sweep.json, a line of the summary); nothing deletes it, so a
point dropped from the grid and added back later resumes from its folder like any other.
`load_sweep` takes the spec's points from the last run's sweep.json; for a sweep.json written
before runs recorded them, each recorded point identity counts once (the first folder by name
holding it; the others are reported as copies), and a dropped point can not be told apart there.

One writer per sweep folder: a run holds an exclusive `flock` on `sweep.lock` (which names its
PID and host) for its whole length, and a second run into the same folder is refused at once
(`SweepLocked`) - two writers would run every point twice. The kernel drops the lock when the
process dies, however it dies, so a killed run never blocks the next one.

Resumption: `point.json` is the done-marker, written atomically and last. Before it, the runner
writes `manifest.json`: the size and sha256 of every file under the point's results/, and the
marker carries the manifest's own sha256. A point is skipped when its marker says passed for
the same parameters, env and code version and every file still matches the manifest; a point
whose files are missing, truncated or changed, or whose manifest or marker is missing or
unreadable, is logged with the reason and run again - its numbers are never used, and the
damage never stops the sweep. The code version is a hash of the qsa package sources and config
tables, the notebook file, and the Python, torch and triton versions - not the git commit: a
content hash re-runs exactly when something that shapes the numbers changed (not for a README
edit), and needs no git on a GPU host that received a copied tree. A point that is re-run
starts from an empty directory, so a killed sweep loses at most its points in flight and never
leaves half a point behind or twice.

Interruption: Ctrl-C or SIGTERM stops the runners, keeps every finished point, records status
`interrupted` in sweep.json and prints the command that resumes. After a hard kill (SIGKILL,
power loss) sweep.json still says `running`; the next run, holding the lock and so knowing no
one else is, reports that run as interrupted and resumes.

Failures: a point whose notebook raises is recorded (papermill's ename/evalue, the cell, the
traceback tail) and the sweep goes on. The rare kernel-port race of parallel papermill runs
("zmq ... Address already in use") is retried once.

Layers: this module is the driver (lock, resume decisions, this host's worker slots, the table
and the report). What one point is and how it runs (spec, points, markers, manifests, the point
runner process) is `qsa.workbench.sweep_point`, below both this driver and the Ray backend
`qsa.workbench.sweep_ray` it dispatches to.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import platform
import queue
import shlex
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qsa.workbench import sweep_ray
from qsa.workbench.notebook_run import NotebookError, execute_notebook
from qsa.workbench.sweep_point import (MARKER, RESULTS_DIR, Executor, Slot, SweepError,
                                       SweepPoint, SweepSpec, canonical, code_version, cpu_env,
                                       device_slug_for, expand_points, load_spec, point_damage,
                                       read_marker, run_point, utc_now, write_json)

if TYPE_CHECKING:
    import pandas as pd

SWEEP_META = "sweep.json"
LOCK = "sweep.lock"
log = logging.getLogger(__name__)


class SweepLocked(RuntimeError):
    """Another live run holds the sweep folder; a second writer would run every point twice."""


class SweepTerminated(KeyboardInterrupt):
    """SIGTERM during a sweep: unwinds like Ctrl-C, so the run stops its runners and records
    itself as interrupted instead of dying with sweep.json saying `running`."""


def _marker_matches(marker: Mapping[str, Any], point: SweepPoint, version: str) -> bool:
    return (marker.get("status") == "passed" and marker.get("code_version") == version
            and canonical(marker.get("identity")) == point.identity)


def points_to_run(points: Sequence[SweepPoint], version: str,
                   resume: bool) -> tuple[list[SweepPoint], dict[str, str]]:
    """The points to (re-)run, and for each that was recorded but can not be used, why.

    With `resume`, a point is skipped only when it passed with the same parameters and code
    and its result files are still the ones that run wrote.
    """
    if not resume:
        return list(points), {}
    todo, damaged = [], {}
    for p in points:
        marker = read_marker(p.directory)
        if marker is None and (p.directory / MARKER).exists():
            damaged[p.name] = f"{MARKER} is unreadable"
        elif marker is not None and _marker_matches(marker, p, version):
            problem = point_damage(p.directory, marker)
            if problem is None:
                continue
            damaged[p.name] = problem
        todo.append(p)
    for name, why in damaged.items():
        log.warning("sweep point %s: %s; running it again", name, why)
    return todo, damaged


# --- local slots ------------------------------------------------------------------------------


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
    env = cpu_env(max(1, (os.cpu_count() or 1) // n))
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


# --- results of a sweep ------------------------------------------------------------------------


def _recorded_points(sweep_dir: Path) -> dict[str, Any] | None:
    """The spec's points (name -> identity) the last run recorded in sweep.json, or None when
    it recorded none (written before runs did, missing or unreadable)."""
    try:
        meta = json.loads((sweep_dir / SWEEP_META).read_text())
    except (OSError, ValueError):
        return None
    points = meta.get("spec_points") if isinstance(meta, dict) else None
    return points if isinstance(points, dict) else None


def table_points(sweep_dir: str | Path, points: Sequence[SweepPoint] | None = None
                 ) -> tuple[list[Path], dict[str, str]]:
    """The point folders the sweep's table is built from, in spec order, and every other
    folder under points/ with why it is left out (see the module docstring). `points`: the
    spec's, else those recorded in sweep.json."""
    sweep_dir = Path(sweep_dir)
    root = sweep_dir / "points"
    on_disk = sorted(d for d in root.iterdir() if d.is_dir()) if root.is_dir() else []
    spec = ({p.name: p.identity for p in points} if points is not None
            else _recorded_points(sweep_dir))
    folders, left_out = [], {}
    if spec is None:
        log.warning("sweep %s: %s records no points of its spec (written before sweeps "
                    "recorded them?); each recorded point counts once, and points dropped "
                    "from the grid can not be told apart", sweep_dir, SWEEP_META)
        first: dict[str, str] = {}
        for d in on_disk:
            marker = read_marker(d)
            if marker is not None and marker.get("status") == "passed":
                key = json.dumps(canonical(marker.get("identity")), sort_keys=True)
                if key in first:
                    left_out[d.name] = f"the same point as {first[key]} (a copy)"
                    continue
                first[key] = d.name
            folders.append(d)
        return folders, left_out
    names = {d.name for d in on_disk}
    for name in sorted(names - set(spec)):
        left_out[name] = "not a point of the sweep's spec"
    for name, identity in spec.items():
        if name not in names:
            continue
        marker = read_marker(root / name)
        if marker is not None and marker.get("status") == "passed" \
                and canonical(marker.get("identity")) != canonical(identity):
            left_out[name] = ("its marker is for other parameters than the spec's point (the "
                              "next run of the sweep measures it again)")
            continue
        folders.append(root / name)
    return folders, left_out


def load_sweep(sweep_dir: str | Path, kind: str | None = None,
               points: Sequence[SweepPoint] | None = None) -> pd.DataFrame:
    """Results of every passed point of the spec, through the results store, with a
    `sweep_point` column; `points`: the spec's, else those recorded in sweep.json
    (`table_points`). Folders that are not points of the spec are left out with a warning.

    A point whose marker, manifest or files are damaged is left out with a warning, never
    raised: one bad file must not take the other points' results with it, and its numbers
    must not be shown. Points recorded before sweeps wrote manifests load unverified, with one
    warning per sweep, so existing result folders stay readable.
    """
    return _load_sweep(Path(sweep_dir), kind, points)[0]


def _load_sweep(sweep_dir: Path, kind: str | None, points: Sequence[SweepPoint] | None
                ) -> tuple[pd.DataFrame, dict[str, str]]:
    """`load_sweep`, and the folders left out of the table with why."""
    import pandas as pd

    from qsa.measure.results import RUN_COLUMNS, load_runs

    folders, left_out = table_points(sweep_dir, points)
    if left_out:
        log.warning("sweep %s: %d folder(s) under points/ left out of the table: %s", sweep_dir,
                    len(left_out), "; ".join(f"{k} ({v})" for k, v in left_out.items()))
    frames, unverified = [], []
    for point_dir in folders:
        marker = read_marker(point_dir)
        if marker is None:
            if (point_dir / MARKER).exists():
                log.warning("sweep point %s: %s is unreadable; its results are left out",
                            point_dir, MARKER)
            continue
        if marker.get("status") != "passed":
            continue
        if "manifest_sha256" not in marker:
            unverified.append(point_dir.name)
        elif (problem := point_damage(point_dir, marker)) is not None:
            log.warning("sweep point %s: %s; its results are left out (running the sweep again "
                        "re-measures it)", point_dir, problem)
            continue
        try:
            df = load_runs(point_dir / RESULTS_DIR, kind=kind)
        except Exception as exc:  # any reader error here is a damaged file, not a sweep error
            log.warning("sweep point %s: its results can not be read (%s: %s); they are left "
                        "out", point_dir, type(exc).__name__, exc)
            continue
        if not df.empty:
            df.insert(len(RUN_COLUMNS), "sweep_point", point_dir.name)
            frames.append(df)
    if unverified:
        log.warning("sweep %s: %d passed point(s) predate file digests and are loaded "
                    "unverified: %s", sweep_dir, len(unverified), ", ".join(unverified))
    if not frames:
        return pd.DataFrame(columns=[*RUN_COLUMNS, "sweep_point"]), left_out
    return pd.concat(frames, ignore_index=True), left_out


def _write_table(df: pd.DataFrame, sweep_dir: Path) -> Path | None:
    import io

    from qsa.measure.files import atomic_write_bytes

    if df.empty:  # a table of an earlier run (other points) must not stand for this one
        for name in ("results.parquet", "results.csv"):
            (sweep_dir / name).unlink(missing_ok=True)
        return None
    atomic_write_bytes(sweep_dir / "results.csv", df.to_csv(index=False).encode())
    buf = io.BytesIO()
    try:
        df.to_parquet(buf, index=False)
    except (TypeError, ValueError):  # points of different notebooks may not form one table
        (sweep_dir / "results.parquet").unlink(missing_ok=True)
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
    left_out: dict[str, str] = field(default_factory=dict)  # folders not in the table, and why
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
        for name, why in self.left_out.items():
            lines.append(f"  NOT IN THE TABLE points/{name}: {why}")
        if self.report_notebook:
            lines.append(f"  report notebook: {self.report_notebook}")
        if self.figures_dir:
            lines.append(f"  figures: {self.figures_dir}")
        if self.report_error:
            lines.append(f"  REPORT FAILED: {self.report_error}")
        return "\n".join(lines)


def _lock_holder(path: Path) -> str:
    try:
        holder = json.loads(path.read_text())
        return f"PID {holder['pid']} on host {holder['host']}, since {holder['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not recorded its PID yet"


@contextlib.contextmanager
def hold_sweep_lock(sweep_dir: Path) -> Iterator[None]:
    """Make this process the one writer of `sweep_dir` for the block, or raise SweepLocked.

    An exclusive, non-blocking flock on sweep.lock: the kernel drops it when the process dies,
    so a killed run never needs cleaning up after. The file is kept (deleting it would let a
    third run lock a new file while the second still holds the old one); it names the holder.
    """
    path = sweep_dir / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by the runners
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SweepLocked(
                f"sweep folder {sweep_dir} is in use by another run ({_lock_holder(path)}); "
                "wait for it to finish or stop it, then run again") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": platform.node(),
                                 "since": utc_now()}).encode())
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # the holder is leaving; its PID would only mislead
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """While the block runs, SIGTERM raises SweepTerminated (a KeyboardInterrupt), so a
    scheduler's stop unwinds like Ctrl-C; the previous handler comes back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield  # Python delivers signals to the main thread only; leave them as they are
        return

    def terminate(signum: int, frame: Any) -> None:
        raise SweepTerminated(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        # None: a handler set outside Python, which can not be put back; default is closest.
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _recover_stale_status(sweep_dir: Path) -> dict[str, Any] | None:
    """With the lock held, a sweep.json still saying `running` is a run that died without
    unwinding (SIGKILL, power loss): record and report it as interrupted before resuming."""
    path = sweep_dir / SWEEP_META
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("sweep %s: %s is unreadable (%s); it is replaced by this run's",
                    sweep_dir, SWEEP_META, exc)
        return None
    if not isinstance(meta, dict) or meta.get("status") != "running":
        return None
    meta.update(status="interrupted", stopped_by="killed (found running, lock not held)",
                detected_at=utc_now())
    write_json(path, meta)
    log.warning("sweep %s: the run started %s (PID %s on host %s) ended without finishing "
                "(killed?); recorded as interrupted, resuming", sweep_dir,
                meta.get("started_at"), meta.get("pid"), meta.get("host"))
    return {k: meta.get(k) for k in ("status", "stopped_by", "started_at", "pid", "host")}


def resume_command(spec_path: str | Path, out_root: str | Path, jobs: int | None,
                   backend: str = "local", address: str | None = None) -> str:
    """The `qsa sweep` command line that resumes this sweep, from any directory."""
    args = ["qsa", "sweep", str(Path(spec_path).resolve()), "--out", str(Path(out_root).resolve())]
    if jobs is not None:
        args += ["--jobs", str(jobs)]
    if backend != "local":
        args += ["--backend", backend, "--address", address or "auto"]
    return shlex.join(args)


BACKENDS = ("local", "ray")


def run_sweep(spec_path: str | Path, out_root: str | Path = "profiles", jobs: int | None = None,
              resume: bool = True, progress: bool = True, backend: str = "local",
              address: str | None = None) -> SweepSummary:
    """Run every point of a spec (skipping done ones when `resume`), then the report.

    backend "local" spreads the points over this host's worker slots; "ray" makes each point a
    task of the Ray cluster at `address` ("auto", "ray://host:port", or "local" for a cluster of
    this machine), with the same point runner, markers and store (`qsa.workbench.sweep_ray`).
    Raises SweepLocked when another run holds the sweep folder. On Ctrl-C or SIGTERM the
    runners are stopped, sweep.json says `interrupted`, the resume command goes to stderr and
    the KeyboardInterrupt propagates.
    """
    if backend not in BACKENDS:
        raise SweepError(f"backend: {backend!r} is not one of {', '.join(BACKENDS)}")
    spec = load_spec(spec_path)
    if backend == "ray":
        cluster = sweep_ray.connect(address or "auto", spec.devices)
        slug, labels = cluster.device_slug(), [cluster.label]
    else:
        slots = resolve_slots(spec.devices, spec.workers_per_device, jobs)
        slug, labels = device_slug_for(slots), [s.label for s in slots]
    sweep_dir = Path(out_root).resolve() / slug / "sweeps" / spec.name
    sweep_dir.mkdir(parents=True, exist_ok=True)
    resume_cmd = resume_command(spec_path, out_root, jobs, backend, address)
    with hold_sweep_lock(sweep_dir), _sigterm_interrupts():
        previous = _recover_stale_status(sweep_dir)
        version = code_version(spec.notebook)
        points = expand_points(spec, sweep_dir)
        todo, damaged = points_to_run(points, version, resume)
        meta = {"spec": str(Path(spec_path).resolve()), "notebook": str(spec.notebook),
                "code_version": version, "backend": backend, "slots": labels,
                "started_at": utc_now(), "status": "running", "pid": os.getpid(),
                "host": platform.node(), "points": len(points), "rerun_damaged": damaged,
                "previous_run": previous, "spec_points": {p.name: p.identity for p in points}}
        write_json(sweep_dir / SWEEP_META, meta)
        execute = (cluster.executor(spec, version) if backend == "ray"
                   else _local_executor(spec, slots, version))
        try:
            return _run_points(spec, sweep_dir, points, todo, meta, progress, execute)
        except KeyboardInterrupt as exc:
            meta.update(status="interrupted", finished_at=utc_now(),
                        stopped_by="SIGTERM" if isinstance(exc, SweepTerminated)
                        else "KeyboardInterrupt")
            write_json(sweep_dir / SWEEP_META, meta)
            print(f"\nsweep {spec.name} interrupted; finished points are kept. Resume with:\n"
                  f"  {resume_cmd}", file=sys.stderr)
            raise
        except BaseException as exc:
            meta.update(status="crashed", finished_at=utc_now(),
                        error=f"{type(exc).__name__}: {exc}")
            write_json(sweep_dir / SWEEP_META, meta)
            raise


def _local_executor(spec: SweepSpec, slots: Sequence[Slot], version: str) -> Executor:
    """The points over this host's worker slots, one thread per slot; Ctrl-C stops the
    runners and keeps every finished point."""

    def execute(todo: Sequence[SweepPoint],
                on_done: Callable[[SweepPoint, dict[str, Any]], None]) -> None:
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

        pool = ThreadPoolExecutor(max_workers=len(slots))
        try:
            for fut in as_completed([pool.submit(work, p) for p in todo]):
                on_done(*fut.result())
        except BaseException:
            stop.set()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    return execute


def _run_points(spec: SweepSpec, sweep_dir: Path, points: Sequence[SweepPoint],
                todo: Sequence[SweepPoint], meta: dict[str, Any], progress: bool,
                execute: Executor) -> SweepSummary:
    """Run `todo` with `execute`, then write the table, the report and the final sweep.json;
    `meta` is kept current so an interruption records the counts so far."""
    from tqdm.auto import tqdm

    passed, failures = 0, []
    skipped = len(points) - len(todo)
    meta.update(passed=0, failed=0, skipped=skipped, failures=failures)
    bar = tqdm(total=len(points), initial=skipped, desc=spec.name, unit="point",
               disable=not progress, dynamic_ncols=True)
    bar.set_postfix(passed=0, failed=0, skipped=skipped)

    def on_done(point: SweepPoint, marker: dict[str, Any]) -> None:
        nonlocal passed
        if marker.get("status") == "passed":
            passed += 1
        else:
            err = marker.get("error") or {}
            failures.append({"point": point.name, "ename": err.get("ename"),
                             "evalue": err.get("evalue"), "cell_index": err.get("cell_index")})
        meta.update(passed=passed, failed=len(failures))
        bar.set_postfix(passed=passed, failed=len(failures), skipped=skipped, refresh=False)
        bar.update(1)

    try:
        execute(todo, on_done)
    finally:
        bar.close()

    summary = SweepSummary(spec.name, sweep_dir, len(points), passed, len(failures), skipped,
                           failures)
    table, summary.left_out = _load_sweep(sweep_dir, None, points)
    summary.results_path = _write_table(table, sweep_dir)
    meta["left_out"] = summary.left_out
    if spec.report_notebook is not None and summary.results_path is not None:
        _run_report(spec, sweep_dir, summary)
    meta.update(status="finished", finished_at=utc_now(), report_error=summary.report_error)
    write_json(sweep_dir / SWEEP_META, meta)
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

