"""Block-config tuner: verified candidates, timed with the workbench's method, winners written
to the per-arch config tables with provenance.

The search space comes from the op's config schema (`qsa.configs.schema`) around the table's
current entry: each of the entry's meta keys as its schema says, sizes and counts at half, same
and double their value within the schema's range, switches at both values where the device
takes them (an sm90-only switch is held elsewhere), thresholds that decide a call's path held;
the warp count at 2, 4, 8 and half and double the entry's, with the launch options the backend
accepts (NVIDIA rejects AMD keys; AMD adds `waves_per_eu`). The table's other entries for the
same kernel and format come right after the current entry (`table_seeds`).
Candidates that exceed shared memory or registers are pruned by Triton's own resource check
at compile time (`OutOfResources`, before any launch); like every failing candidate (compile
error, wrong result) they are recorded with the reason and skipped.

A winner is written only after a second opinion: small kernels read differently from one
process to the next by more than the candidates differ inside one, so a candidate that beat
the current entry in the tuning run is timed again against it in a fresh process (alternately,
current / winner / winner / current) and kept only if it still wins beyond that re-check's own
noise (`recheck_in_fresh_process`); otherwise the current entry is written back as confirmed,
with the rejected candidate and both timings in its provenance.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import math
import os
import pickle
import subprocess
import sys
import tempfile
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import pandas as pd
import torch

from qsa.configs import BlockConfig, ConfigError, get_config, load_table, write_entry
from qsa.configs.schema import HELD, HIP, SWITCH, ConfigSchema, Key, takes
from qsa.kernels.common import Lookup, backend_and_arch
from qsa.measure.device import detect_device
from qsa.presets import DEFAULT_PRESET, ModelPreset, as_preset
from qsa.workbench.ops import Point, Prepared, config_coordinate, measure_prepared, prepare
from qsa.workbench.registry import find

WARPS = (2, 4, 8)
# Most warps one program may have: 1,024 threads, 32 warps of 32 on NVIDIA, 16 wavefronts of
# 64 on AMD.
MAX_WARPS = {"cuda": 32, "hip": 16, "interpreter": 32}
# Table entries tried as candidates next to the current one (`table_seeds`): few, so that a
# capped space keeps most of its one-change neighbours.
MAX_SEEDS = 3
STAGES = {"cuda": (1, 2, 3, 4), "hip": (1, 2), "interpreter": (2,)}
WAVES_PER_EU = (0, 1, 2)
SHAPE_KEYS = ("batch", "context", "rows")  # of the point an entry is tuned at (provenance)
# What a tuning record keeps of the one it replaces (`provenance.earlier`)
EARLIER_KEYS = ("date", "device", "torch", "triton", "verdict", "us", "previous_us", "shape")


def _neighbours(key: Key, v: int, backend: str, arch: str) -> tuple[int, ...]:
    """The values the search tries for `key` around the entry's `v` (see the module
    docstring): `v` alone where the device can not take the key or the schema holds it."""
    if not takes(key.only_on, backend, arch) or key.kind == HELD:
        return (v,)
    if key.kind == SWITCH:
        return (0, 1)
    return tuple(sorted(c for c in {v // 2, v, v * 2} if key.allows(c)) or (v,))


def _schema_keys(schema: ConfigSchema, base: BlockConfig) -> list[Key]:
    """The schema's keys of the entry's meta keys, sorted by name; a key outside the schema
    is refused (a table holding one is refused when it is loaded)."""
    names = {k.name for k in schema.keys}
    unknown = sorted(set(base.meta) - names)
    if unknown:
        raise ConfigError(f"{schema.table}: meta keys {unknown} are not in its schema "
                          f"({', '.join(sorted(names))})")
    return sorted((schema.key(k) for k in base.meta), key=lambda k: k.name)


def _launchable(w: int, backend: str) -> bool:
    """A warp count Triton takes on this backend: a power of two, at most 1,024 threads."""
    return 1 <= w <= MAX_WARPS.get(backend, 32) and w & (w - 1) == 0


def table_seeds(kernel: str, arch: str, fmt: str, base: BlockConfig, bucket: int,
                backend: str) -> list[BlockConfig]:
    """Other configs the table holds for this kernel and format, as candidates beside the
    neighbours of `base`, which a search around `base` can not reach when they are several
    steps away: this arch's other buckets, nearest to `bucket` first, then the
    arch-independent defaults, at most MAX_SEEDS. Only entries of the kernel as it is now
    (the same meta keys) with a launchable warp count; the arch's own AMD launch keys stay, a
    default entry takes those of `base`. Every entry holds to the table's schema (checked on
    loading), so none sets a key this device can not take."""
    table = load_table(kernel)
    own = sorted(table.get(arch, {}).get(fmt, {}).items(),
                 key=lambda kv: abs(math.log2(max(int(kv[0]), 1)) - math.log2(max(bucket, 1))))
    default = table.get("default", {}).get(fmt, {}).items() if arch != "default" else ()
    seeds: dict[str, BlockConfig] = {}
    for section, entries in ((arch, own), ("default", default)):
        for _, entry in entries:
            amd = entry.get("amd", {}) if section == arch and backend == "hip" else base.amd
            cfg = BlockConfig.from_dict({**entry, "amd": amd})
            if (set(cfg.meta) == set(base.meta) and cfg != base
                    and _launchable(cfg.num_warps, backend)):
                seeds.setdefault(json.dumps(cfg.as_dict(), sort_keys=True), cfg)
    return list(seeds.values())[:MAX_SEEDS]


def config_axes(op: str, base: BlockConfig, backend: str, arch: str = ""
                ) -> dict[str, tuple[int, ...]]:
    """The values each config key takes in the search around `base`, an entry of `op`'s
    table: each meta key of the entry as the op's schema says (`_neighbours`; held keys are
    not axes), then `num_warps`, `num_stages` and, on HIP, `waves_per_eu`. The search
    (`config_space`) and the interactive controls (`qsa.workbench.interactive`) both read
    it."""
    keys = [k for k in _schema_keys(find(op).schema, base) if k.kind != HELD]
    axes = {k.name: _neighbours(k, base.meta[k.name], backend, arch) for k in keys}
    # The fixed warp counts, and like every size half and double the entry's own: a kernel
    # whose entry runs 16 warps (top-k over long rows) is searched around 16.
    around = {base.num_warps // 2, base.num_warps, base.num_warps * 2}
    axes["num_warps"] = tuple(sorted(w for w in set(WARPS) | around if _launchable(w, backend)))
    axes["num_stages"] = STAGES.get(backend, (base.num_stages,))
    if takes(HIP, backend, arch):
        axes["waves_per_eu"] = WAVES_PER_EU
    return axes


def config_space(op: str, base: BlockConfig, backend: str, max_candidates: int = 48,
                 arch: str = "", seeds: list[BlockConfig] = ()) -> list[BlockConfig]:
    """Candidates around `base`, an entry of `op`'s table, the fewest changes first, the base
    itself first of all, then `seeds` (other table entries, `table_seeds`). Only the op's
    schema keys vary (`config_axes`); `arch` ("sm90", "gfx950", ...) decides which keys the
    device can take."""
    axes = config_axes(op, base, backend, arch)
    keys = [k for k in axes if k in base.meta]
    warps, stages = axes["num_warps"], axes["num_stages"]
    waves = axes.get("waves_per_eu", (None,))
    out = []
    for vals, w, s, we in itertools.product(itertools.product(*(axes[k] for k in keys)), warps,
                                            stages, waves):
        amd = dict(base.amd)
        if we is not None:
            amd["waves_per_eu"] = we
        out.append(BlockConfig({**base.meta, **dict(zip(keys, vals))}, w, s, amd))

    def changes(c: BlockConfig) -> int:
        return (sum(c.meta[k] != base.meta[k] for k in keys) + (c.num_warps != base.num_warps)
                + (c.num_stages != base.num_stages) + (c.amd != base.amd))

    uniq = {json.dumps(c.as_dict(), sort_keys=True): c for c in [*seeds, *sorted(out, key=changes)]
            if c != base}
    return [base, *list(uniq.values())[:max_candidates - 1]]


def tune(op: str, *, preset: str | ModelPreset = DEFAULT_PRESET, batch: int, context: int,
         rows: int,
         index_format: str = "bf16", kv_format: str = "bf16", device: str | None = None,
         max_candidates: int = 48, samples: int | None = None, write: bool = False,
         progress: bool = True, candidates: list[dict[str, Any]] | None = None,
         selection: str = "index", overlap: float = 0.0) -> pd.DataFrame:
    """Time every candidate on one shape (the current entry first, timed twice so the run knows
    its own noise); with `write`, store the result in the table for this arch, format and shape
    bucket: the fastest candidate if it beats the current entry by more than that noise,
    otherwise the current entry, confirmed. `candidates`: changes to the current entry to try
    instead of the derived space (see `with_changes`). `selection`: `random` tunes sparse GQA
    decode on worst-case selections (see `qsa.workbench.registry.SELECTIONS`); `overlap` tunes on
    rows whose selections overlap that much, where sparse GQA takes its shared path."""
    point = Point(op, as_preset(preset), batch, context, rows, index_format, kv_format,
                  selection=selection, overlap=overlap)
    return tune_prepared(prepare(point, device), max_candidates=max_candidates,
                         samples=samples, write=write, progress=progress, candidates=candidates,
                         device=device)


def _defaulted(schema: ConfigSchema, name: str, impl: str) -> bool:
    """Whether `schema` declares key `name` for `impl` entries with a default, so an entry
    without it runs that default and may be given another value."""
    key = next((k for k in schema.keys if k.name == name), None)
    return key is not None and key.default is not None and (not key.impls or impl in key.impls)


def with_changes(base: BlockConfig, changes: dict[str, Any], schema: ConfigSchema | None = None
                 ) -> BlockConfig:
    """`base` with some values changed: `{"meta": {"BLOCK_N": 64}, "num_warps": 8}`. Keys are
    checked by name, so a typo is an error rather than an untested default; a key the entry
    leaves out may be set where the `schema` declares its default. A change of
    `impl` (another implementation of the kernel) may add the meta keys that implementation
    reads, and drops those the table's `schema` gives to other implementations only."""
    unknown = set(changes) - {"meta", "num_warps", "num_stages", "amd", "impl"}
    if unknown:
        raise ValueError(f"config: unknown keys {sorted(unknown)} (meta, num_warps, "
                         "num_stages, amd, impl)")
    impl = changes.get("impl", base.impl)
    new_meta = set(changes.get("meta", {})) - set(base.meta)
    if impl == base.impl and schema is not None:
        # a key the entry leaves at its declared default may be set
        new_meta = {k for k in new_meta if not _defaulted(schema, k, impl)}
    if new_meta and impl == base.impl:
        raise ValueError(f"config: meta keys {sorted(new_meta)} are not in the current entry "
                         f"({sorted(base.meta)}) and have no default in its schema")
    d = base.as_dict()
    if impl != base.impl and schema is not None:
        d["meta"] = {k: v for k, v in d["meta"].items()
                     if not schema.key(k).impls or impl in schema.key(k).impls}
    d["meta"].update(changes.get("meta", {}))
    d["amd"].update(changes.get("amd", {}))
    for key in ("num_warps", "num_stages"):
        d[key] = int(changes.get(key, d[key]))
    d["impl"] = impl
    return BlockConfig.from_dict(d)


