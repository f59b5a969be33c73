"""Where a row-block call of sparse GQA prefill spends its time: the union build (torch sort,
cumsum and scatters) against the attention kernel, from torch.profiler's device times, for the
table's entry (ROWS 1) and the best row-block candidates of the tune. One verified call each,
then 5 profiled calls.
Usage: python3 split_time.py CONTEXT"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from qsa.configs import BlockConfig, get_config
from qsa.kernels.common import backend_and_arch
from qsa.presets import as_preset
from qsa.workbench.ops import Point, prepare

context = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
for fmt, changes in (("bf16", [{}, {"meta": {"ROWS": 4, "PV_HALVES": 1}, "num_warps": 4,
                                    "num_stages": 2}]),
                     ("fp8", [{}, {"meta": {"ROWS": 2, "BLOCK_N": 64}}])):
    point = Point("sparse_gqa_prefill", as_preset("qwen3.8-flash-next"), 1, context, 4096,
                  kv_format=fmt)
    prep = prepare(point)
    entry = get_config("sparse_gqa_prefill", backend_and_arch()[1], fmt, 4096).config
    for change in changes:
        d = entry.as_dict()
        d["meta"] = {**d["meta"], **change.get("meta", {})}
        d.update({k: v for k, v in change.items() if k != "meta"})
        cfg = BlockConfig.from_dict(d)
        prep.check(cfg)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(5):
                prep.call(i % prep.n_sets, cfg)
            torch.cuda.synchronize()
        rows = [(e.key, e.device_time_total / 5) for e in prof.key_averages()
                if e.device_time_total > 0]
        total = sum(t for _, t in rows)
        print(f"\n{fmt} ROWS={cfg.meta.get('ROWS')} {cfg.as_dict()}: {total:.1f} us of device "
              "time per call")
        for name, t in sorted(rows, key=lambda r: -r[1])[:8]:
            print(f"  {t:9.1f} us  {name[:110]}")
