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
# # Per-step breakdown: where a decode step's QSA time goes
#
# One decode step of the model with MTP runs, per request, the target's 12 QSA layers on the
# verify rows (1 + draft tokens) and the draft layer once per draft token on one row. For each
# QSA kernel this notebook measures µs per call (verified, then timed) and multiplies by its
# calls per step; the stacked bars show which kernel to work on next.
#
# On a GPU the whole step is also captured once as a graph and replayed (`graph replay`): the
# difference to the sum of the kernels is the gaps between launches that a server sees.
#
# **Run on a GPU:** set `profile = "gpu"`. The CPU default is a functional check under the
# Triton interpreter on the 2-way tensor-parallel preset with a top-k of 32 groups; its times
# mean nothing.

# %% tags=["parameters"]
profile = "cpu-smoke"  # "cpu-smoke": a CPU functional check; "gpu": the design-review grid
batch = None  # an int or a list; None: the profile's
context = None
index_format = None
preset = None  # None: the profile's preset
preset_overrides = None  # preset fields to change; None: the profile's (cpu-smoke: top-k 32)
kv_format = "bf16"
mtp = 3  # draft tokens per step (a verify has mtp + 1 rows)
overlap = 0.0  # target mean Jaccard of neighbouring rows' selections (0: independent rows)
device = None  # None: first visible GPU, else the CPU interpreter; "cpu" forces it
results_root = None  # None: the repository's profiles/, wherever the kernel runs
figures_dir = None  # None: <run dir>/figures

# %%
from itertools import product


from qsa.workbench import notebooks as wb

dev = wb.prepare_runtime(device)
results_root = wb.results_root(results_root)
from qsa.measure.results import load_run, start_run
from qsa.workbench import plots
from qsa.workbench.step import step_breakdown, step_total

OVERRIDES = {"cpu-smoke": {"topk_groups": 32}, "gpu": {}}
GRIDS = {
    "cpu-smoke": {"batch": [1], "context": [256], "index_format": ["bf16"],
                  "preset": ["qwen3.8-flash-next-tp2"]},
    "gpu": {"batch": [1, 8, 32, 64], "context": [32768, 131072],
            "index_format": ["bf16", "fp8", "mxfp4"], "preset": ["qwen3.8-flash-next"]},
}
g = wb.grid(GRIDS, profile, batch=batch, context=context, index_format=index_format,
            preset=preset)
overrides = OVERRIDES[profile] if preset_overrides is None else preset_overrides
samples = None if dev.is_gpu else 1  # interpreter times mean nothing: spend no time on them
wb.banner(dev)
print(g, "mtp:", mtp)

# %%
run = start_run("step-breakdown", root=results_root, device=dev,
                extra={"notebook": "step_breakdown", "profile": profile, "grid": g, "mtp": mtp})
with run:
    for name, fmt, b, c in product(g["preset"], g["index_format"], g["batch"], g["context"]):
        p = wb.make_preset(name, overrides)
        steps = step_breakdown(p, b, c, mtp=mtp, index_format=fmt, kv_format=kv_format,
                               device=None if dev.is_gpu else "cpu", samples=samples,
                               overlap=overlap)
        for rec in steps.to_dict("records"):
            run.add({**rec, "preset": p.name, "batch": b, "context": c, "index_format": fmt,
                     "kv_format": kv_format, "mtp": mtp, "overlap_target": overlap})
        total = step_total(steps)
        print(f"{p.name} {fmt:6s} batch {b:3d} context {c:7d}: {total:12.2f} µs per step "
              "(sum of kernels)")
        run.flush()
df, meta = load_run(run.directory)
print("results:", run.directory)

# %% [markdown]
# ## Results table
# µs per step by phase and kernel (target: the QSA layers on the verify rows; draft: the MTP
# layer on one row), then the sum and, on a GPU, the graph replay of the whole step.

# %%
df.pivot_table(index=["phase", "kernel"], columns=["index_format", "batch", "context"],
               values="us_per_step", sort=False).round(3)

# %% [markdown]
# ## Figures

# %%
out = wb.figures_dir(run.directory, figures_dir)
figs = plots.figures_for(df, "step-breakdown", out, [meta])
wb.show(*figs)
print(f"{sum(len(f.paths) for f in figs)} figure files in {out}")