def tune_prepared(prep: Prepared, coord: Lookup | None = None, *, max_candidates: int = 48,
                  samples: int | None = None, write: bool = False, progress: bool = True,
                  candidates: list[dict[str, Any]] | None = None, device: str | None = None
                  ) -> pd.DataFrame:
    """`tune` on a prepared point; `coord` is its config coordinate when already known;
    `device` is the one the point was prepared on (the re-check runs there too)."""
    point = prep.point
    op = point.op
    backend, arch = backend_and_arch()
    coord = coord or config_coordinate(prep)  # where the kernel itself looks its entry up
    current = get_config(coord.kernel, arch, coord.fmt, coord.size)
    if candidates is None:
        space = config_space(op, current.config, backend, max_candidates, arch,
                             table_seeds(coord.kernel, arch, coord.fmt, current.config,
                                         coord.size, backend))
    else:
        tried = {json.dumps(c.as_dict(), sort_keys=True): c
                 for c in (with_changes(current.config, ch, find(op).schema)
                           for ch in candidates)}
        space = [current.config, *[c for c in tried.values() if c != current.config]]
    rows_out: list[dict[str, Any]] = []
    it = space
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(space, desc=f"tune {op}", unit="cfg", leave=False)
    for i, cfg in enumerate(it):
        rec: dict[str, Any] = {"candidate": i, "is_current": i == 0,
                               "config": json.dumps(cfg.as_dict(), sort_keys=True)}
        try:
            r = measure_prepared(prep, cfg, samples, twice=i == 0)
            rec.update(status="ok", us=r["us"], p10_us=r["p10_us"], p90_us=r["p90_us"],
                       iqr_us=r["iqr_us"], method=r["method"], noise_rel=r.get("noise_floor_rel"),
                       functional_only=r["functional_only"], error="")
        except Exception as e:  # compile error, OutOfResources, VerificationError: skip it
            rec.update(status=type(e).__name__, us=float("nan"), error=_short(e))
        rows_out.append(rec)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    df = pd.DataFrame(rows_out)
    for k, v in point.as_record().items():
        df[k] = v
    df["arch"], df["bucket"], df["kernel_fmt"] = arch, coord.size, coord.fmt
    if write:
        write_winner(df, op, arch, coord.fmt, coord.size,
                     recheck=lambda cur, win: recheck_in_fresh_process(point, cur, win, samples,
                                                                       device))
    return df


