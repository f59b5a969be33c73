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
# # Selection overlap: per-row vs shared sparse GQA
#
# Neighbouring query rows of a request select mostly the same groups in the real model
# (consecutive prefill rows share 87-94 % of them, vLLM RFC #55394). Sparse GQA can then read
# each K/V tile once for a block of rows (the shared, tile-union path) instead of once per row.
# Whether that pays depends on the overlap: with independent rows the union of a block is
# nearly `rows` times one row's tokens and the shared path only adds work.
#
# This notebook times sparse GQA decode and prefill on random selections calibrated to a
# target mean Jaccard of neighbouring rows (`qsa.overlap`; each point records the overlap its
# inputs measure), with the per-row path, the shared path and the per-call choice (`auto`, what
# production runs) side by side in one run. The figure marks the break-even overlap; the last
# section shows what the overlap does to a whole decode step.
#
# **Run on a GPU:** set `profile = "gpu"`: decode 32 x 32K with MTP 3 (4 rows per request),
# prefill chunks of 4,096 rows at 16K and 64K, BF16 and FP8 K/V, overlaps 0-0.95. The CPU
# default is a functional check under the Triton interpreter on a shrunken 2-way
# tensor-parallel preset (head dim 64, top-32 groups); its times mean nothing.

# %% tags=["parameters"]
profile = "cpu-smoke"  # "cpu-smoke": a CPU functional check; "gpu": the design-review grid
shapes = None  # [op, batch, context, rows] per sparse GQA shape; None: the profile's
kv_format = None  # "bf16", "fp8" or a list; None: the profile's
overlap = None  # target mean Jaccards of neighbouring rows' selections; None: the profile's
sharing = None  # "per-row", "shared", "auto" or a list; None: all three
preset = None  # None: the profile's preset
preset_overrides = None  # preset fields to change; None: the profile's (cpu-smoke: shrunken)
step_batch = None  # the decode step's requests; None: the profile's
step_context = None
step_formats = None  # INDEX/KV pairs of the step, e.g. ["bf16/bf16", "fp8/fp8"]
step_overlap = None  # overlaps of the step; None: [0, 0.9]
mtp = 3  # draft tokens per step (a verify has mtp + 1 rows)
seed = 0
samples = None  # timing samples per point; None: the timing module's default
device = None  # None: first visible GPU, else the CPU interpreter; "cpu" forces it
results_root = None  # None: the repository's profiles/, wherever the kernel runs
figures_dir = None  # None: <run dir>/figures

# %%
from itertools import product

from qsa.workbench import notebooks as wb

dev = wb.prepare_runtime(device)
results_root = wb.results_root(results_root)
import pandas as pd
from IPython.display import Image

from qsa.measure.results import load_run, start_run
from qsa.overlap import OverlapError
from qsa.workbench import ops, plots
from qsa.workbench.step import step_breakdowns, step_comparison

OVERRIDES = {"cpu-smoke": {"num_q_heads": 4, "head_dim": 64, "index_dim": 64, "rope_dims": 32,
                           "block_size": 16, "topk_groups": 32},
             "gpu": {}}
GRIDS = {
    "cpu-smoke": {"shapes": [["sparse_gqa_decode", 2, 1024, 4],
                             ["sparse_gqa_prefill", 1, 1024, 8]],
                  "kv_format": ["bf16"], "overlap": [0.0, 0.9],
                  "sharing": ["per-row", "shared", "auto"], "preset": ["qwen3.8-flash-next-tp2"],
                  "step_batch": [1], "step_context": [256], "step_formats": ["bf16/bf16"],
                  "step_overlap": [0.0, 0.9]},
    "gpu": {"shapes": [["sparse_gqa_decode", 32, 32768, 4],
                       ["sparse_gqa_prefill", 1, 16384, 4096],
                       ["sparse_gqa_prefill", 1, 65536, 4096]],
            "kv_format": ["bf16", "fp8"], "overlap": [0.0, 0.5, 0.8, 0.9, 0.95],
            "sharing": ["per-row", "shared", "auto"], "preset": ["qwen3.8-flash-next"],
            "step_batch": [32], "step_context": [32768], "step_formats": ["bf16/bf16", "fp8/fp8"],
            "step_overlap": [0.0, 0.9]},
}
if shapes is not None and shapes and not isinstance(shapes[0], (list, tuple)):
    shapes = [shapes]  # one shape given as [op, batch, context, rows]
g = wb.grid(GRIDS, profile, shapes=shapes, kv_format=kv_format, overlap=overlap,
            sharing=sharing, preset=preset, step_batch=step_batch, step_context=step_context,
            step_formats=step_formats, step_overlap=step_overlap)
if samples is None and not dev.is_gpu:
    samples = 1
overrides = OVERRIDES[profile] if preset_overrides is None else preset_overrides
run_on = None if dev.is_gpu else "cpu"
wb.banner(dev)
print(g)

# %% [markdown]
# ## Measure
# Every point draws its selections with the same seed, so at one overlap target the per-row,
# shared and auto points of a shape run on the same inputs; each is verified against the
# float32 reference before it is timed.

