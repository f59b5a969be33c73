"""One sweep point, wherever it runs: the spec, its points, their markers and manifests, the
worker slot a point runs on, and the runner that executes one point's notebook in its own
process. The drivers sit above it: `qsa.workbench.sweep` runs the points on this host,
`qsa.workbench.sweep_ray` as tasks of a Ray cluster; both call `run_point`, so markers,
manifests and resume rules are the same. The spec format, the store layout and the resume
rules are described in `qsa.workbench.sweep`.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import importlib.metadata
import itertools
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qsa.measure.files import load_yaml
from qsa.workbench.notebook_run import (DEFAULT_KERNEL, execute_notebook, notebook_parameters,
                                        notebook_path)

MARKER = "point.json"
PARAMS = "params.json"
EXECUTED = "notebook.ipynb"
LOG = "runner.log"
RESULTS_DIR = "results"
MANIFEST = "manifest.json"
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
    raw = load_yaml(path.read_text(), path) or {}
    if not isinstance(raw, dict):
        raise SweepError(f"{path}: expected a mapping of spec keys, got {type(raw).__name__}")
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
    for k, values in grid.items():
        keys = [json.dumps(canonical(v), sort_keys=True) for v in values]
        twice = [v for v, key in zip(values, keys) if keys.count(key) > 1]
        if twice:
            raise SweepError(f"{path}: grid dimension {k!r} lists {twice[0]!r} twice: that point "
                             "would run and count twice")
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


def canonical(obj: Any) -> Any:
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
        identity = canonical({"notebook": spec.notebook.name, "parameters": params,
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
    """The point's marker, or None when it is missing or unreadable (a damaged disk or a hand
    edit can break what an atomic write never leaves half-done)."""
    try:
        marker = json.loads((point_dir / MARKER).read_text())
    except (OSError, ValueError):  # ValueError: bad JSON or bytes that are not UTF-8
        return None
    return marker if isinstance(marker, dict) else None


def _file_digest(path: Path) -> tuple[int, str]:
    """(size, sha256) of a file, read in chunks: figures and tables can be large."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def _result_files(point_dir: Path) -> list[str]:
    """Every file under the point's results/, relative to the point: what its rows come from."""
    root = point_dir / RESULTS_DIR
    return sorted(p.relative_to(point_dir).as_posix() for p in root.rglob("*") if p.is_file())


def write_manifest(point_dir: Path) -> str:
    """Record size and sha256 of each result file, atomically, once the run wrote them all.

    Returns the manifest's own sha256, for the marker written after it: a changed or swapped
    manifest then shows as damage too.
    """
    from qsa.measure.files import atomic_write_bytes

    files = {}
    for rel in _result_files(point_dir):
        size, digest = _file_digest(point_dir / rel)
        files[rel] = {"size": size, "sha256": digest}
    data = (json.dumps({"files": files}, indent=2, sort_keys=True) + "\n").encode()
    atomic_write_bytes(point_dir / MANIFEST, data)
    return hashlib.sha256(data).hexdigest()