def tuned_here(coord: Lookup, arch: str) -> dict[str, Any] | None:
    """The provenance of the entry at exactly this coordinate when it was tuned on this device
    with these torch/Triton versions, else None: `tune_all`'s resume state is the tables
    themselves, so a killed run, started again, goes on where it stopped."""
    import triton

    entry = _entry_at(coord.kernel, arch, coord.fmt, coord.size)
    if entry is None:
        return None
    prov = entry.get("provenance", {})
    here = (bool(prov.get("tuned")) and prov.get("device") == detect_device().name
            and prov.get("torch") == torch.__version__
            and prov.get("triton") == triton.__version__)
    return prov if here else None


def tune_all(points: list[Point], *, device: str | None = None, max_candidates: int = 24,
             samples: int | None = None, write: bool = False, force: bool = False,
             progress: bool = True, on_row: Callable[[dict[str, Any]], None] | None = None
             ) -> pd.DataFrame:
    """Tune every distinct (kernel, format, bucket) coordinate the points hit, once each; one
    summary row per point: tuned (current and best µs, the current entry's repeat noise, the
    verdict written), the same coordinate as an earlier point, done earlier (`tuned_here`,
    unless `force`), or the error. Timings of a coordinate come from one process and GPU.
    `on_row` receives each row as it is done (a killed run keeps what it recorded)."""
    _, arch = backend_and_arch()
    done: dict[tuple[str, str, int], int] = {}
    rows: list[dict[str, Any]] = []
    it = points
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(points, desc="tune --all", unit="shape")
    for i, point in enumerate(it):
        row: dict[str, Any] = {**point.as_record(), "kernel": point.spec.table}
        try:
            prep = prepare(point, device)
            coord = config_coordinate(prep)
            key = (coord.kernel, coord.fmt, coord.size)
            row.update(fmt=coord.fmt, bucket=coord.size)
            skip = _skip_reason(done.get(key),
                                None if key in done or force else tuned_here(coord, arch))
            if skip:
                row["status"] = skip
            else:
                df = tune_prepared(prep, coord, max_candidates=max_candidates, samples=samples,
                                   write=write, progress=progress, device=device)
                row.update(_tuned_row(df, coord.kernel, arch, coord.fmt, coord.size, write))
            done.setdefault(key, i)
        except Exception as e:  # one failing shape is recorded; the others still run
            row.update(status=type(e).__name__, error=_short(e))
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return pd.DataFrame(rows)


