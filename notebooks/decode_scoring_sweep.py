# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: -jupytext.text_representation.jupytext_version,-jupytext.text_representation.format_version
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Decode scoring: row-wise vs stacked scorer
#
# The indexer scores every compressed key of a request for each query row. The **row-wise**
# scorer reads the request's keys once per row; the **stacked** scorer stacks a request's rows x
# index heads into one MMA operand and reads the keys once per verify step (4 rows x 4 heads =
# M 16). This notebook measures both over batch x context x index format x rows per request,
# each point verified against the float32 reference before it is timed.
#
# **Run on a GPU:** set `profile = "gpu"` (batch 1-64 x context 8K-128K x BF16/FP8/MXFP4).
# The CPU default runs tiny shapes under the Triton interpreter: it proves the kernels verify
# and the notebook works; its times mean nothing.
#
# Results go to the results store (`<results_root>/<device>/<run id>/results.parquet`),
# figures to `<run dir>/figures/` as PNG and SVG.

# %% tags=["parameters"]
profile = "cpu-smoke"  # "cpu-smoke": seconds on a CPU; "gpu": the full design-review grid
# Each of these replaces the profile's list (an int/str or a list); None keeps the profile's.
batch = None
context = None
index_format = None
rows = None  # query rows per request: 1 for plain decode, 4 for an MTP-3 verify
preset = "qwen3.8-flash-next"
kv_format = "bf16"
scorers = ["score_rowwise", "score_stacked"]
env = {}  # environment toggles for every measured call, e.g. {"QSA_STACKED_DECODE_SCORER": "0"}
samples = None  # timing samples per point; None: the timing module's default
device = None  # None: first visible GPU, else the CPU interpreter; "cpu" forces the interpreter
results_root = None  # None: the repository's profiles/, wherever the kernel runs
figures_dir = None  # None: <run dir>/figures

# %%
from itertools import product

from qsa.workbench import notebooks as wb

dev = wb.prepare_runtime(device)  # before any kernel import: picks interpreter or GPU
results_root = wb.results_root(results_root)
from qsa.measure.results import load_run, start_run
from qsa.workbench import ops, plots

GRIDS = {
    "cpu-smoke": {"batch": [1, 2], "context": [256, 512], "index_format": ["bf16", "fp8"],
                  "rows": [4]},
    "gpu": {"batch": [1, 2, 4, 8, 16, 32, 64],
            "context": [8192, 16384, 32768, 65536, 131072],
            "index_format": ["bf16", "fp8", "mxfp4"], "rows": [4]},
}
g = wb.grid(GRIDS, profile, batch=batch, context=context, index_format=index_format, rows=rows)
if samples is None and not dev.is_gpu:
    samples = 1  # interpreter times mean nothing: spend no time on them
wb.banner(dev)
print(g, "scorers:", scorers)

# %% [markdown]
# ## Measure
# Every point: build inputs with `qsa.cases`, run the kernel on poisoned outputs, compare with
# the float32 reference, then time it (cold cache: rotated input copies; graph replay on GPU).

# %%
run = start_run("decode-scoring", root=results_root, device=dev,
                extra={"notebook": "decode_scoring_sweep", "profile": profile, "grid": g,
                       "scorers": list(scorers), "env": dict(env)})
with run:
    for fmt, r, b, c in product(g["index_format"], g["rows"], g["batch"], g["context"]):
        for op in scorers:
            rec = ops.measure(op, preset=preset, batch=b, context=c, rows=r, index_format=fmt,
                              kv_format=kv_format, env=env or None, samples=samples,
                              device=None if dev.is_gpu else "cpu")
            run.add(rec)
            print(f"{fmt:6s} rows {r} batch {b:3d} context {c:7d} {op:14s} "
                  f"{rec['us']:10.2f} µs")
        run.flush()  # a crash later keeps what was measured
df, meta = load_run(run.directory)
print("results:", run.directory)

# %% [markdown]
# ## Results table
# Median µs per call; `speedup` = row-wise / stacked (> 1: the stacked scorer is faster).

# %%
table = df.pivot_table(index=["index_format", "rows", "batch", "context"], columns="op",
                       values="us")
if {"score_rowwise", "score_stacked"} <= set(table.columns):
    table["speedup"] = table["score_rowwise"] / table["score_stacked"]
table.round(3)

# %% [markdown]
# ## Figures
# Latency vs context per batch, the stacked-over-row-wise speedup heat map (cells within the
# measured noise are marked ≈), and the share of the measured copy bandwidth / matrix rate.

# %%
out = wb.figures_dir(run.directory, figures_dir)
figs = plots.figures_for(df, "decode-scoring", out, [meta])
wb.show(*figs)
print(f"{sum(len(f.paths) for f in figs)} figure files in {out}")
