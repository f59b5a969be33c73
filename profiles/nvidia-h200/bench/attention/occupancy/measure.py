"""FP8 sparse GQA decode at b64 x 128K: does a third resident program per SM pay? The ncu
profile of the table entry (2 programs per SM, BLOCK_N 128) shows it latency-bound (issue
slots 28% busy, 6.5 cycles per issued instruction, top stall the barrier after the K/V tile
wait). BLOCK_N 64 halves shared memory, so three programs fit if registers are capped at 168
(ptxas -maxrregcount, Triton's `maxnreg` launch option; compile_*.txt: 16 bytes spilled).
Every candidate is verified against the float32 reference, then timed (graph replay, inputs
rotated past the L2) in this one process, next to the BF16 entry.
Usage: python3 measure.py OUT_CSV"""
import json
import sys

import pandas as pd

import qsa.kernels.sparse_gqa as sparse_gqa
from qsa.configs import BlockConfig
from qsa.kernels.common import lookup
from qsa.presets import as_preset
from qsa.workbench.ops import Point, measure_prepared, prepare

real_lookup = sparse_gqa.lookup
CAP: dict[str, int] = {}


def capped_lookup(*args, **kwargs):
    cfg, kw = real_lookup(*args, **kwargs)
    return cfg, {**kw, **CAP}


sparse_gqa.lookup = capped_lookup
preset = as_preset("qwen3.8-flash-next")
rows = []
for fmt, candidates in (
        ("bf16", [({}, 0)]),
        ("fp8", [({}, 0), ({}, 168),
                 ({"BLOCK_N": 64}, 0), ({"BLOCK_N": 64}, 168),
                 ({"BLOCK_N": 64, "NUM_SPLITS": 2}, 168), ({"BLOCK_N": 64, "NUM_SPLITS": 3}, 168),
                 ({"BLOCK_N": 64, "NUM_SPLITS": 3}, 0), ({}, 0)])):
    point = Point("sparse_gqa_decode", preset, 64, 131072, 4, kv_format=fmt, selection="random")
    prep = prepare(point)
    entry = lookup("sparse_gqa_decode", fmt, 256, None)[0].as_dict()
    for meta, cap in candidates:
        d = json.loads(json.dumps(entry))
        d["meta"].update(meta)
        cfg = BlockConfig.from_dict(d)
        CAP.clear()
        if cap:
            CAP["maxnreg"] = cap
        try:
            rec = measure_prepared(prep, cfg)
            rec.update(change=json.dumps(meta), maxnreg=cap, status="ok")
        except Exception as e:  # recorded, the others still run
            rec = {"kv_format": fmt, "change": json.dumps(meta), "maxnreg": cap,
                   "status": f"{type(e).__name__}: {str(e)[:200]}"}
        rows.append(rec)
        print(fmt, meta, cap, rec.get("us"), rec["status"], flush=True)
df = pd.DataFrame(rows)
df.to_csv(sys.argv[1], index=False)
bf16 = df[(df.kv_format == "bf16") & (df.status == "ok")]["us"].min()
print(df[["kv_format", "change", "maxnreg", "us", "status"]].assign(vs_bf16=bf16 / df["us"]).to_string())