def _skip_reason(earlier: int | None, tuned: dict[str, Any] | None) -> str | None:
    """Why a shape is not tuned: an earlier shape hit its coordinate, or the table holds an
    entry tuned there on this device already (`tuned`: its provenance), named with the shape
    it was tuned at where recorded, so a coordinate that two shapes share shows; None: tune
    it."""
    if earlier is not None:
        return f"same coordinate as shape {earlier}"
    if tuned is None:
        return None
    shape = tuned.get("shape")
    at = (f" (at batch {shape['batch']}, context {shape['context']}, rows {shape['rows']})"
          if shape else "")
    return "tuned earlier on this device" + at


def _tuned_row(df: pd.DataFrame, kernel: str, arch: str, fmt: str, bucket: int,
               written: bool) -> dict[str, Any]:
    """A tuned shape's summary: candidates, the current entry's and the best µs, its repeat
    noise, the gain, and what the table now holds when it was written."""
    ok = df[df["status"] == "ok"]
    cur = ok[ok["is_current"]]
    row: dict[str, Any] = {
        "status": "tuned", "candidates": len(df), "verified": len(ok),
        "current_us": float(cur["us"].iloc[0]) if len(cur) else float("nan"),
        "best_us": float(ok["us"].min()) if len(ok) else float("nan"),
        "noise_rel": float(cur["noise_rel"].iloc[0]) if len(cur) else float("nan")}
    row["gain"] = row["current_us"] / row["best_us"]
    if written:
        prov = get_config(kernel, arch, fmt, bucket).provenance
        row.update(verdict=prov.get("verdict"), written_us=prov.get("us"))
    return row


