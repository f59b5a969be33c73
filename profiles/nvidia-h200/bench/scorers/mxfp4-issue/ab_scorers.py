"""Scorer A/B in one process: the committed stacked and row-wise kernels (committed tables) against
the new ones (new tables). Verify,
then time twice (device-sized graph replay). Usage: PYTHONPATH=.:.gl python3 ab_stacked.py OUT"""
import json, os, sys
import old_score_rowwise
import old_score_stacked
from pathlib import Path
import qsa.kernels.common as common
from qsa.configs import get_config
import qsa.kernels.score_rowwise as new_rowwise
import qsa.kernels.score_stacked as new_stacked
from qsa.measure.timing import time_twice
from qsa.presets import DEFAULT_PRESET, as_preset
from qsa.workbench.ops import Point, prepare

OLD_TABLES = Path(__file__).with_name("old_tables")


def old_lookup(kernel, fmt, size, config=None):
    """The committed kernels read the committed tables."""
    backend, arch = common.backend_and_arch()
    cfg = config if config is not None else get_config(kernel, arch, fmt, size, OLD_TABLES).config
    return cfg, cfg.launch_kwargs(backend, arch)


old_score_stacked.lookup = old_score_rowwise.lookup = old_lookup
current = {}
MODS = {"score_stacked": (new_stacked, old_score_stacked),
        "score_rowwise": (new_rowwise, old_score_rowwise)}
for op, (mod, _) in MODS.items():
    current[op] = getattr(mod, op)
    setattr(mod, "_real", getattr(mod, op))
    setattr(mod, op, lambda *a, _op=op, **k: current[_op](*a, **k))


def variants(op):
    mod, old = MODS[op]
    v = {"committed": getattr(old, op), "new": mod._real}
    return v


POINTS = [("score_stacked", b, ctx, r, f) for b, ctx, r in
          [(64, 131072, 4), (8, 32768, 4), (1, 8192, 4), (32, 32768, 4), (32, 32768, 1)]
          for f in ("bf16", "fp8", "mxfp4")]
POINTS += [("score_rowwise", b, 32768, r, "mxfp4") for b, r in ((8, 4), (32, 1))]
if os.environ.get("SMOKE"):
    POINTS = [("score_stacked", 2, 512, 4, "mxfp4"), ("score_rowwise", 2, 512, 1, "mxfp4")]
out = open(sys.argv[1], "w")
for op, b, ctx, rows, fmt in POINTS:
    prep = prepare(Point(op, as_preset(DEFAULT_PRESET), b, ctx, rows, fmt))
    for name, fn in variants(op).items():
        current[op] = fn
        prep.check(None)
        tt = time_twice(lambda n: prep.call(n, None), prep.n_sets,
                        bytes_per_set=prep.bytes_per_set)
        rec = {"op": op, "batch": b, "context": ctx, "rows": rows, "index_format": fmt,
               "variant": name, "verified": True, "us": tt.first.median_us,
               "repeat_us": tt.second.median_us, "calls": tt.first.calls_per_sample,
               "bytes": prep.work.bytes_moved, "flops": prep.work.flops}
        print(json.dumps(rec), flush=True)
        out.write(json.dumps(rec) + "\n")
