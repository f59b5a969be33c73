"""Per-op measurement: the one path from a shape to a verified, timed, roofline-annotated record.

`measure()` is what the CLI, the notebooks, the tuner and the step roll-up call. For a point it
builds inputs with its op's input builder (`qsa.workbench.registry`), runs the kernel on
poisoned outputs and checks it against the float32 reference (a timing is only recorded for a
verified configuration), then times it over rotated copies of the inputs it reads, so every
call sees a cold last-level cache.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Iterator

from qsa.configs import BlockConfig
from qsa.kernels.common import Lookup, observe_lookups
from qsa.measure.device import detect_device, load_or_measure_ceilings
from qsa.measure.roofline import roofline_record
from qsa.measure.timing import time_fn, time_twice
from qsa.presets import DEFAULT_PRESET, ModelPreset, as_preset
from qsa.workbench.registry import Point, Prepared
from qsa.workbench.verify import ROTATE, VerificationError

__all__ = ["Point", "Prepared", "VerificationError", "config_coordinate", "env_overrides",
           "measure", "measure_prepared", "prepare"]


@contextlib.contextmanager
def env_overrides(env: dict[str, str] | None) -> Iterator[None]:
    """Temporarily set environment toggles such as QSA_STACKED_DECODE_SCORER."""
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def config_coordinate(prep: Prepared) -> Lookup:
    """The config-table coordinate (kernel, format, bucket size) the op's kernel looks its
    table entry up at for this point, observed from one verified run of the kernel with its
    table config. Refuses an op whose call resolves more than one coordinate."""
    kernel = prep.point.spec.table
    with observe_lookups() as seen:
        prep.check(None)
    found = {(s.kernel, s.fmt, s.size): s for s in seen if s.kernel == kernel}
    if len(found) != 1:
        why = ("" if len(found) < 2 else
               ": the call reads more than one table entry, so no single entry decides its "
               "speed (score_prefill scores FP8/MXFP4 keys from their entry's "
               "DECODE_MIN_GROUPS groups on with the BF16 entry's tiles); tune the entry it "
               "borrows, or a shape below that threshold for the format's own entry")
        raise RuntimeError(f"{prep.point.op}: expected one config lookup of {kernel!r}, "
                           f"saw {sorted(found) or 'none'}{why}")
    return next(iter(found.values()))


def prepare(point: Point, device: str | None = None) -> Prepared:
    dev = detect_device()
    device = device or ("cuda" if dev.is_gpu else "cpu")
    return point.spec.build(point, device, dev)


def _implementation(prep: Prepared, seen: list[Lookup]) -> str:
    """Which implementation of the op's kernel ran the call ("triton", "gluon"): the entry
    its own config lookup resolved, so the record says it whoever chose (a table or an
    explicit config)."""
    impls = sorted({s.config.impl for s in seen if s.kernel == prep.point.spec.table})
    return ",".join(impls) or "triton"


def _verified_record(point: Point, config: BlockConfig | None) -> dict[str, Any]:
    """The columns of a verified point before its timing: shape, kernel, config."""
    return {**point.as_record(), "kernel": point.spec.table,
            "config": json.dumps(config.as_dict() if config else None, sort_keys=True),
            "verified": True}


def measure_prepared(prep: Prepared, config: BlockConfig | None = None,
                     samples: int | None = None, twice: bool = False) -> dict[str, Any]:
    """Verify, then time, one prepared point under one config; one flat record. With `twice`,
    the point is timed a second time in the same run and the record carries the repeat and
    the noise verdict (`repeat_same_within_noise`), so a caller can tell noise from change."""
    dev = detect_device()
    with observe_lookups() as seen:
        prep.check(config)
    kw: dict[str, Any] = {"bytes_per_set": prep.bytes_per_set}
    if samples is not None:
        kw["samples"] = samples
    fn = lambda i: prep.call(i, config)  # noqa: E731
    repeat: dict[str, Any] = {}
    if twice:
        tt = time_twice(fn, prep.n_sets, **kw)
        timing, repeat = tt.first, tt.as_record()
    else:
        timing = time_fn(fn, prep.n_sets, **kw)
    ceilings = load_or_measure_ceilings(dev) if dev.is_gpu else None
    matrix = "fp8" if prep.point.fmt == "fp8" and prep.point.spec.fp8_matrix else "bf16"
    rec: dict[str, Any] = {
        **_verified_record(prep.point, config),
        **prep.inputs,
        **timing.as_record(),
        **{k: v for k, v in repeat.items() if k.startswith(("repeat_", "noise_"))},
        **roofline_record(timing, prep.work, ceilings, matrix=matrix),
        "impl": _implementation(prep, seen),
    }
    rec["us"] = rec["median_us"]
    return rec


def measure(op: str, *, preset: str | ModelPreset = DEFAULT_PRESET, batch: int,
            context: int,
            rows: int, index_format: str = "bf16", kv_format: str = "bf16",
            config: BlockConfig | None = None, device: str | None = None,
            env: dict[str, str] | None = None, seed: int = 0,
            samples: int | None = None, selection: str = "index", timed: bool = True,
            overlap: float = 0.0, sharing: str = "auto", trace: str | None = None,
            trace_layer: int | None = None) -> dict[str, Any]:
    """Build, verify and time one point; see the module docstring. `timed=False` verifies
    only (one input set, no timing): quick checks and memory-checker runs."""
    with env_overrides(env):
        point = Point(op, as_preset(preset), batch, context, rows, index_format, kv_format,
                      seed, selection, overlap, sharing, trace, trace_layer)
        if timed:
            rec = measure_prepared(prepare(point, device), config, samples)
        else:
            token = ROTATE.set(False)
            try:
                prep = prepare(point, device)
                prep.check(config)
            finally:
                ROTATE.reset(token)
            rec = {**_verified_record(point, config), **prep.inputs, "us": None}
    rec["env"] = json.dumps(env or {}, sort_keys=True)
    return rec