def locate(point: Point, force: bool = False) -> dict[str, Any]:
    """Where a point's kernel looks its config up on this device, and that entry's provenance
    when it is tuned here already (else None): a cluster driver's first question to a
    worker."""
    _, arch = backend_and_arch()
    coord = config_coordinate(prepare(point))
    return {"arch": arch, "kernel": coord.kernel, "fmt": coord.fmt, "bucket": coord.size,
            "tuned_here": None if force else tuned_here(coord, arch)}


def tune_point(point: Point, max_candidates: int, samples: int | None, write: bool = False
               ) -> tuple[pd.DataFrame, Any, Recheck | None]:
    """One shape's candidates, timed in this process on this GPU (their ratios comparable),
    and, with `write`, when a candidate beat a verified current entry, its re-check in a fresh
    process on the same worker; nothing written: the cluster driver writes, one writer per
    table. Returns the device too."""
    prep = prepare(point)
    df = tune_prepared(prep, config_coordinate(prep), max_candidates=max_candidates,
                       samples=samples, write=False, progress=False)
    ok = df[df["status"] == "ok"]
    pair = _contest(ok) if write and not bool(ok["functional_only"].any()) else None
    recheck = recheck_in_fresh_process(point, *pair, samples) if pair else None
    return df, detect_device(), recheck


