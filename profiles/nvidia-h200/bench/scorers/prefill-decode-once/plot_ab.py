"""Speed of FP8 and MXFP4 keys against BF16 keys per prefill shape, committed kernel against the
new one, from one A/B run (`ab_final.jsonl`). Writes ab_final.png/.svg next to it.

    python3 plot_ab.py"""
from pathlib import Path

import matplotlib
import pandas as pd

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

here = Path(__file__).parent
df = pd.read_json(here / "ab_final.jsonl", lines=True)
df["shape"] = [f"{r // 1024}K rows x {c // 1024}K" for r, c in zip(df.rows, df.context)]
bf16 = df[df.index_format == "bf16"].set_index(["shape", "variant"]).us
df = df[df.index_format != "bf16"].copy()
df["ratio"] = [bf16[(s, v)] / us for s, v, us in zip(df["shape"], df.variant, df.us)]
shapes = list(dict.fromkeys(df["shape"]))
fig, ax = plt.subplots(figsize=(8, 4.4))
bars = [(f, v) for f in ("fp8", "mxfp4") for v in ("committed", "new")]
width = 0.8 / len(bars)
for i, (f, v) in enumerate(bars):
    sel = df[(df.index_format == f) & (df.variant == v)].set_index("shape").ratio
    ax.bar([j + i * width for j in range(len(shapes))], [sel[s] for s in shapes], width,
           label=f"{f.upper()} keys, {v}", alpha=0.55 if v == "committed" else 1.0,
           color="tab:orange" if f == "fp8" else "tab:blue")
ax.axhline(0.95, color="k", ls="--", lw=1, label="target 0.95x")
ax.axhline(1.0, color="grey", lw=0.5)
ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes)
ax.set_ylabel("speed vs BF16 keys (x)")
ax.set_ylim(0.6, 1.1)
ax.set_title("Prefill scorer, H200: keys decoded once per call from 4096 groups")
ax.legend(fontsize=8, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.1))
fig.tight_layout()
for ext in ("png", "svg"):
    fig.savefig(here / f"ab_final.{ext}", dpi=150)
