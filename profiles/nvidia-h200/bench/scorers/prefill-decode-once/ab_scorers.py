"""Scorer A/B in one process: the committed kernel and tables against the new ones, every index
format. Prefill (`score_prefill`): FP8 and MXFP4 keys decoded in every tile (committed) against
decoded once per call into a bf16 scratch from DECODE_MIN_GROUPS groups on, the new path also
forced to either decode (`QSA_PREFILL_DECODE_ONCE`). Both ops: the FP8 column scales requested
before the MMAs (new) instead of after them. Every variant is verified against the float32
reference, then timed twice (device-sized graph replay, inputs rotated past the L2).

    PYTHONPATH=. python3 ab_scorers.py OP OLD_TREE OUT.jsonl

OP is score_prefill, score_stacked or sparse_gqa_decode (BF16 and FP8 K/V, random selections;
new: the FP8 value scales requested with the key scales); OLD_TREE holds the committed `qsa/` (e.g.
`git archive HEAD qsa | tar -x -C OLD_TREE`)."""
import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path

from qsa.configs import get_config
from qsa.kernels.common import backend_and_arch
from qsa.measure.timing import time_twice
from qsa.presets import DEFAULT_PRESET, as_preset
from qsa.workbench.ops import Point, prepare

OP, OLD_TREE = sys.argv[1], Path(sys.argv[2])
MODULE = {"sparse_gqa_decode": "sparse_gqa"}.get(OP, OP)
new = importlib.import_module(f"qsa.kernels.{MODULE}")
spec = importlib.util.spec_from_file_location(f"old_{MODULE}",
                                              OLD_TREE / "qsa" / "kernels" / f"{MODULE}.py")
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
BACKEND, ARCH = backend_and_arch()


def old_lookup(kernel, fmt, size, config=None):
    """The committed kernel reads the committed tables."""
    cfg = config if config is not None else get_config(
        kernel, ARCH, fmt, size, OLD_TREE / "qsa" / "configs" / "tables").config
    return cfg, cfg.launch_kwargs(BACKEND, ARCH)


old.lookup = old_lookup
real_new = getattr(new, OP)
current = {"fn": real_new}
setattr(new, OP, lambda *a, **k: current["fn"](*a, **k))

ENV = "QSA_PREFILL_DECODE_ONCE"
VARIANTS = {"committed": (getattr(old, OP), None), "new": (real_new, None)}  # fn, ENV value
if OP == "score_prefill":
    VARIANTS.update({"new, tile decode forced": (real_new, "0"),
                     "new, decode once forced": (real_new, "1")})
    SHAPES = [(1, 65536, 16384), (1, 16384, 16384), (1, 16384, 4096), (1, 4096, 4096),
              (1, 65536, 4096), (1, 8192, 4096)]  # (batch, context, rows per request)
elif OP == "score_stacked":
    SHAPES = [(64, 131072, 4), (32, 32768, 4), (32, 32768, 1), (8, 32768, 4), (1, 8192, 4)]
else:  # sparse GQA decode, random (worst-case) selections
    SHAPES = [(64, 131072, 4), (32, 32768, 4), (32, 32768, 1), (8, 131072, 4), (1, 131072, 4)]
if os.environ.get("AB_QUICK"):  # the final check: committed against new at four shapes
    VARIANTS = {k: VARIANTS[k] for k in ("committed", "new")}
    SHAPES = [(1, 65536, 16384), (1, 16384, 16384), (1, 8192, 4096), (1, 4096, 4096)]
if os.environ.get("SMOKE"):
    SHAPES = [(1, 512, 256 if OP == "score_prefill" else 4)]
FORMATS = ([("bf16", "bf16"), ("bf16", "fp8")] if OP == "sparse_gqa_decode"
           else [(f, "bf16") for f in ("bf16", "fp8", "mxfp4")])  # (index, K/V)
out = open(sys.argv[3], "w")
for batch, ctx, rows in SHAPES:
    for index_fmt, kv_fmt in FORMATS:
        fmt = kv_fmt if OP == "sparse_gqa_decode" else index_fmt
        prep = prepare(Point(OP, as_preset(DEFAULT_PRESET), batch, ctx, rows, index_fmt, kv_fmt,
                             selection="random" if OP == "sparse_gqa_decode" else "index"))
        for name, (fn, flag) in VARIANTS.items():
            if fmt == "bf16" and flag is not None:
                continue
            current["fn"] = fn
            if flag is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = flag
            prep.check(None)
            tt = time_twice(lambda n: prep.call(n, None), prep.n_sets,
                            bytes_per_set=prep.bytes_per_set)
            rec = {"op": OP, "batch": batch, "context": ctx, "rows": rows,
                   "index_format": index_fmt, "kv_format": kv_fmt, "variant": name,
                   "verified": True,
                   "us": tt.first.median_us, "repeat_us": tt.second.median_us,
                   "tflops": prep.work.flops / tt.first.median_us / 1e6}
            print(json.dumps(rec), file=out, flush=True)
            print(f"b{batch:<3} {ctx:>6} {rows:>6} {fmt:>6} {name:<24} {rec['us']:9.1f} us "
                  f"(again {rec['repeat_us']:9.1f}) {rec['tflops']:6.1f} TFLOP/s", flush=True)
os.environ.pop(ENV, None)
