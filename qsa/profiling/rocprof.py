"""rocprofv3 (AMD) output as KernelLaunch records, the capture command line, and a ROCTx shim.

Reader order (ROCm rocprofiler-sdk docs, 'using rocpd output format'): the rocpd SQLite database first, since rocpd is the default
output since ROCm 7.0 and its `kernels` view already attributes every dispatch to its ROCTx
range; the CSV files are the fallback and are parsed by header name because their columns
changed across ROCm releases. Only unsuffixed views are queried, never the uuid-suffixed
physical tables.

The databases of a run (one per profiled process) are read through rocprofiler-sdk's own
`rocpd` package when it is importable (`rocpd.connect([...])` views them as one database, the
way its own tools do); the plain sqlite3 reader of the published schema is the fallback. ROCm
installs `rocpd` and `roctx` under `<rocm>/lib/python3.X/site-packages`, which is not on a
venv's path: both are looked up there too (ROCM_PATH, else /opt/rocm).
"""

from __future__ import annotations

import csv
import functools
import importlib
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

from qsa.profiling.records import KernelLaunch, RegionIndex

SOURCE_ROCPD = "rocpd"
SOURCE_CSV = "rocprofv3-csv"

_KERNELS_SQL = """
SELECT id, guid, name, region, start, "end", agent_abs_index, stream_id
FROM kernels ORDER BY start
"""
# Used only when a database predates the `kernels` view: dispatch joined to its symbol.
_DISPATCH_SQL = """
SELECT d.id, d.guid, s.display_name, r.string, d.start, d."end", a.absolute_index, d.stream_id
FROM rocpd_kernel_dispatch d
JOIN rocpd_info_kernel_symbol s ON s.id = d.kernel_id AND s.guid = d.guid
LEFT JOIN rocpd_string r ON r.id = d.region_name_id AND r.guid = d.guid
LEFT JOIN rocpd_info_agent a ON a.id = d.agent_id AND a.guid = d.guid
ORDER BY d.start
"""
_KERNEL_CSV_REQUIRED = ("Kernel_Name", "Start_Timestamp", "End_Timestamp", "Agent_Id")
_MARKER_CSV_REQUIRED = ("Domain", "Function", "Thread_Id", "Start_Timestamp", "End_Timestamp")
_KERNEL_CSV_SUFFIX = "kernel_trace.csv"
_MARKER_CSV_SUFFIX = "marker_api_trace.csv"


class IncompleteProfileWarning(UserWarning):
    """The profile holds kernel dispatches that the reader could not turn into records."""


def rocprofv3_command(run_dir: str | Path, tag: str, argv: Sequence[str]) -> list[str]:
    """rocprofv3 command line that traces kernels inside ROCTx-selected regions into rocpd.

    `--selected-regions` records only between `roctx_profiler()` enter and exit, and
    `--marker-trace` records the `roctx_range` step names that become `kernels.region`.
    Read the result with `read_rocprof_output(run_dir)`.
    """
    if not tag or "/" in tag or "\\" in tag:
        raise ValueError(f"tag must be a plain file-name prefix, got {tag!r}")
    if not argv:
        raise ValueError("argv is empty: give the command rocprofv3 should run, e.g. [sys.executable, 'sweep.py']")
    return [
        "rocprofv3",
        "--kernel-trace",
        "--marker-trace",
        "--selected-regions",
        "--stats",
        "-d",
        str(run_dir),
        "-o",
        tag,
        "-f",
        "rocpd",
        "--",
        *(str(arg) for arg in argv),
    ]


