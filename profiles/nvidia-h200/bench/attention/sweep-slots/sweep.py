"""Sparse GQA decode candidates, random selections, 128K context, qwen3.8-flash-next, 4 rows
per request: every candidate verified against the float32 reference before it is timed
(qsa tune, graph replay, inputs rotated past the L2), the table entry first.
Usage: python3 sweep.py OUT_DIR GRID_JSON [write]
GRID_JSON: {"<batch>[@<context>]": {"<kv format>": [[BLOCK_N, warps, stages, SLOTS
[, SPLIT_RESIDENT_PER_SM]], ...]}}
(context 131072 unless given); `write` stores each shape's winner in the config table."""
import json
import sys
from pathlib import Path

import pandas as pd

from qsa.measure.device import detect_device
from qsa.workbench.tune import tune


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    frames = []
    write = sys.argv[3:] == ["write"]
    for key, per_fmt in json.loads(sys.argv[2]).items():
        batch, _, ctx = key.partition("@")
        for fmt, tiles in per_fmt.items():
            cands = [{"meta": {"BLOCK_N": t[0], "SLOTS": t[3],
                               **({"SPLIT_RESIDENT_PER_SM": t[4]} if len(t) > 4 else {})},
                      "num_warps": t[1], "num_stages": t[2]} for t in tiles]
            df = tune("sparse_gqa_decode", batch=int(batch), context=int(ctx or 131072),
                      rows=4, kv_format=fmt, selection="random", candidates=cands,
                      progress=False, write=write)
            frames.append(df)
            ok = df[df.status == "ok"].sort_values("us")
            print(f"b{batch} {fmt}: {len(ok)}/{len(df)} verified", flush=True)
            print(ok[["candidate", "us", "p10_us", "p90_us", "config"]].head(6).to_string(),
                  flush=True)
            bad = df[df.status != "ok"]
            if len(bad):
                print(bad[["candidate", "status", "error", "config"]].to_string(), flush=True)
    res = pd.concat(frames, ignore_index=True)
    res["device"] = detect_device().name
    res.to_csv(out / "sweep.csv", index=False)


if __name__ == "__main__":
    main()