def tune_all_on_cluster(points: list[Point], address: str, *, max_candidates: int = 24,
                        samples: int | None = None, write: bool = False, force: bool = False,
                        on_row: Callable[[dict[str, Any]], None] | None = None
                        ) -> pd.DataFrame:
    """`tune_all` over a Ray cluster (`qsa.workbench.sweep_ray`): every point located by a
    worker, then each distinct coordinate tuned as one task (one shape's candidates on one
    GPU, in one process), the winners written here by the driver with the worker's device in
    their provenance. Rows as `tune_all`'s, plus the worker's `node`."""
    from qsa.workbench import sweep_ray

    cluster = sweep_ray.connect(address, "auto")
    found = cluster.map(locate, [(p, force) for p in points])
    rows: list[dict[str, Any]] = []
    first: dict[tuple[str, str, int], int] = {}
    to_tune: list[int] = []
    for i, (point, loc) in enumerate(zip(points, found)):
        row: dict[str, Any] = {**point.as_record(), "kernel": point.spec.table}
        if isinstance(loc, BaseException):
            row.update(status=type(loc).__name__, error=_short(loc))
        else:
            key = (loc["kernel"], loc["fmt"], loc["bucket"])
            row.update(fmt=loc["fmt"], bucket=loc["bucket"], arch=loc["arch"])
            skip = _skip_reason(first.get(key), loc["tuned_here"])
            if skip:
                row["status"] = skip
            else:
                to_tune.append(i)
            first.setdefault(key, i)
        rows.append(row)
    results = cluster.map(tune_point, [(points[i], max_candidates, samples, write)
                                       for i in to_tune])
    for i, res in zip(to_tune, results):
        row = rows[i]
        if isinstance(res, BaseException):
            row.update(status=type(res).__name__, error=_short(res))
            continue
        df, dev, recheck = res
        row["node"] = dev.name
        if write:
            write_winner(df, points[i].op, row["arch"], row["fmt"], row["bucket"], device=dev,
                         recheck=recheck)
        row.update(_tuned_row(df, row["kernel"], row["arch"], row["fmt"], row["bucket"], write))
    for row in rows:
        if on_row is not None:
            on_row(row)
    return pd.DataFrame(rows)


def _short(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(e), e)).strip()[:500]


def run_noise(df: pd.DataFrame) -> float:
    """Relative noise of a tuning run: the larger of the current entry's repeat difference and
    the IQR/median of the current entry and of the fastest candidate. A candidate is faster
    only beyond it."""
    ok = df[df["status"] == "ok"]
    best = ok.loc[ok["us"].idxmin()]
    cur = ok[ok["is_current"]]
    terms = [float(best["iqr_us"]) / float(best["us"])]
    if not cur.empty:
        c = cur.iloc[0]
        repeat = c.get("noise_rel")
        terms += [float(repeat) if pd.notna(repeat) else 0.0, float(c["iqr_us"]) / float(c["us"])]
    return max(terms)


def ranked(df: pd.DataFrame) -> pd.DataFrame:
    """Verified candidates fastest first, each with its speedup over the current entry and
    whether that is beyond the run's noise (what `write_winner` would act on)."""
    ok = df[df["status"] == "ok"].sort_values("us").copy()
    if ok.empty:
        return ok
    cur = ok[ok["is_current"]]
    base = float(cur["us"].iloc[0]) if len(cur) else float("nan")
    noise = run_noise(df)
    ok["vs_current"] = base / ok["us"]
    ok["beyond_noise"] = ok["vs_current"] > 1 + noise
    ok["noise_rel"] = noise
    return ok


def _pick(ok: pd.DataFrame) -> tuple[pd.Series, str]:
    """The tuning run's choice among verified rows: the fastest, "faster" when it beats the
    current entry beyond the run's noise, else the current entry, "confirmed"."""
    best = ok.loc[ok["us"].idxmin()]
    cur = ok[ok["is_current"]]
    if not cur.empty:
        c = cur.iloc[0]
        if float(c["us"]) <= float(best["us"]) * (1 + run_noise(ok)):
            return c, "confirmed"  # not faster beyond this run's noise: keep it
    return best, "faster"


