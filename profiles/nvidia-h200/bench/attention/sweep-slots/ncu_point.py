"""One verified launch of a workbench point, for ncu: the check launch comes first (poisoned
output, compared to the reference), the profiled launch second.
Usage: python3 ncu_point.py OP FMT BATCH [CONTEXT [ROWS [CONFIG_JSON]]]
FMT is the KV format for sparse GQA and K/V stores, the index format otherwise; sparse GQA
decode uses random (worst-case) selections."""
import json
import sys

import torch

from qsa.configs import BlockConfig
from qsa.presets import as_preset
from qsa.workbench.ops import KV_OPS, Point, prepare

op, fmt, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
context = int(sys.argv[4]) if len(sys.argv) > 4 else 131072
rows = int(sys.argv[5]) if len(sys.argv) > 5 else 4
cfg = BlockConfig.from_dict(json.loads(sys.argv[6])) if len(sys.argv) > 6 else None
formats = {"kv_format": fmt} if op in KV_OPS else {"index_format": fmt}
point = Point(op, as_preset("qwen3.8-flash-next"), batch, context, rows, **formats,
              selection="random" if op == "sparse_gqa_decode" else "index")
prep = prepare(point)
prep.check(cfg)
prep.call(0, cfg)
torch.cuda.synchronize()
print("ok", point, cfg)
