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
# # Sparse GQA decode: BF16 vs FP8 tiles, split count
#
# Each query row attends over its selected tokens (at most 2,048 + 3). At small batch the grid
# (rows x KV heads) is far smaller than the GPU, so the kernel splits the token list across
# programs and merges the partials by log-sum-exp. This notebook measures BF16 and FP8 K/V
# tiles against the split count (`NUM_SPLITS` in the block config; 0 = the kernel's own choice
# from the SM/CU count), each point verified against the float32 reference before timing.
#
# **Run on a GPU:** set `profile = "gpu"`. The CPU default is a functional check under the
# Triton interpreter on the 2-way tensor-parallel preset with a top-k of 32 groups (128
# tokens instead of 2,048, so the interpreter finishes in seconds); its times mean nothing.

# %% tags=["parameters"]
profile = "cpu-smoke"  # "cpu-smoke": a CPU functional check; "gpu": the design-review grid
kv_format = None  # "bf16", "fp8" or a list; None: the profile's
splits = None  # NUM_SPLITS values; 0 means automatic (the production default)
batch = None
context = None
rows = None  # query rows per request (4 for an MTP-3 verify)
preset = None  # None: the profile's preset
preset_overrides = None  # preset fields to change; None: the profile's (cpu-smoke: top-k 32)
index_format = "bf16"
overlap = 0.0  # target mean Jaccard of neighbouring rows' selections (0: independent rows)
samples = None  # timing samples per point; None: the timing module's default
device = None  # None: first visible GPU, else the CPU interpreter; "cpu" forces it
results_root = None  # None: the repository's profiles/, wherever the kernel runs
figures_dir = None  # None: <run dir>/figures

# %%
from itertools import product

from qsa.workbench import notebooks as wb

dev = wb.prepare_runtime(device)
results_root = wb.results_root(results_root)
from qsa.configs import get_config
from qsa.kernels.common import backend_and_arch
from qsa.measure.results import load_run, start_run
from qsa.workbench import ops, plots
from qsa.workbench.registry import find

OP = "sparse_gqa_decode"
OVERRIDES = {"cpu-smoke": {"topk_groups": 32}, "gpu": {}}
GRIDS = {
    "cpu-smoke": {"kv_format": ["bf16", "fp8"], "splits": [0, 2], "batch": [1],
                  "context": [256], "rows": [1], "preset": ["qwen3.8-flash-next-tp2"]},
    "gpu": {"kv_format": ["bf16", "fp8"], "splits": [0, 1, 2, 4, 8, 16], "batch": [1, 4, 16, 64],
            "context": [32768, 131072], "rows": [4], "preset": ["qwen3.8-flash-next"]},
}
g = wb.grid(GRIDS, profile, kv_format=kv_format, splits=splits, batch=batch, context=context,
            rows=rows, preset=preset)
if samples is None and not dev.is_gpu:
    samples = 1
arch = backend_and_arch()[1]
overrides = OVERRIDES[profile] if preset_overrides is None else preset_overrides
wb.banner(dev)
print(g, "arch:", arch)

# %% [markdown]
# ## Measure
# A forced split count is the table's config for this shape with `NUM_SPLITS` replaced, so
# the only difference between two points of a shape is the split.

# %%
run = start_run("sparse-gqa-decode", root=results_root, device=dev,
                extra={"notebook": "sparse_gqa_decode", "profile": profile, "grid": g,
                       "arch": arch})
with run:
    for name, kv, b, c, r in product(g["preset"], g["kv_format"], g["batch"], g["context"],
                                     g["rows"]):
        p = wb.make_preset(name, overrides)
        base = get_config(find(OP).table, arch, kv, b * r).config
        for s in g["splits"]:
            cfg = None if s == 0 else base.with_meta(NUM_SPLITS=s)
            rec = ops.measure(OP, preset=p, batch=b, context=c, rows=r, index_format=index_format,
                              kv_format=kv, config=cfg, samples=samples,
                              device=None if dev.is_gpu else "cpu", overlap=overlap)
            rec["split"] = s
            run.add(rec)
            print(f"{p.name} {kv:5s} batch {b:3d} context {c:7d} rows {r} splits {s or 'auto':>4} "
                  f"{rec['us']:12.2f} µs")
        run.flush()
df, meta = load_run(run.directory)
print("results:", run.directory)

# %% [markdown]
# ## Results table
# Median µs per call by split count (0 = automatic); `fp8/bf16` compares the best split of
# each format.

# %%
shape = ["preset", "kv_format", "batch", "context", "rows"]
table = df.pivot_table(index=shape, columns="split", values="us")
best = df.groupby(shape)["us"].min().unstack("kv_format")
if {"bf16", "fp8"} <= set(best.columns):
    best["fp8/bf16"] = best["fp8"] / best["bf16"]
display(table.round(3))
best.round(3)

# %% [markdown]
# ## Figures

# %%
out = wb.figures_dir(run.directory, figures_dir)
figs = plots.figures_for(df, "sparse-gqa-decode", out, [meta])
wb.show(*figs)
print(f"{sum(len(f.paths) for f in figs)} figure files in {out}")