# %%
run = start_run("bench", root=results_root, device=dev,
                extra={"notebook": "selection_overlap", "profile": profile, "grid": g,
                       "seed": seed})
with run:
    for name in g["preset"]:
        p = wb.make_preset(name, overrides)
        for (op, b, c, r), kv, target in product(g["shapes"], g["kv_format"], g["overlap"]):
            for s in g["sharing"]:
                try:
                    rec = ops.measure(op, preset=p, batch=b, context=c, rows=r, kv_format=kv,
                                      selection="random", overlap=target, sharing=s,
                                      seed=seed, samples=samples, device=run_on)
                except OverlapError as e:  # a target these selections can not have
                    print(f"{op} b{b} c{c} r{r} {kv} overlap {target:g}: skipped ({e})")
                    break
                run.add(rec)
                print(f"{p.name} {op:18s} b{b:3d} c{c:6d} r{r:5d} {kv:5s} overlap {target:4g} "
                      f"(measured {rec['overlap_measured']:.3f}, union {rec['union_ratio']:.2f}"
                      f" rows) {s:8s} -> {rec['path']:8s} {rec['us']:12.2f} µs")
            run.flush()
df, meta = load_run(run.directory)
print("results:", run.directory)

# %% [markdown]
# ## Results table
# Median µs per call by the path asked for (`auto`: the per-call choice, whose path is
# shown), against the overlap the inputs measure; speedups are over the per-row path.

# %%
KEY = ["preset", "op", "batch", "context", "rows", "kv_format", "overlap_target"]
pts = df[df["verified"].fillna(False).astype(bool)]
us = pts.pivot_table(index=KEY, columns="sharing", values="us")
table = pts.groupby(KEY)[["overlap_measured", "union_ratio"]].first().join(us)
if "auto" in set(pts["sharing"]):
    table = table.join(pts[pts["sharing"] == "auto"].set_index(KEY)["path"].rename("auto path"))
for s in ("shared", "auto"):
    if {"per-row", s} <= set(table.columns):
        table[f"{s} speedup"] = table["per-row"] / table[s]
table.round(3)

# %% [markdown]
# ## Figure
# µs per call against the measured overlap, one panel per shape, a line per path and K/V
# format; the vertical lines mark where the shared path starts to beat the per-row one.

# %%
out = wb.figures_dir(run.directory, figures_dir)
fig = plots.overlap_curves(pts, out, title="Sparse GQA, per-row and shared, against the rows' "
                           "overlap", caption=plots.caption_for(pts, [meta]))
wb.show(fig)
even = [{"op": op, "batch": b, "context": c, "rows": r, "kv_format": kv,
         "break_even_overlap": plots.break_even(part[part["sharing"] != "auto"])}
        for (op, b, c, r, kv), part in pts.groupby(["op", "batch", "context", "rows",
                                                     "kv_format"])]
print(f"{len(fig.paths)} figure files in {out}")
pd.DataFrame(even)

# %% [markdown]
# ## The decode step at independent and model-like overlap
# One decode step (the target's QSA layers on the verify rows, the draft layer once per draft
# token) with its selections at each overlap: the index path's queries are calibrated to it,
# and the target's sparse GQA chooses its path per call.

# %%
pairs = [tuple(x.split("/")) for x in g["step_formats"]]
sb, sc = g["step_batch"][0], g["step_context"][0]
step_run = start_run("step", root=results_root, device=dev,
                     extra={"notebook": "selection_overlap", "profile": profile, "batch": sb,
                            "context": sc, "mtp": mtp, "formats": pairs,
                            "overlaps": g["step_overlap"]})
frames = []
with step_run:
    p = wb.make_preset(g["preset"][0], overrides)
    for steps in step_breakdowns(p, sb, sc, mtp, pairs, overlaps=g["step_overlap"]):
        frames.append(steps)
        step_run.add_many({**r, "preset": p.name, "batch": sb, "context": sc, "mtp": mtp}
                          for r in steps.to_dict("records"))
        total = steps.loc[steps["kernel"] == "sum of kernels", "us_per_step"].iloc[0]
        print(f"{p.name} {steps['index_format'].iloc[0]}/{steps['kv_format'].iloc[0]} overlap "
              f"{steps['overlap_target'].iloc[0]:g}: {total:12.2f} µs per step (sum of kernels)")
sdf, smeta = load_run(step_run.directory)
print("results:", step_run.directory)
sdf.pivot_table(index=["phase", "kernel"], columns=["index_format", "kv_format",
                                                    "overlap_target"],
                values="us_per_step", sort=False).round(3)

# %%
sout = wb.figures_dir(step_run.directory, figures_dir)
cmp = step_comparison(frames, sout / "step_overlap.png",
                      f"{p.name}: decode step, batch {sb} x {sc}, MTP {mtp}, by overlap")
display(Image(filename=str(sout / "step_overlap.png")))
print(f"figures in {sout}")
cmp.round(3)
