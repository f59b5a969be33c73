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
# # Block-config tuning: one kernel, one shape, its config space
#
# Pick a kernel and a shape; the tuner (`qsa.workbench.tune`) derives the candidates from the
# config table's current entry (every integer meta-parameter at half, same and double, switches
# such as sparse GQA's `SLOTS` both ways, with the warps/stages the backend takes, AMD's
# `waves_per_eu` on HIP), verifies each against the
# float32 reference and times the ones that pass. The heat map shows the best time over the
# two knobs that vary most; the winner is boxed.
#
# **Trying one config, or a few:** set `config` to the changes you want against the current
# entry (JSON text or a dict, e.g. `{"meta": {"BLOCK_N": 64}, "num_warps": 8}`), or to a list
# of them; the run then times just those and the current entry, side by side in one process
# (`qsa tune OP --candidates` does the same from the command line).
#
# **Keeping the winner:** set `write_winner = True` on a GPU. The last cell writes the fastest
# verified config into `qsa/configs/tables/<kernel>.json` at the table coordinate the kernel
# itself looks up for this shape, with provenance (device, date, versions, µs and the previous
# entry's µs), but only when it beats the current entry beyond the run's noise and again in a
# fresh process (timed alternately with the current entry); otherwise the current entry is
# written back as confirmed. Interpreter timings are never written.
#
# **Interactive, in JupyterLab:** the last section shows one control per config key of the
# current entry (the values the tuner would search), re-verifies and re-times the chosen
# config beside the current entry on every change, and writes it back by the same rules
# (needs the `lab` extra's ipywidgets; papermill runs skip it).
#
# The CPU default tunes a tiny shape over a few candidates under the Triton interpreter: a
# functional check, times mean nothing.

# %% tags=["parameters"]
op = "score_stacked"  # one of qsa.workbench.registry.OPS
preset = "qwen3.8-flash-next"
batch = None  # None: the profile's shape
context = None
rows = None
index_format = "bf16"
kv_format = "bf16"
profile = "cpu-smoke"  # "cpu-smoke": tiny shape, few candidates; "gpu": a real decode shape
max_candidates = None  # None: the profile's (cpu-smoke 4, gpu 48)
config = None  # changes to try against the current entry (JSON, dict or list); None: all
write_winner = False  # True: store the winner in the config table (GPU only)
samples = None  # timing samples per candidate; None: the timing module's default
device = None  # None: first visible GPU, else the CPU interpreter; "cpu" forces it
results_root = None  # None: the repository's profiles/, wherever the kernel runs
figures_dir = None  # None: <run dir>/figures
interactive = None  # None: widgets when opened in JupyterLab (never under papermill)

# %%
import json

from qsa.workbench import notebooks as wb

dev = wb.prepare_runtime(device)
results_root = wb.results_root(results_root)
from qsa.configs import table_path
from qsa.measure.results import load_run, start_run
from qsa.workbench import plots
from qsa.workbench import tune as tuner
from qsa.workbench.registry import find

PROFILES = {
    "cpu-smoke": {"batch": 1, "context": 512, "rows": 4, "max_candidates": 4, "samples": 1},
    "gpu": {"batch": 16, "context": 65536, "rows": 4, "max_candidates": 48, "samples": None},
}
spec = find(op)  # the op's registry entry: its table, schema, kernel and reference
if write_winner and not dev.is_gpu:
    raise ValueError("write_winner needs a GPU: interpreter times mean nothing")
shape = {k: (v if v is not None else PROFILES[profile][k]) for k, v in
         {"batch": batch, "context": context, "rows": rows}.items()}
n_candidates = max_candidates or PROFILES[profile]["max_candidates"]
samples = samples if samples is not None else PROFILES[profile]["samples"]
given = json.loads(config) if isinstance(config, str) else config
tries = None if given is None else (list(given) if isinstance(given, list) else [given])
wb.banner(dev)
print(f"{op}: kernel {spec.entry}, table {spec.table}, reference {spec.reference}, "
      f"tests {spec.test}")
print(op, shape, f"index {index_format}, kv {kv_format}, up to {n_candidates} candidates")

# %%
df = tuner.tune(op, preset=preset, **shape, index_format=index_format, kv_format=kv_format,
                device=None if dev.is_gpu else "cpu", max_candidates=n_candidates,
                samples=samples, progress=False, candidates=tries)
with start_run("config-tuning", root=results_root, device=dev,
               extra={"notebook": "block_config_tuning", "op": op, "shape": shape,
                      "write_winner": write_winner}) as run:
    run.add_many(df.to_dict("records"))
df, meta = load_run(run.directory)
print("results:", run.directory)

# %% [markdown]
# ## Candidates
# `status` is `ok` for verified, timed candidates; anything else names why a candidate was
# skipped (compile error, out of resources, wrong result).

# %%
wide = plots.expand_config(df)
knobs = [c for c in wide.columns if c not in df.columns]
print(f"{(df['status'] == 'ok').sum()} of {len(df)} candidates verified")
display(wide[["candidate", "is_current", "status", "us", *knobs]].round(3))

# %% [markdown]
# ## Ranked, with noise bands
# Fastest first. `p10_us`..`p90_us` is each candidate's spread over its samples; `vs_current`
# is its speedup over the current entry, and `beyond_noise` says whether that speedup is larger
# than this run's noise (`noise_rel`: the current entry timed twice, and the spreads), the rule
# the last cell writes by.

# %%
rank = tuner.ranked(wide)
display(rank[["candidate", "is_current", "us", "p10_us", "p90_us", "vs_current",
              "beyond_noise", "noise_rel", *knobs]].round(3))

# %% [markdown]
# ## Heat map

# %%
out = wb.figures_dir(run.directory, figures_dir)
figs = plots.figures_for(df, "config-tuning", out, [meta])
wb.show(*figs)
print(f"{sum(len(f.paths) for f in figs)} figure files in {out}")

# %% [markdown]
# ## Keeping the winner
# Runs only with `write_winner = True` (GPU timings only).

# %%
if write_winner:
    from qsa.kernels.common import backend_and_arch
    from qsa.presets import as_preset
    from qsa.workbench.ops import Point

    point = Point(op, as_preset(preset), **shape, index_format=index_format,
                  kv_format=kv_format)
    kept = tuner.write_winner(
        df, op, backend_and_arch()[1], str(df["kernel_fmt"].iloc[0]), int(df["bucket"].iloc[0]),
        recheck=lambda cur, win: tuner.recheck_in_fresh_process(point, cur, win, samples))
    print("written to", table_path(spec.table), "at bucket", int(df["bucket"].iloc[0]), ":",
          kept.as_dict())
else:
    print("write_winner is False: the table is unchanged")

# %% [markdown]
# ## Trying configs by hand (JupyterLab)
# One control per config key of the current entry, over the values the tuner searches. Each
# change verifies and times the chosen config beside the current entry (the current entry
# twice, for the run's noise); **write back** applies the tuner's rules: kept only beyond the
# noise and again in a fresh process, else the current entry is confirmed (GPU only).

# %%
from qsa.workbench import interactive as tuning_ui

if interactive is None:
    interactive = tuning_ui.in_jupyterlab()
if interactive:
    from qsa.presets import as_preset
    from qsa.workbench.ops import Point

    session = tuning_ui.start(Point(op, as_preset(preset), **shape, index_format=index_format,
                                    kv_format=kv_format),
                              device=None if dev.is_gpu else "cpu", samples=samples)
    display(tuning_ui.widgets(session))
else:
    print("interactive tuning: open this notebook in JupyterLab (the lab extra)")
