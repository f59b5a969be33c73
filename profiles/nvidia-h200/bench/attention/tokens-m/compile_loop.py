"""Sparse GQA decode candidates compiled for sm90 on the CPU (no launch): registers, spills,
shared memory, programs per SM, the MMA instructions in the PTX, and the SASS opcodes of the
main loop (the longest backward branch), per warp per tile. Environment MAXNREG caps the
registers (Triton's `maxnreg` launch option) for every candidate.
Usage (TRITON_INTERPRET unset): python3 compile_loop.py KV_FORMAT BUCKET CANDIDATES_JSON
CANDIDATES_JSON: changes to the sm90 entry at BUCKET, as `qsa tune --candidates`."""
import collections
import json
import os
import re
import sys

import qsa.kernels.sparse_gqa as sparse_gqa
from qsa.kernels.common import lookup
from qsa.presets import as_preset
from qsa.workbench.compile_check import compiling_for, loop_opcodes, sm90_sass, usage
from qsa.workbench.ops import Point, prepare
from qsa.workbench.tune import with_changes

SM90_SHARED_PER_SM = 228 * 1024  # each resident block also reserves 1 KiB
CAP = int(os.environ.get("MAXNREG", "0"))
real_lookup = sparse_gqa.lookup


def capped_lookup(*args, **kwargs):
    cfg, kw = real_lookup(*args, **kwargs)
    return cfg, {**kw, "maxnreg": CAP} if CAP else kw


sparse_gqa.lookup = capped_lookup
fmt, bucket, changes = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
point = Point("sparse_gqa_decode", as_preset("qwen3.8-flash-next"), 64, 8192, 4, kv_format=fmt,
              selection="random")
with compiling_for("sm90") as compiled:
    base = lookup("sparse_gqa_decode", fmt, bucket, None)[0]
    prep = prepare(point, "cpu")
    for change in [{}, *changes]:
        cfg = with_changes(base, change)
        compiled.clear()
        prep.call(0, cfg)
        for name, kernel in compiled:
            if "merge" in name or "slots" in name:
                continue
            u = usage("sm90", kernel)
            per_sm = min(SM90_SHARED_PER_SM // (u["shared_bytes"] + 1024),
                         65536 // (max(u["registers"], 1) * 32 * cfg.num_warps))
            ops = loop_opcodes(sm90_sass(kernel.asm["cubin"]))
            mma = sorted(set(re.findall(r"(mma\.sync[^ ]*|wgmma\.mma_async[^ ]*)",
                                        kernel.asm["ptx"])))
            print(json.dumps({"change": change, "maxnreg": CAP, **u, "programs_per_sm": per_sm,
                              "loop_instructions_per_warp": len(ops), "mma": mma}), flush=True)
            top = collections.Counter(o.split(".")[0] for o in ops).most_common(14)
            print("    loop opcodes:", top, flush=True)
