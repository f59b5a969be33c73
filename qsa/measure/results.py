"""Results store: one directory per run, one tidy table per run, every write atomic.

Layout: `<root>/<device slug>/<run id>/results.parquet` (one row per measured point) and
`run.json` (device, versions, git state, environment toggles, configs, timing method, extra).
Why this shape: a notebook loads any set of runs into one DataFrame in one call, and a crash
mid-write never leaves a half-written file where a good one was (temp file, fsync, os.replace).
"""

from __future__ import annotations

import datetime as dt
import io
import json
import os
import platform
import re
import secrets
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from qsa.measure.files import atomic_write_bytes

if TYPE_CHECKING:
    from qsa.measure.device import DeviceInfo

RESULTS_FILE = "results.parquet"
RUN_FILE = "run.json"
# Columns joined from run.json when loading (run_id is also written with every record).
RUN_COLUMNS = ("run_id", "device", "kind")
_VISIBLE_DEVICE_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
_REPO = Path(__file__).resolve().parents[2]


# QSA_* variables of the workbench's own machinery, not toggles of what runs: the sweep
# runner's parent process id, and the set-up scripts' paths and install choices.
INTERNAL_ENV = ("QSA_SWEEP_PARENT", "QSA_ROOT", "QSA_VENV", "QSA_PYTHON", "QSA_EXTRAS",
                "QSA_TORCH", "QSA_TRITON")


