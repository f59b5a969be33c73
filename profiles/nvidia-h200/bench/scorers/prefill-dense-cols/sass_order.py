"""Where the loads sit in the prefill scorer's main loop: the decoded-once FP8 kernel at 16K
rows x 64K compiled for sm90 on the CPU (no launch), the loop's SASS listed by position with
its global loads, MMAs and their waits. Shows whether the column-scale loads are issued
before the MMAs (latency hidden) or after the last MMA wait (latency exposed).
Usage (TRITON_INTERPRET unset): PYTHONPATH=TREE python3 sass_order.py > OUT.txt"""
from qsa.presets import as_preset
from qsa.workbench.compile_check import sm90_loops
from qsa.workbench.ops import Point

KEEP = ("LDG", "HGMMA", "WARPGROUP", "BAR", "LDGSTS", "STG")
point = Point("score_prefill", as_preset("qwen3.8-flash-next"), 1, 65536, 16384,
              index_format="fp8")
for name, _, ops in sm90_loops(point, skip="decode"):
    print(name, f"{len(ops)} loop instructions per warp")
    print(" ".join(f"{i}:{o.split()[0]}" for i, o in enumerate(ops)
                   if o.split(".")[0] in KEEP or "DEPBAR" in o))
