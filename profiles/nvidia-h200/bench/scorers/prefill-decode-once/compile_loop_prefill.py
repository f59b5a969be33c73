"""The prefill scorer compiled for sm90 on the CPU (no launch), keys decoded once (forced), for
BF16, FP8 and MXFP4 keys: registers, spills, shared memory and the SASS opcodes of the main
loop (the longest backward branch) per warp per trip. The three formats then run the same
kernel on bf16 tiles, except that FP8 multiplies each score tile by its keys' row scales.
Usage (TRITON_INTERPRET unset): PYTHONPATH=. python3 compile_loop_prefill.py > OUT.txt"""
import collections
import json
import os

from qsa.kernels.score_prefill import DECODE_ENV
from qsa.presets import as_preset
from qsa.workbench.compile_check import sm90_loops, usage
from qsa.workbench.ops import Point

os.environ[DECODE_ENV] = "1"
for fmt in ("bf16", "fp8", "mxfp4"):
    point = Point("score_prefill", as_preset("qwen3.8-flash-next"), 1, 8192, 256,
                  index_format=fmt)
    for name, kernel, ops in sm90_loops(point, skip="decode"):
        print(json.dumps({"fmt": fmt, "name": name, **usage("sm90", kernel),
                          "loop_instr_per_warp": len(ops)}), flush=True)
        print("   ", collections.Counter(o.split(".")[0] for o in ops).most_common(24),
              flush=True)