def env_toggles(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment variables that change what runs: QSA_*, TRITON_* and visible-device lists
    (not `INTERNAL_ENV`)."""
    env = os.environ if environ is None else environ
    return {k: env[k] for k in sorted(env)
            if (k.startswith(("QSA_", "TRITON_")) or k in _VISIBLE_DEVICE_VARS)
            and k not in INTERNAL_ENV}


# What the workbench itself writes inside a checkout: results, sweeps, executed notebooks.
# A run does not make its own checkout "dirty".
OUTPUT_PATHS = ("profiles", "notebooks/executed")


UNKNOWN_COMMIT = "unknown"


def git_state(repo: str | Path = _REPO) -> dict[str, Any]:
    """Commit and dirty flag of the project's checkout (changes to code, tables and notebooks;
    not the workbench's own outputs, `OUTPUT_PATHS`). Only a checkout whose top level is `repo`
    itself counts: an exported tree (a `git archive`, an unpacked wheel) inside some other
    repository would otherwise record that repository's commit. Otherwise the commit is
    `unknown` and `why` says what was found."""
    # GIT_OPTIONAL_LOCKS=0 keeps `git status` from rewriting the index of a shared checkout.
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True,
                                 text=True, env=env, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout if out.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None:
        return {"commit": UNKNOWN_COMMIT, "dirty": None,
                "why": f"{repo} is not in a git checkout (or git is not installed)"}
    if Path(top.strip()).resolve() != Path(repo).resolve():
        return {"commit": UNKNOWN_COMMIT, "dirty": None,
                "why": f"{repo} is not a checkout of its own: it lies inside the repository "
                       f"{top.strip()}, whose commit is not this tree's"}
    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": UNKNOWN_COMMIT, "dirty": None, "why": f"{repo} has no commit yet"}
    status = git("status", "--porcelain", "--", ".",
                 *(f":(exclude){p}" for p in OUTPUT_PATHS))
    return {"commit": commit.strip(), "dirty": None if status is None else bool(status.strip())}


def new_run_id(kind: str, now: dt.datetime | None = None) -> str:
    """`<UTC yyyymmdd-HHMMSS>-<kind>-<6 hex>`: sorts by time, unique within a second."""
    if not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", kind):
        raise ValueError(f"run kind must match [a-z0-9][a-z0-9_-]*, got {kind!r}")
    now = now or dt.datetime.now(dt.timezone.utc)
    return f"{now.astimezone(dt.timezone.utc):%Y%m%d-%H%M%S}-{kind}-{secrets.token_hex(3)}"


def _clean_value(key: str, value: Any) -> Any:
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple, np.ndarray)):
        items = [_clean_value(key, v) for v in value]
        if any(isinstance(v, list) for v in items):
            raise TypeError(f"record field {key!r}: nested lists are not stored; flatten them")
        return items
    raise TypeError(f"record field {key!r}: {type(value).__name__} is not a scalar or a list; "
                    "flatten it or store json.dumps(value)")


def _clean_record(record: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in record.items():
        if not isinstance(key, str):
            raise TypeError(f"record keys must be strings, got {key!r}")
        if key in RUN_COLUMNS:
            raise ValueError(f"record field {key!r} is reserved: it is joined from run.json")
        out[key] = _clean_value(key, value)
    return out


class RunWriter:
    """Collects the records of one run; `flush` and `finish` rewrite its files atomically."""

    def __init__(self, directory: Path, meta: dict[str, Any]) -> None:
        self.directory = directory
        self.meta = meta
        self.records: list[dict[str, Any]] = []
        self._write_meta()

    @property
    def run_id(self) -> str:
        return self.meta["run_id"]

    def add(self, record: Mapping[str, Any]) -> None:
        """Add one measured point (a flat dict: scalars, or lists such as raw samples)."""
        if self.meta["status"] == "finished":
            raise RuntimeError(f"run {self.run_id} is finished; start a new run")
        # The run id in every row: rows copied out of the store still say which run (and so
        # which other rows) they can be compared with.
        self.records.append({"run_id": self.run_id, **_clean_record(record)})

    def add_many(self, records: Iterable[Mapping[str, Any]]) -> None:
        for record in records:
            self.add(record)

    def flush(self) -> None:
        """Write the records so far, so a crash later in a sweep keeps them."""
        buf = io.BytesIO()
        try:
            pd.DataFrame(self.records).to_parquet(buf, index=False)
        except (TypeError, ValueError) as exc:  # pyarrow's errors subclass these
            raise ValueError(f"run {self.run_id}: records do not form one table (a column "
                             f"mixing types?): {exc}") from exc
        atomic_write_bytes(self.directory / RESULTS_FILE, buf.getvalue())

    def finish(self) -> Path:
        """Write the results and mark the run finished; safe to call again."""
        self.flush()
        self.meta.update(status="finished", n_records=len(self.records),
                         finished_at=_utc_now())
        self._write_meta()
        return self.directory

    def _write_meta(self) -> None:
        atomic_write_bytes(self.directory / RUN_FILE,
                           (json.dumps(self.meta, indent=2, sort_keys=True) + "\n").encode())

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is None:
            self.finish()
            return
        self.flush()
        self.meta.update(status="failed", error=f"{exc_type.__name__}: {exc}",
                         n_records=len(self.records), finished_at=_utc_now())
        self._write_meta()


def _utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat()


def start_run(kind: str, root: str | Path = "profiles", device: DeviceInfo | None = None, *,
              configs: Any = None, timing_method: str | None = None,
              extra: Mapping[str, Any] | None = None,
              git: Mapping[str, Any] | None = None) -> RunWriter:
    """Create `<root>/<device slug>/<run id>/` and its run.json; add records, then `finish()`.

    configs and extra must be JSON-serializable; they are checked here, before any work runs.
    git: the state of the code that was measured, where that is not this checkout (`qsa ab`
    measures other revisions); default `git_state()`.
    """
    if device is None:
        from qsa.measure.device import detect_device  # device.py imports this module

        device = detect_device()
    meta = {"schema": 1, "run_id": new_run_id(kind), "kind": kind, "status": "running",
            "started_at": _utc_now(), "device": device.as_record(),
            "versions": {"python": platform.python_version(), "numpy": np.__version__,
                         "pandas": pd.__version__, "torch": device.torch_version,
                         "triton": device.triton_version},
            "host": platform.node(), "git": dict(git) if git is not None else git_state(),
            "env": env_toggles(),
            "configs": configs, "timing_method": timing_method, "extra": dict(extra or {})}
    try:
        json.dumps(meta)
    except TypeError as exc:
        raise TypeError(f"configs and extra must be JSON-serializable: {exc}") from exc
    directory = Path(root) / device.slug / meta["run_id"]
    directory.mkdir(parents=True)
    return RunWriter(directory, meta)


def load_run(path: str | Path) -> tuple[pd.DataFrame, dict[str, Any]]:
    """One run's table (with run_id/device/kind columns) and its run.json."""
    path = Path(path)
    meta = json.loads((path / RUN_FILE).read_text())
    results = path / RESULTS_FILE
    df = pd.read_parquet(results) if results.is_file() else pd.DataFrame()
    for i, col in enumerate(RUN_COLUMNS):
        value = meta["device"]["slug"] if col == "device" else meta[col]
        if col in df:  # written with every row (run_id)
            df.insert(i, col, df.pop(col).astype(object))
            continue
        df.insert(i, col, pd.Series([value] * len(df), index=df.index, dtype=object))
    return df, meta


def load_runs(root: str | Path = "profiles", kind: str | None = None,
              device: str | DeviceInfo | None = None) -> pd.DataFrame:
    """Every finished run under `root` (optionally one kind and/or device) in one DataFrame."""
    slug = device if device is None or isinstance(device, str) else device.slug
    frames = []
    for run_file in sorted(Path(root).glob(f"*/*/{RUN_FILE}")):
        meta = json.loads(run_file.read_text())
        if (meta.get("status") == "finished" and kind in (None, meta["kind"])
                and slug in (None, meta["device"]["slug"])):
            frames.append(load_run(run_file.parent)[0])
    if not frames:
        return pd.DataFrame(columns=list(RUN_COLUMNS))
    return pd.concat(frames, ignore_index=True)