def read_rocprof_output(path: str | Path) -> list[KernelLaunch]:
    """Launches from a rocprofv3 run: a .db file, a kernel_trace.csv, or a run directory.

    In a directory every rocpd database (one per profiled process) is read; only when there is
    none are the `*kernel_trace.csv` files read, each with its sibling marker trace if present.
    """
    path = Path(path)
    if path.is_file():
        if path.name.endswith(_KERNEL_CSV_SUFFIX):
            return read_kernel_trace_csv(path, _sibling_marker_csv(path))
        return read_rocpd(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no rocprofv3 output at {path}")
    databases = sorted(path.rglob("*.db"))
    if databases:
        if _load_rocm_package("rocpd")[0] is not None:
            return read_rocpd_package(databases)
        return _by_start([launch for db in databases for launch in read_rocpd(db)])
    kernel_csvs = sorted(path.rglob(f"*{_KERNEL_CSV_SUFFIX}"))
    if kernel_csvs:
        return _by_start(
            [launch for kc in kernel_csvs for launch in read_kernel_trace_csv(kc, _sibling_marker_csv(kc))]
        )
    raise FileNotFoundError(f"no rocpd database (*.db) or *{_KERNEL_CSV_SUFFIX} under {path}")


def read_rocpd_package(databases: Sequence[str | Path]) -> list[KernelLaunch]:
    """Launches from every database of a run, read through rocprofiler-sdk's `rocpd` package:
    `rocpd.connect` (a `RocpdImportData`, which answers `execute` like a sqlite3 connection)
    over all of them at once, the same `kernels` query and dropped-dispatch check."""
    rocpd, why = _load_rocm_package("rocpd")
    if rocpd is None:
        raise ImportError(why)
    names = [str(Path(db).resolve()) for db in databases]
    label = Path(names[0]) if len(names) == 1 else Path(f"{len(names)} rocpd databases")
    data = rocpd.connect(names)
    try:
        views = _object_names(data, label)
        sql = _KERNELS_SQL if "kernels" in views else _DISPATCH_SQL
        rows = data.execute(sql).fetchall()
        _warn_dropped(data, label, rows, "kernels view" if "kernels" in views else "symbol join")
    finally:
        close = getattr(data, "close", None)
        if close is not None:
            close()
    return _by_start(_launches(rows))


def read_rocpd(db_path: str | Path) -> list[KernelLaunch]:
    """Launches from a rocpd SQLite database, via its `kernels` view.

    The view inner-joins agent, event, region string, kernel symbol, queue process and thread
    rows, so a dispatch missing any of them silently disappears. This reader compares the
    view against `rocpd_kernel_dispatch` and raises `IncompleteProfileWarning` naming the
    dropped dispatches. A region of "" (dispatch outside every ROCTx range) becomes None.
    """
    db_path = Path(db_path)
    if not db_path.is_file():
        raise FileNotFoundError(f"no rocpd database at {db_path}")
    con = sqlite3.connect(f"{db_path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        views = _object_names(con, db_path)
        if "rocpd_kernel_dispatch" not in views:
            raise ValueError(f"{db_path}: not a rocpd database (no rocpd_kernel_dispatch view or table)")
        sql = _KERNELS_SQL if "kernels" in views else _DISPATCH_SQL
        rows = con.execute(sql).fetchall()
        _warn_dropped(con, db_path, rows, "kernels view" if "kernels" in views else "symbol join")
    finally:
        con.close()
    return _launches(rows)


def _launches(rows: list[tuple]) -> list[KernelLaunch]:
    return [
        KernelLaunch(
            name=name,
            start_ns=int(start),
            duration_ns=int(end) - int(start),
            device=agent,
            stream=stream,
            region=region or None,
            source=SOURCE_ROCPD,
        )
        for _id, _guid, name, region, start, end, agent, stream in rows
    ]


def _object_names(con: sqlite3.Connection, db_path: Path) -> set[str]:
    """Tables and views, including temporary ones (`rocpd.connect` views its databases
    through temporary views)."""
    sql = ("SELECT name FROM sqlite_master WHERE type IN ('view', 'table') UNION "
           "SELECT name FROM sqlite_temp_master WHERE type IN ('view', 'table')")
    try:
        return {row[0] for row in con.execute(sql)}
    except sqlite3.DatabaseError as e:
        raise ValueError(f"{db_path}: not an SQLite database ({e})") from e


def _warn_dropped(con: sqlite3.Connection, db_path: Path, rows: list[tuple], what: str) -> None:
    dispatches = con.execute("SELECT id, guid, kernel_id FROM rocpd_kernel_dispatch").fetchall()
    if len(dispatches) == len(rows):
        return
    kept = {(row[0], row[1]) for row in rows}
    dropped = [(d_id, kernel_id) for d_id, guid, kernel_id in dispatches if (d_id, guid) not in kept]
    shown = ", ".join(f"dispatch {d_id} (kernel_id {k_id})" for d_id, k_id in dropped[:5])
    warnings.warn(
        f"{db_path}: rocpd_kernel_dispatch has {len(dispatches)} rows but the {what} returned "
        f"{len(rows)}; {len(dropped)} dispatch(es) lack a matching symbol, agent, event, region "
        f"string, queue/process or thread row and are missing from the result: {shown}"
        + (" ..." if len(dropped) > 5 else ""),
        IncompleteProfileWarning,
        stacklevel=3,
    )


def read_kernel_trace_csv(kernel_csv: str | Path, marker_csv: str | Path | None = None) -> list[KernelLaunch]:
    """Launches from rocprofv3 `kernel_trace.csv`, columns looked up by header name.

    With `marker_csv` (`marker_api_trace.csv`), each launch gets the innermost ROCTx range on
    the same thread (`Thread_Id`) whose interval contains the kernel's execution interval.
    That compares CPU marker times with GPU execution times, so it only attributes kernels
    that finish before their range closes (synchronize before popping the range); rocpd's
    `kernels.region` does not have this limitation.
    """
    kernel_csv = Path(kernel_csv)
    header, rows = _read_csv(kernel_csv, _KERNEL_CSV_REQUIRED)
    regions = None
    if marker_csv is not None:
        if "Thread_Id" not in header:
            raise ValueError(f"{kernel_csv}: no Thread_Id column, so kernels cannot be joined to ROCTx ranges")
        regions = RegionIndex(read_marker_ranges(marker_csv))
    has_stream = "Stream_Id" in header
    launches = []
    for row in rows:
        start = int(row["Start_Timestamp"])
        end = int(row["End_Timestamp"])
        launches.append(
            KernelLaunch(
                name=row["Kernel_Name"],
                start_ns=start,
                duration_ns=end - start,
                device=_agent_index(row["Agent_Id"], kernel_csv),
                stream=int(row["Stream_Id"]) if has_stream and row["Stream_Id"] != "" else None,
                region=regions.innermost(int(row["Thread_Id"]), start, end) if regions else None,
                source=SOURCE_CSV,
            )
        )
    return _by_start(launches)


def read_marker_ranges(marker_csv: str | Path) -> list[tuple[int, int, int, str]]:
    """ROCTx ranges from `marker_api_trace.csv` as (thread, start_ns, end_ns, message).

    Ranges are the MARKER_CORE* rows with a positive extent; `roctxMark` points and the
    MARKER_CONTROL_API pause/resume rows are not ranges.
    """
    marker_csv = Path(marker_csv)
    _header, rows = _read_csv(marker_csv, _MARKER_CSV_REQUIRED)
    ranges = []
    for row in rows:
        start = int(row["Start_Timestamp"])
        end = int(row["End_Timestamp"])
        if row["Domain"].startswith("MARKER_CORE") and end > start:
            ranges.append((int(row["Thread_Id"]), start, end, row["Function"]))
    return ranges


def _read_csv(path: Path, required: Sequence[str]) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        header = list(reader.fieldnames or [])
        missing = [column for column in required if column not in header]
        if missing:
            raise ValueError(
                f"{path}: missing column(s) {missing}; found {header}. rocprofv3 CSV columns differ "
                "across ROCm releases (ROCm <= 6.2 used other names)"
            )
        return header, list(reader)


def _agent_index(agent_id: str, path: Path) -> int:
    """`Agent_Id` reads like "Agent 4" (or "GPU 3" with --agent-index=type-relative)."""
    match = re.search(r"(\d+)\s*$", agent_id)
    if match is None:
        raise ValueError(f"{path}: cannot read an agent index from Agent_Id {agent_id!r}")
    return int(match.group(1))


def _sibling_marker_csv(kernel_csv: Path) -> Path | None:
    marker = kernel_csv.with_name(kernel_csv.name[: -len(_KERNEL_CSV_SUFFIX)] + _MARKER_CSV_SUFFIX)
    return marker if marker.is_file() else None


def _by_start(launches: list[KernelLaunch]) -> list[KernelLaunch]:
    return sorted(launches, key=lambda launch: launch.start_ns)


def rocm_python_dirs() -> list[Path]:
    """Where ROCm installs its Python packages (rocpd, roctx) for this interpreter:
    `<rocm>/lib/python3.X/site-packages`, with <rocm> from ROCM_PATH, else /opt/rocm."""
    root = Path(os.environ.get("ROCM_PATH") or "/opt/rocm")
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return [root / "lib" / ver / "site-packages", root / "lib" / ver / "dist-packages"]


@functools.cache
def _load_rocm_package(name: str) -> tuple[ModuleType | None, str | None]:
    """A ROCm Python package (`rocpd`, `roctx`): from the path as it is, else from ROCm's own
    site-packages; or why not, naming where it was looked for."""
    try:
        return importlib.import_module(name), None
    except (ImportError, OSError) as first:
        error = first
    found = [str(d) for d in rocm_python_dirs() if (d / name).is_dir()]
    if found:
        sys.path.extend(d for d in found if d not in sys.path)
        try:
            return importlib.import_module(name), None
        except (ImportError, OSError) as e:
            error = e
    dirs = " or ".join(str(d) for d in rocm_python_dirs())
    return None, (f"{name} package not importable ({error}); it ships with ROCm's "
                  f"rocprofiler-sdk under {dirs} (set ROCM_PATH, or add that directory to "
                  "PYTHONPATH)")


def rocprof_child_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a process run under rocprofv3: ROCm's Python package directories
    that exist go on its PYTHONPATH, so it finds `roctx` from a venv too."""
    env = dict(os.environ if environ is None else environ)
    extra = [str(d) for d in rocm_python_dirs() if d.is_dir()]
    if extra:
        env["PYTHONPATH"] = os.pathsep.join([*extra, *filter(None, [env.get("PYTHONPATH")])])
    return env


def rocprofv3_capture_problem(python: str = sys.executable) -> str | None:
    """Why a rocprofv3 capture of this workbench would fail or record nothing, or None. The
    child marks its timed steps with ROCTx and rocprofv3 records only inside them
    (`--selected-regions`): a child without `roctx` would run to the end and capture no
    kernel, so that is refused before anything runs."""
    if shutil.which("rocprofv3") is None:
        return ("rocprofv3 is not on PATH: it ships with ROCm's rocprofiler-sdk (add "
                "<rocm>/bin to PATH)")
    res = subprocess.run([python, "-c", "import roctx"], env=rocprof_child_env(),
                         capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or ["no output"])[-1]
        dirs = " or ".join(str(d) for d in rocm_python_dirs())
        return (f"the profiled process can not import roctx ({last}); rocprofv3 records only "
                f"inside its ROCTx ranges, so nothing would be captured. It ships with "
                f"rocprofiler-sdk under {dirs}: set ROCM_PATH to the ROCm install")
    return None


def _load_roctx() -> tuple[ModuleType | None, str | None]:
    """The ROCm `roctx` package (ctypes), or why not."""
    return _load_rocm_package("roctx")


def roctx_unavailable_reason() -> str | None:
    """None when ROCTx markers are emitted, else why `roctx_range`/`roctx_profiler` are no-ops."""
    return _load_roctx()[1]


@contextmanager
def roctx_range(name: str) -> Iterator[None]:
    """A ROCTx push/pop range (RoctxRange semantics), or nothing when roctx is unavailable.

    Under `rocprofv3 --marker-trace` the name becomes the `region` of kernels launched inside.
    """
    roctx = _load_roctx()[0]
    if roctx is None:
        yield
        return
    roctx.rangePush(name)
    try:
        yield
    finally:
        roctx.rangePop()


@contextmanager
def roctx_profiler() -> Iterator[None]:
    """Collection window for `--selected-regions` (RoctxProfiler semantics), else nothing.

    Calls `profilerResume(0)` on enter and `profilerPause(0)` on exit; thread id 0 means all
    threads. Wrap only the timed loop, not warm-up or compilation.
    """
    roctx = _load_roctx()[0]
    if roctx is None:
        yield
        return
    roctx.profilerResume(0)
    try:
        yield
    finally:
        roctx.profilerPause(0)
