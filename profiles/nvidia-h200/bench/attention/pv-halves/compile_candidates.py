"""Registers, spills and shared memory of sparse GQA decode candidates compiled for sm90 on the
CPU (no launch), so a tile's programs per SM are known before any device time is spent.
Usage: python3 compile_candidates.py KV_FORMAT CANDIDATES_JSON
CANDIDATES_JSON: a list of changes to the sm90 b64 x 128K entry, as `qsa tune --candidates`."""
import json
import sys

from qsa.workbench.compile_check import compiling_for, usage
from qsa.workbench.ops import Point, prepare
from qsa.workbench.tune import with_changes
from qsa.kernels.common import lookup
from qsa.presets import as_preset

SM90_SHARED_PER_SM = 228 * 1024  # shared memory of one SM; each resident block also reserves 1 KiB

fmt, changes = sys.argv[1], json.loads(sys.argv[2])
point = Point("sparse_gqa_decode", as_preset("qwen3.8-flash-next"), 64, 8192, 4, kv_format=fmt,
              selection="random")
with compiling_for("sm90") as compiled:
    base = lookup("sparse_gqa_decode", fmt, 256, None)[0]
    prep = prepare(point, "cpu")
    for ch in [{}, *changes]:
        cfg = with_changes(base, ch)
        compiled.clear()
        prep.call(0, cfg)
        for name, k in compiled:
            if "merge" in name or "slots" in name:
                continue
            u = usage("sm90", k)
            per_sm = min(SM90_SHARED_PER_SM // (u["shared_bytes"] + 1024),
                         65536 // (max(u["registers"], 1) * 32 * cfg.num_warps))
            print(json.dumps({"change": ch, **u, "programs_per_sm": per_sm}), flush=True)
