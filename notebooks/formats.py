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
# # Cache formats: capacity, attention error, top-k recall
#
# What FP8 and MXFP4 buy and cost, from the reference code alone (no kernel timings, so the
# numbers are the same on any device):
#
# 1. **Capacity**: tokens per GiB of KV pool for each K/V x index-cache format, sized exactly as
#    the arena sizes its pages (`qsa.arena.capacity`).
# 2. **Attention error**: sparse GQA output with FP8 K/V against BF16 K/V, on the same inputs and
#    the same token selection (`qsa.reference`), for each FP8 flavour (OCP e4m3fn: H200, MI355X;
#    e4m3fnuz: MI300X).
# 3. **Top-k recall**: the groups selected from FP8 and MXFP4 index keys against those selected
#    from BF16 keys, on realistic keys (`qsa.cases`: outlier channels, log-normal magnitudes).
#    `recall` is the overlap of the selected sets; `mass_recall` the share of the BF16 top-k
#    score mass that the quantized selection keeps (ties at score 0 make set overlap pessimistic).
#
# **Larger shapes:** set `profile = "gpu"` (runs the same reference code on the GPU if there is
# one, else on the CPU, slower).

# %% tags=["parameters"]
profile = "cpu-smoke"  # "cpu-smoke": small contexts, seconds; "gpu": 8K-128K contexts
context = None  # contexts of the error and recall studies (an int or a list)
batch = None
rows = None  # query rows per request
preset = "qwen3.8-flash-next"
capacity_presets = ["qwen3.8-flash-next", "qwen3.8-flash-next-tp2"]
capacity_gib = 64.0
fp8_dtypes = ["float8_e4m3fn", "float8_e4m3fnuz"]
index_formats = ["fp8", "mxfp4"]  # compared against bf16 for recall
seed = 0
device = None  # None: first visible GPU, else CPU; "cpu" forces it
results_root = None  # None: the repository's profiles/, wherever the kernel runs
figures_dir = None  # None: <run dir>/figures

# %%
from itertools import product

import torch

from qsa.workbench import notebooks as wb

dev = wb.prepare_runtime(device)
results_root = wb.results_root(results_root)
from qsa.arena.capacity import capacity_frame
from qsa.cases import CaseSpec, make_case
from qsa.measure.results import load_run, start_run
from qsa.presets import get_preset
from qsa.reference import (score_reference, select_reference, sparse_gqa_reference,
                           topk_expand_reference, visible_groups)
from qsa.workbench import plots

GRIDS = {
    "cpu-smoke": {"context": [1024, 4096], "batch": [1], "rows": [4]},
    "gpu": {"context": [8192, 32768, 131072], "batch": [4], "rows": [4]},
}
g = wb.grid(GRIDS, profile, context=context, batch=batch, rows=rows)
torch_device = "cuda" if dev.is_gpu else "cpu"
p = get_preset(preset)
wb.banner(dev)
print(g)


def figures(run_dir, kind):
    df, meta = load_run(run_dir)
    out = wb.figures_dir(run_dir, figures_dir and f"{figures_dir}/{kind}")
    figs = plots.figures_for(df, kind, out, [meta])
    wb.show(*figs)
    return df


# %% [markdown]
# ## 1. Capacity: tokens per GiB of pool

# %%
cap = capacity_frame(capacity_presets, capacity_gib)
cap["tokens_per_gib"] = cap["tokens"] / cap["gib"]
with start_run("formats-capacity", root=results_root, device=dev,
               extra={"notebook": "formats", "gib": capacity_gib}) as run:
    run.add_many(cap.to_dict("records"))
figures(run.directory, "formats-capacity")
cap[cap["draft"] == "bf16"].pivot_table(index=["preset", "kv"], columns="index",
                                        values=["tokens_per_gib", "ratio_vs_bf16"]).round(3)

# %% [markdown]
# ## 2. Attention error: FP8 K/V against BF16 K/V
# Same seed, so both caches hold the same activations; the token selection comes from the BF16
# case and is shared, so the difference is the K/V format alone. Error per row:
# `||out_fp8 - out_bf16|| / ||out_bf16||`.


