"""Verify then time decode points (device-sized graph replay, timed twice); one line each.
Usage: PYTHONPATH=. python3 points.py TAG "OP BATCH CONTEXT ROWS INDEX_FMT KV_FMT SELECTION" ..."""
import json, sys
from qsa.measure.timing import time_twice
from qsa.presets import DEFAULT_PRESET, as_preset
from qsa.workbench.ops import Point, prepare
tag = sys.argv[1]
for spec in sys.argv[2:]:
    op, b, ctx, r, i, k, sel = spec.split()
    prep = prepare(Point(op, as_preset(DEFAULT_PRESET), int(b), int(ctx), int(r), i, k, 0, sel))
    prep.check(None)
    tt = time_twice(lambda n: prep.call(n, None), prep.n_sets, bytes_per_set=prep.bytes_per_set)
    print(json.dumps({"tag": tag, "point": spec, "us": tt.first.median_us,
                      "repeat_us": tt.second.median_us, "calls": tt.first.calls_per_sample}),
          flush=True)