def point_damage(point_dir: Path, marker: Mapping[str, Any]) -> str | None:
    """Why a passed point's stored files can not be trusted, or None when they are exactly the
    files its run wrote (the manifest matches the marker, each file its size and sha256, and
    nothing was added)."""
    expected_manifest = marker.get("manifest_sha256")
    if not expected_manifest:
        return f"{MARKER} records no file digests (written before sweeps recorded them)"
    try:
        data = (point_dir / MANIFEST).read_bytes()
    except FileNotFoundError:
        return f"{MANIFEST} is missing"
    except OSError as exc:
        return f"{MANIFEST} can not be read ({exc})"
    if hashlib.sha256(data).hexdigest() != expected_manifest:
        return f"{MANIFEST} is corrupt (its sha256 differs from the one in {MARKER})"
    try:
        files = {str(rel): (int(entry["size"]), str(entry["sha256"]))
                 for rel, entry in json.loads(data)["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"{MANIFEST} is unreadable ({type(exc).__name__}: {exc})"
    if not files:
        return f"{MANIFEST} lists no result files"
    for rel, (size, digest) in sorted(files.items()):
        try:
            actual_size, actual_digest = _file_digest(point_dir / rel)
        except FileNotFoundError:
            return f"{rel} is missing"
        except OSError as exc:
            return f"{rel} can not be read ({exc})"
        if actual_size < size:
            return f"{rel} is truncated ({actual_size} of {size} bytes)"
        if actual_size != size or actual_digest != digest:
            return f"{rel} is corrupt (its sha256 differs from the one in {MANIFEST})"
    extra = sorted(set(_result_files(point_dir)) - set(files))
    if extra:
        return f"files not written by the point's run: {', '.join(extra)}"
    return None


# --- devices -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Slot:
    """One worker's device: a label, the environment that selects it, variables to drop."""

    label: str
    env: dict[str, str]
    unset: tuple[str, ...] = ()


def cpu_env(threads: int) -> dict[str, str]:
    """A functional CPU worker's environment: no GPU visible, the Triton interpreter on, and
    its share of the cores."""
    return {"CUDA_VISIBLE_DEVICES": "-1", "HIP_VISIBLE_DEVICES": "-1", "TRITON_INTERPRET": "1",
            "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


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


def utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat()


def write_json(path: Path, data: Any) -> None:
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
    """Run one point in its own process and return its marker; one retry on the port race.

    When `stop` ends the runner before it recorded a result, the point is not marked failed
    (its status is `interrupted`, nothing is written): the next run simply runs it again.
    """
    marker: dict[str, Any] = {}
    for attempt in (1, 2):
        _reset_point_dir(point.directory)
        write_json(point.directory / PARAMS, {
            "notebook": str(spec.notebook), "parameters": point.parameters,
            "identity": point.identity, "code_version": version, "kernel_name": spec.kernel_name,
            "timeout_s": spec.timeout_s, "slot": slot.label, "attempt": attempt})
        with open(point.directory / LOG, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "qsa.workbench.sweep_point", "run-point",
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
        if not marker and stop is not None and stop.is_set():
            return {"status": "interrupted"}  # stopped by the sweep: no fault of the point's
        if not marker:
            marker = _marker(point, version, slot, "failed", attempt=attempt, error={
                "ename": "RunnerExited", "evalue": f"point runner exited with code "
                f"{proc.returncode} before recording a result", "log_tail": _log_tail(
                    point.directory / LOG)})
            write_json(point.directory / MARKER, marker)
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
            "slot": slot if isinstance(slot, str) else slot.label, "finished_at": utc_now(),
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

    from qsa.measure.results import env_toggles

    _die_with_parent()
    p = json.loads((point_dir / PARAMS).read_text())
    version, slot, t0 = p["code_version"], p["slot"], time.monotonic()
    started = utc_now()
    results_root = point_dir / RESULTS_DIR
    common = {"attempt": p["attempt"], "started_at": started,
              "env": env_toggles()}
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
            manifest_sha256 = write_manifest(point_dir)
            write_json(point_dir / MARKER, _marker(
                p, version, slot, "passed", runs=runs, duration_s=time.monotonic() - t0,
                manifest_sha256=manifest_sha256, **common))
            return 0
        error = {"ename": "NoResults", "evalue": f"the notebook finished but wrote no finished "
                 f"run under {results_root} (it must pass {RESULTS_PARAM} to start_run)"}
    write_json(point_dir / MARKER, _marker(p, version, slot, "failed", error=error,
                                            duration_s=time.monotonic() - t0, **common))
    return 1


# The interface between the sweep driver and a backend: run the points to do and report each
# finished one, as (todo, on_done(point, marker)).
Executor = Callable[[Sequence[SweepPoint], Callable[[SweepPoint, dict[str, Any]], None]], None]


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "run-point":
        sys.exit(_run_point_process(Path(sys.argv[2])))
    sys.exit("usage: python -m qsa.workbench.sweep_point run-point <point dir> (internal; run "
             "sweeps with `qsa sweep`)")