# %%
def attention_errors(b, c, r):
    """One record per FP8 flavour; the BF16 case, its selection and output are shared."""
    spec = dict(index_format="bf16", seed=seed)
    ref = make_case(CaseSpec.decode(p, b, c, r, kv_format="bf16", **spec), torch_device)
    scores = score_reference(ref.cache, ref.batch, ref.q_index, p, "bf16")
    ids = topk_expand_reference(scores, ref.batch, p)
    want = sparse_gqa_reference(ref.q, ref.cache, ref.batch, ids, "bf16", p.softmax_scale)
    for name in fp8_dtypes:
        fp8 = make_case(CaseSpec.decode(p, b, c, r, kv_format="fp8",
                                        fp8_dtype=getattr(torch, name), **spec), torch_device)
        got = sparse_gqa_reference(fp8.q, fp8.cache, fp8.batch, ids, "fp8", p.softmax_scale)
        rel = ((got - want).flatten(1).norm(dim=1) / want.flatten(1).norm(dim=1)).cpu()
        yield {"preset": p.name, "batch": b, "context": c, "rows": r, "fp8_dtype": name,
               "selected_tokens": int((ids >= 0).sum(1).float().mean()),
               "rel_err_mean": float(rel.mean()), "rel_err_min": float(rel.min()),
               "rel_err_max": float(rel.max()), "max_abs_err": float((got - want).abs().max())}


with start_run("formats-attention-error", root=results_root, device=dev,
               extra={"notebook": "formats", "grid": g, "seed": seed}) as run:
    for b, c, r in product(g["batch"], g["context"], g["rows"]):
        for rec in attention_errors(b, c, r):
            run.add(rec)
            print(f"{rec['fp8_dtype']:16s} context {c:7d}: relative error "
                  f"{rec['rel_err_mean']:.4f} (max {rec['rel_err_max']:.4f})")
figures(run.directory, "formats-attention-error")

# %% [markdown]
# ## 3. Top-k recall of quantized index keys
# Selections of the same rows from each format's compressed keys; with `visible <= 512` groups
# every group is selected and recall is 1 by construction.


# %%
def topk_recalls(b, c, r):
    """One record per quantized index format, against the shared BF16 selection."""
    spec = dict(kv_format="bf16", seed=seed, build_kv=False)
    ref = make_case(CaseSpec.decode(p, b, c, r, index_format="bf16", **spec), torch_device)
    s_ref = score_reference(ref.cache, ref.batch, ref.q_index, p, "bf16")
    vis = visible_groups(ref.batch)
    sel_ref, counts = select_reference(s_ref, vis, p.topk_groups)
    for fmt in index_formats:
        qnt = make_case(CaseSpec.decode(p, b, c, r, index_format=fmt, **spec), torch_device)
        s_qnt = score_reference(qnt.cache, qnt.batch, qnt.q_index, p, fmt)
        sel_qnt, _ = select_reference(s_qnt, vis, p.topk_groups)
        recall, mass = [], []
        for i in range(sel_ref.shape[0]):
            n = int(counts[i])
            a, q = sel_ref[i, :n].long(), sel_qnt[i, :n].long()
            recall.append(len(set(a.tolist()) & set(q.tolist())) / max(n, 1))
            total = float(s_ref[i, a].sum())
            mass.append(float(s_ref[i, q].sum()) / total if total > 0 else 1.0)
        recall, mass = torch.tensor(recall), torch.tensor(mass)
        yield {"preset": p.name, "batch": b, "context": c, "rows": r, "index_format": fmt,
               "visible_groups_mean": float(vis.float().mean()), "topk_groups": p.topk_groups,
               "recall_mean": float(recall.mean()), "recall_min": float(recall.min()),
               "recall_max": float(recall.max()), "mass_recall_mean": float(mass.mean()),
               "mass_recall_min": float(mass.min())}


with start_run("formats-topk-recall", root=results_root, device=dev,
               extra={"notebook": "formats", "grid": g, "seed": seed}) as run:
    for b, c, r in product(g["batch"], g["context"], g["rows"]):
        for rec in topk_recalls(b, c, r):
            run.add(rec)
            print(f"{rec['index_format']:6s} context {c:7d}: recall {rec['recall_mean']:.4f} "
                  f"(min {rec['recall_min']:.4f}), score-mass recall "
                  f"{rec['mass_recall_mean']:.4f}")
recall = figures(run.directory, "formats-topk-recall")
recall[["index_format", "context", "recall_mean", "recall_min", "mass_recall_mean",
        "mass_recall_min"]].round(4)
