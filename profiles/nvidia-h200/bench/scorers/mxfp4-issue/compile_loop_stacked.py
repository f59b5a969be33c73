"""Stacked scorer compiled for sm90 on the CPU (no launch): registers, spills, shared memory
and the SASS opcodes of the main loop (the longest backward branch) per warp per tile.
Usage (TRITON_INTERPRET unset): PYTHONPATH=. python3 compile_loop_stacked.py FMT BATCH CONTEXT
CANDIDATES_JSON (changes to the sm90 entry, as `qsa tune --candidates`); DUMP=FILE keeps the
SASS and PTX."""
import collections
import json
import os
import sys

from qsa.kernels.common import lookup
from qsa.presets import as_preset
from qsa.workbench.compile_check import compiling_for, loop_opcodes, sm90_sass, usage
from qsa.workbench.ops import Point, prepare
from qsa.workbench.tune import with_changes

fmt, batch, ctx, changes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
dump = os.environ.get("DUMP")
point = Point("score_stacked", as_preset("qwen3.8-flash-next"), batch, ctx, 4, index_format=fmt, kv_format="bf16")
with compiling_for("sm90") as compiled:
    base = lookup("score_stacked", fmt, ctx // 4, None)[0]
    prep = prepare(point, "cpu")
    for change in [{}, *changes]:
        cfg = with_changes(base, change)
        compiled.clear()
        prep.call(0, cfg)
        for name, kernel in compiled:
            u = usage("sm90", kernel)
            s = sm90_sass(kernel.asm["cubin"])
            ops = loop_opcodes(s)
            if dump:
                open(dump, "w").write(s)
                open(dump + ".ptx", "w").write(kernel.asm["ptx"])
            print(json.dumps({"name": name[:90], "change": change, **u, "loop_instr_per_warp": len(ops), "block_n": cfg.meta["BLOCK_N"], "warps": cfg.num_warps}), flush=True)
            print("   ", collections.Counter(o.split(".")[0] for o in ops).most_common(18),
                  flush=True)
