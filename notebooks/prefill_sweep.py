# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Prefill: scorer and sparse GQA over rows x context
#
# A prefill chunk has many query rows per request. The prefill scorer shares each key tile
# across the chunk's rows on the matrix cores (causal tile skipping), and sparse GQA runs
# unsplit with a throughput-sized config. This notebook measures both over chunk rows x
# context, verified against the float32 reference before timing.
#
# **Run on a GPU:** set `profile = "gpu"` (chunks of 512-8192 rows at 8K-128K context).
# The CPU default is a functional check under the Triton interpreter (times mean nothing); it
# uses the 2-way tensor-parallel preset (half the heads) with a top-k of 32 groups to stay fast.

# %% tags=["parameters"]
profile = "cpu-smoke"  # "cpu-smoke": a CPU functional check; "gpu": the design-review grid
rows = None  # prefill chunk rows per request (an int or a list); None: the profile's
context = None
preset = None  # None: the profile's preset
preset_overrides = None  # preset fields to change; None: the profile's (cpu-smoke: top-k 32)
batch = 1
index_format = "bf16"
kv_format = "bf16"
prefill_ops = ["score_prefill", "sparse_gqa_prefill"]
samples = None  # timing samples per point; None: the timing module's default
device = None  # None: first visible GPU, else the CPU interpreter; "cpu" forces it
results_root = "profiles"
figures_dir = None  # None: <run dir>/figures

# %%
from itertools import product

from qsa.workbench import notebooks as wb

dev = wb.prepare_runtime(device)
from qsa.measure.results import load_run, start_run
from qsa.workbench import ops, plots

OVERRIDES = {"cpu-smoke": {"topk_groups": 32}, "gpu": {}}
GRIDS = {
    "cpu-smoke": {"rows": [4, 8], "context": [256], "preset": ["qwen3.8-flash-next-tp2"]},
    "gpu": {"rows": [512, 1024, 2048, 4096, 8192], "context": [8192, 32768, 131072],
            "preset": ["qwen3.8-flash-next"]},
}
g = wb.grid(GRIDS, profile, rows=rows, context=context, preset=preset)
if samples is None and not dev.is_gpu:
    samples = 1
overrides = OVERRIDES[profile] if preset_overrides is None else preset_overrides
wb.banner(dev)
print(g, "ops:", prefill_ops)

# %%
run = start_run("prefill", root=results_root, device=dev,
                extra={"notebook": "prefill_sweep", "profile": profile, "grid": g,
                       "ops": list(prefill_ops)})
with run:
    for name, c, r in product(g["preset"], g["context"], g["rows"]):
        p = wb.make_preset(name, overrides)
        if r > c:
            continue  # a chunk can not be longer than its context
        for op in prefill_ops:
            rec = ops.measure(op, preset=p, batch=batch, context=c, rows=r,
                              index_format=index_format, kv_format=kv_format, samples=samples,
                              device=None if dev.is_gpu else "cpu")
            run.add(rec)
            print(f"{p.name} context {c:7d} rows {r:5d} {op:18s} {rec['us']:12.2f} µs")
        run.flush()
df, meta = load_run(run.directory)
print("results:", run.directory)

# %% [markdown]
# ## Results table
# Median µs per call, and µs per query row (what a longer chunk buys).

# %%
df["us_per_row"] = df["us"] / (df["rows"] * df["batch"])
df.pivot_table(index=["preset", "context", "rows"], columns="op",
               values=["us", "us_per_row"]).round(3)

# %% [markdown]
# ## Figures

# %%
out = wb.figures_dir(run.directory, figures_dir)
figs = plots.figures_for(df, "prefill", out, [meta])
wb.show(*figs)
print(f"{sum(len(f.paths) for f in figs)} figure files in {out}")
