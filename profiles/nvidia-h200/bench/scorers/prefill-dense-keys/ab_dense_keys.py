"""Prefill scorer A/B in one process: the committed kernel and tables against the new ones.
New: FP8/MXFP4 keys decoded once are read densely (no identity page table, so no table walk
in the scorer and no kernel to build the table), and the scorer is a dependent launch of the
decode pass. Variants of the new code switch one part off or change the decode pass's
programs, the scorer's stages on the scratch, or force the decode pass at short contexts. Every variant is
verified against the float32 reference, then timed twice (device-sized graph replay, inputs
rotated past the L2).

    PYTHONPATH=. python3 ab_dense_keys.py OLD_TREE OUT.jsonl     (AB_QUICK=1: committed and new)

OLD_TREE holds the committed `qsa/` (e.g. `git archive HEAD qsa | tar -x -C OLD_TREE`)."""
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from qsa.configs import TABLE_DIR, get_config
from qsa.kernels import score_prefill as new
from qsa.kernels.common import backend_and_arch
from qsa.measure.timing import time_twice
from qsa.presets import DEFAULT_PRESET, as_preset
from qsa.workbench.ops import Point, prepare

OLD_TREE = Path(sys.argv[1])
spec = importlib.util.spec_from_file_location("old_score_prefill",
                                              OLD_TREE / "qsa" / "kernels" / "score_prefill.py")
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
BACKEND, ARCH = backend_and_arch()


def old_lookup(kernel, fmt, size, config=None):
    """The committed kernel reads the committed tables."""
    cfg = config if config is not None else get_config(
        kernel, ARCH, fmt, size, OLD_TREE / "qsa" / "configs" / "tables").config
    return cfg, cfg.launch_kwargs(BACKEND, ARCH)


old.lookup = old_lookup
real_new = new.score_prefill
current = {"fn": real_new}
new.score_prefill = lambda *a, **k: current["fn"](*a, **k)

# Tables whose sm90 BF16 entry has 2 stages: the decoded launch takes the BF16 entry's tiles.
STAGES2 = Path(tempfile.mkdtemp()) / "tables"
shutil.copytree(TABLE_DIR, STAGES2)
table = json.loads((STAGES2 / "score_prefill.json").read_text())
table["sm90"]["bf16"]["4096"]["num_stages"] = 2
(STAGES2 / "score_prefill.json").write_text(json.dumps(table))

# name: (function, environment, module attributes of the new code, formats)
LOW = ("fp8", "mxfp4")
VARIANTS = {
    "committed": (old.score_prefill, {}, {}, ("bf16",) + LOW),
    "new": (real_new, {}, {}, ("bf16",) + LOW),
    "new, BF16 entry at 2 stages": (real_new, {"QSA_CONFIG_DIR": str(STAGES2)}, {},
                                    ("bf16",) + LOW),
    "new, no dependent launch": (real_new, {}, {"DECODE_PDL": False}, LOW),
    "new, decode programs of 16 groups": (real_new, {}, {"DECODE_BLOCK_N": 16}, LOW),
    "new, decode programs of 32 groups": (real_new, {}, {"DECODE_BLOCK_N": 32}, LOW),
    "new, decode once forced": (real_new, {new.DECODE_ENV: "1"}, {}, LOW),
    "new, decode once forced, 2 stages": (real_new, {new.DECODE_ENV: "1",
                                                     "QSA_CONFIG_DIR": str(STAGES2)}, {}, LOW),
}
if os.environ.get("AB_QUICK"):  # the final check: the committed code and tables against the new
    VARIANTS = {k: VARIANTS[k] for k in ("committed", "new")}
FORCED_BELOW = 16384  # contexts whose groups are below the threshold: the forced variants
SHAPES = [(1, 65536, 16384), (1, 16384, 16384), (1, 16384, 4096), (1, 8192, 8192),
          (1, 8192, 4096), (1, 4096, 4096)]  # (batch, context, rows per request)
if os.environ.get("SMOKE"):
    SHAPES = [(1, 512, 256)]
DEFAULTS = {k: getattr(new, k) for k in ("DECODE_PDL", "DECODE_BLOCK_N")}
out = open(sys.argv[2], "w")
for batch, ctx, rows in SHAPES:
    for fmt in ("bf16",) + LOW:
        prep = prepare(Point("score_prefill", as_preset(DEFAULT_PRESET), batch, ctx, rows,
                             index_format=fmt))
        for name, (fn, env, attrs, formats) in VARIANTS.items():
            if fmt not in formats or ("forced" in name and ctx >= FORCED_BELOW):
                continue
            current["fn"] = fn
            os.environ.update(env)
            for k, v in {**DEFAULTS, **attrs}.items():
                setattr(new, k, v)
            try:
                prep.check(None)
                tt = time_twice(lambda n: prep.call(n, None), prep.n_sets,
                                bytes_per_set=prep.bytes_per_set)
            finally:
                for k in env:
                    os.environ.pop(k)
            rec = {"op": "score_prefill", "batch": batch, "context": ctx, "rows": rows,
                   "index_format": fmt, "kv_format": "bf16", "variant": name, "verified": True,
                   "us": tt.first.median_us, "repeat_us": tt.second.median_us,
                   "tflops": prep.work.flops / tt.first.median_us / 1e6}
            print(json.dumps(rec), file=out, flush=True)
            print(f"{ctx:>6} {rows:>6} {fmt:>6} {name:<36} {rec['us']:9.1f} us "
                  f"(again {rec['repeat_us']:9.1f}) {rec['tflops']:6.1f} TFLOP/s", flush=True)