def _config(row: pd.Series) -> BlockConfig:
    return BlockConfig.from_dict(json.loads(row["config"]))


def _contest(ok: pd.DataFrame) -> tuple[BlockConfig, BlockConfig] | None:
    """(current, winner) when the tuning run's winner beat a verified current entry: the pair
    a re-check in a fresh process must decide; None when there is nothing to re-check."""
    cur = ok[ok["is_current"]]
    best, verdict = _pick(ok)
    return (_config(cur.iloc[0]), _config(best)) if verdict == "faster" and len(cur) else None


@dataclass(frozen=True)
class Recheck:
    """The current entry and a tuning run's winner timed again in a fresh process: µs of each
    (the mean of its two timings), the re-check's relative noise (the larger spread of the two
    repeats and of each timing's IQR), and where it ran."""

    current_us: float
    winner_us: float
    noise_rel: float
    functional_only: bool
    pid: int
    device: str

    @property
    def confirms(self) -> bool:
        return self.current_us > self.winner_us * (1 + self.noise_rel)


RecheckFn = Callable[[BlockConfig, BlockConfig], Recheck]


def recheck_in_fresh_process(point: Point, current: BlockConfig, winner: BlockConfig,
                             samples: int | None = None, device: str | None = None,
                             timeout_s: float = 900.0) -> Recheck:
    """Time `current` and `winner` on `point` in a new Python process (its own CUDA context,
    caches and clocks history), alternately: current, winner, winner, current; each timing
    verified first. Raises RuntimeError with the child's output tail when it fails."""
    with tempfile.TemporaryDirectory(prefix="qsa-recheck-") as tmp:
        job, out = Path(tmp) / "job.pkl", Path(tmp) / "out.json"
        job.write_bytes(pickle.dumps({"point": point, "configs": [current, winner],
                                      "samples": samples, "device": device}))
        try:
            res = subprocess.run([sys.executable, "-m", "qsa.workbench.tune", "recheck",
                                  str(job), str(out)], capture_output=True, text=True,
                                 timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"re-check of {point.op} in a fresh process took more than "
                               f"{timeout_s:g} s") from None
        if res.returncode != 0 or not out.exists():
            raise RuntimeError(f"re-check of {point.op} in a fresh process failed (exit "
                               f"{res.returncode}): {(res.stderr or res.stdout)[-1500:]}")
        return Recheck(**json.loads(out.read_text()))


def _recheck_child(job: Path, out: Path) -> None:
    """The fresh process of `recheck_in_fresh_process`."""
    spec = pickle.loads(job.read_bytes())
    prep = prepare(spec["point"], spec["device"])
    cur, win = spec["configs"]
    timed: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    for which in (0, 1, 1, 0):
        timed[which].append(measure_prepared(prep, (cur, win)[which], spec["samples"]))

    def mean_us(rs: list[dict[str, Any]]) -> float:
        return sum(float(r["us"]) for r in rs) / len(rs)

    spread = [abs(rs[0]["us"] - rs[1]["us"]) / min(rs[0]["us"], rs[1]["us"])
              for rs in timed.values()]
    iqr = [float(r["iqr_us"]) / float(r["us"]) for rs in timed.values() for r in rs]
    out.write_text(json.dumps(asdict(Recheck(
        current_us=mean_us(timed[0]), winner_us=mean_us(timed[1]),
        noise_rel=max(spread + iqr),
        functional_only=any(bool(r["functional_only"]) for rs in timed.values() for r in rs),
        pid=os.getpid(), device=detect_device().name))))


