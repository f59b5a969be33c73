"""Stacked decode scorer, one verified and timed point per format and shape (graph replay,
inputs rotated past the L2); prints one CSV line each. Usage: python3 measure.py LABEL"""
import sys

from qsa.workbench.ops import measure

label = sys.argv[1]
for batch, ctx in ((64, 131072), (8, 32768), (1, 8192)):
    for fmt in ("bf16", "fp8", "mxfp4"):
        r = measure("score_stacked", batch=batch, context=ctx, rows=4, index_format=fmt)
        print(f"{label},{batch},{ctx},{fmt},{r['us']:.2f},{r['p10_us']:.2f},{r['p90_us']:.2f},"
              f"{r.get('pct_bandwidth', float('nan')):.1f}", flush=True)
