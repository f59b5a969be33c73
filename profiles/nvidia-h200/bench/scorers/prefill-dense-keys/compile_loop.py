"""The prefill scorer compiled for sm90 on the CPU (no launch), FP8 and MXFP4 keys decoded once
(forced), against BF16 keys on the paged arena: registers, spills, shared memory and the SASS
instructions of the main loop (the longest backward branch) per warp per trip.
Usage (TRITON_INTERPRET unset): PYTHONPATH=TREE python3 compile_loop.py ROWS CONTEXT"""
import collections
import json
import os
import sys

from qsa.kernels.score_prefill import DECODE_ENV
from qsa.presets import as_preset
from qsa.workbench.compile_check import sm90_loops, usage
from qsa.workbench.ops import Point

rows, context = int(sys.argv[1]), int(sys.argv[2])
os.environ[DECODE_ENV] = "1"
for fmt in ("bf16", "fp8", "mxfp4"):
    point = Point("score_prefill", as_preset("qwen3.8-flash-next"), 1, context, rows,
                  index_format=fmt)
    for name, kernel, ops in sm90_loops(point, skip="decode"):
        print(json.dumps({"fmt": fmt, "name": name, **usage("sm90", kernel),
                          "loop_instr_per_warp": len(ops)}), flush=True)
        print("   ", collections.Counter(o.split(".")[0] for o in ops).most_common(16),
              flush=True)
