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
# # Prefill: scorer and sparse GQA over rows x context
#
# A prefill chunk has many query rows per request. The prefill scorer shares each key tile
# across the chunk's rows on the matrix cores (causal tile skipping), and sparse GQA runs
# unsplit with a throughput-sized config. This notebook measures both over chunk rows x
# context, verified against the float32 reference before timing.
#
# The last section rolls a chunk up through every QSA layer of the model (the decode step's
# view, `qsa step --phase prefill`): µs per kernel per chunk, summed and graph-replayed.
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
rollup_rows = None  # chunk rows of the per-chunk roll-up; None: the grid's largest per context
mtp = None  # MTP draft depth of the roll-up (the draft layer runs over the chunk); None: preset's
samples = None  # timing samples per point; None: the timing module's default
device = None  # None: first visible GPU, else the CPU interpreter; "cpu" forces it
results_root = None  # None: the repository's profiles/, wherever the kernel runs
figures_dir = None  # None: <run dir>/figures

# %%
from itertools import product

from qsa.workbench import notebooks as wb

dev = wb.prepare_runtime(device)
results_root = wb.results_root(results_root)
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

# %% [markdown]
# ## One chunk through every QSA layer
# The chunk's kernels as the model runs them: per QSA layer compress, K/V store, prefill
# scorer, top-k + expand and sparse GQA prefill on the chunk's rows (target), and with MTP the
# draft layer once over the same rows. µs per chunk, summed and, on a GPU, as one replayed
# graph.

# %%
from qsa.workbench.step import step_breakdown, step_total

step_run = start_run("prefill-step", root=results_root, device=dev,
                     extra={"notebook": "prefill_sweep", "profile": profile, "grid": g,
                            "mtp": mtp})
with step_run:
    for name, c in product(g["preset"], g["context"]):
        p = wb.make_preset(name, overrides)
        fits = [r for r in g["rows"] if r <= c]
        chunk = rollup_rows if rollup_rows is not None else max(fits, default=None)
        if chunk is None:
            continue
        steps = step_breakdown(p, batch, c, mtp=mtp, index_format=index_format,
                               kv_format=kv_format, device=None if dev.is_gpu else "cpu",
                               samples=samples, phase="prefill", rows=chunk)
        for rec in steps.to_dict("records"):
            step_run.add({**rec, "preset": p.name, "batch": batch, "context": c,
                          "chunk_rows": chunk, "index_format": index_format,
                          "kv_format": kv_format, "mtp": mtp})
        total = step_total(steps)
        print(f"{p.name} context {c:7d} chunk {chunk:5d} rows: {total:12.2f} µs per chunk "
              "(sum of kernels)")
        step_run.flush()
sdf, smeta = load_run(step_run.directory)
print("results:", step_run.directory)
sdf.pivot_table(index=["phase", "kernel"], columns=["context", "chunk_rows"],
                values="us_per_step", sort=False).round(3)

# %%
sout = wb.figures_dir(step_run.directory, figures_dir)
sfigs = plots.figures_for(sdf, "prefill-step", sout, [smeta])
wb.show(*sfigs)
print(f"{sum(len(f.paths) for f in sfigs)} figure files in {sout}")
