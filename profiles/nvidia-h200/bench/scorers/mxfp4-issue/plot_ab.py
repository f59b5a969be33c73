"""Figure of ab_final.jsonl: the stacked scorer, committed kernel and tables against the new ones,
per shape and index format (graph replay, H200). Usage: python3 plot_ab.py (writes ab_final.*)."""
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

here = Path(__file__).parent
rows = [json.loads(x) for x in (here / "ab_final.jsonl").read_text().splitlines()]
rows = [r for r in rows if r["op"] == "score_stacked"]
shapes = sorted({(r["batch"], r["context"], r["rows"]) for r in rows},
                key=lambda s: (-s[0] * s[1], s[2]))
fig, axes = plt.subplots(1, len(shapes), figsize=(3.0 * len(shapes), 3.4))
for ax, (b, ctx, nr) in zip(axes, shapes):
    for i, fmt in enumerate(("bf16", "fp8", "mxfp4")):
        us = {r["variant"]: r["us"] for r in rows
              if (r["batch"], r["context"], r["rows"], r["index_format"]) == (b, ctx, nr, fmt)}
        ax.bar(i - 0.2, us["committed"], 0.4, color="0.7", label="committed" if i == 0 else None)
        ax.bar(i + 0.2, us["new"], 0.4, color="C0", label="new" if i == 0 else None)
        ax.text(i + 0.2, us["new"], f"{us['committed'] / us['new']:.2f}x", ha="center",
                va="bottom", fontsize=7)
    ax.set_xticks(range(3), ["BF16", "FP8", "MXFP4"])
    ax.set_title(f"b{b} x {ctx // 1024}K, {nr} row{'s' if nr > 1 else ''}", fontsize=9)
    ax.set_ylabel("us (graph replay)" if ax is axes[0] else "")
axes[0].legend(fontsize=7)
fig.suptitle("Stacked decode scorer, H200: committed vs new kernel and tables (one run)",
             fontsize=10)
fig.tight_layout()
for ext in ("png", "svg", "pdf"):
    fig.savefig(here / f"ab_final.{ext}", dpi=200)