def write_winner(df: pd.DataFrame, op: str, arch: str, fmt: str, bucket: int,
                 device: Any | None = None, recheck: Recheck | RecheckFn | None = None
                 ) -> BlockConfig:
    """Store the fastest verified candidate with provenance (device, date, versions, µs, and the
    current entry's µs measured in the same run); when it is not faster than the current entry
    beyond the run's noise, the current entry is written back as confirmed. `recheck` (a
    result, or a function of (current, winner) that makes one): a winner must also win the
    re-check in a fresh process, or the current entry is kept, confirmed, with the rejected
    candidate in its provenance. When the current entry itself failed (no verified time to
    compare with), the fastest verified candidate is written without a re-check."""
    ok = df[df["status"] == "ok"]
    if ok.empty:
        raise RuntimeError(f"tune {op}: no candidate passed verification; nothing written")
    if bool(ok["functional_only"].any()):
        raise RuntimeError(f"tune {op}: interpreter timings mean nothing; nothing written")
    best, verdict = _pick(ok)
    cur = ok[ok["is_current"]]
    extra: dict[str, Any] = {}
    pair = _contest(ok) if recheck is not None else None
    if pair:
        r = recheck(*pair) if callable(recheck) else recheck
        if r.functional_only:
            raise RuntimeError(f"tune {op}: the re-check ran on the interpreter; nothing written")
        if r.confirms:
            extra["recheck"] = asdict(r)
        else:
            extra["rejected"] = {"config": json.loads(best["config"]),
                                 "tuning_us": float(best["us"]), "recheck": asdict(r)}
            best, verdict = cur.iloc[0], "confirmed"
    dev = device or detect_device()  # the GPU the candidates ran on (a cluster's worker)
    prov = {"tuned": True, "verdict": verdict, "device": dev.name, "arch": arch,
            "date": dt.date.today().isoformat(), "torch": dev.torch_version,
            "triton": dev.triton_version, "us": float(best["us"]),
            "p10_us": float(best["p10_us"]), "p90_us": float(best["p90_us"]),
            "method": best["method"], "candidates": int(len(df)), "verified": int(len(ok)),
            "previous_us": float(cur["us"].iloc[0]) if not cur.empty else None,
            **_tuned_shape(best), **extra}
    table = find(op).table
    earlier = _tuned_entry(table, arch, fmt, bucket)
    if earlier is not None:
        prov["earlier"] = earlier
    cfg = _config(best)
    write_entry(table, arch, fmt, bucket, cfg, prov)
    return cfg


def _tuned_entry(kernel: str, arch: str, fmt: str, bucket: int) -> dict[str, Any] | None:
    """What a new tuning record replaces at this coordinate, one level deep: the entry's
    config and the summary of its own tuning (a confirmation would otherwise erase the gain
    an earlier run measured). None where the entry was never tuned."""
    entry = _entry_at(kernel, arch, fmt, bucket)
    prov = {} if entry is None else entry.get("provenance", {})
    if not prov.get("tuned"):
        return None
    return {"config": BlockConfig.from_dict(entry).as_dict(),
            **{k: prov[k] for k in EARLIER_KEYS if k in prov}}


def _entry_at(kernel: str, arch: str, fmt: str, bucket: int) -> dict[str, Any] | None:
    """The table entry at exactly this coordinate (no nearest-bucket fallback), or None."""
    try:
        return load_table(kernel)[arch][fmt][str(bucket)]
    except (ConfigError, KeyError):
        return None


def _tuned_shape(row: pd.Series) -> dict[str, Any]:
    """The shape the entry was timed at (batch, context, rows), kept with it: buckets cover
    many shapes, and which one an entry was tuned for decides whether it fits another."""
    shape = {k: int(row[k]) for k in SHAPE_KEYS if k in row.index}
    return {"shape": shape} if shape else {}


if __name__ == "__main__" and sys.argv[1:2] == ["recheck"]:
    _recheck_child(Path(sys.argv[2]), Path(sys.argv[3]))
