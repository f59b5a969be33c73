"""The small helpers the workbench notebooks share (device set-up, grids, presets, banners,
stored results, inline figures), and, re-exported from `notebook_run`, how a notebook is run
with papermill: notebooks and tests reach all of it as `qsa.workbench.notebooks`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qsa.workbench.notebook_run import (DEFAULT_KERNEL, NOTEBOOK_DIR, PARAMETERS_TAG,  # noqa: F401
                                        NotebookError, check_kernel, execute_notebook,
                                        notebook_parameters, notebook_path, parameters_cell,
                                        read_notebook)

if TYPE_CHECKING:
    import pandas as pd

    from qsa.measure.device import DeviceInfo
    from qsa.presets import ModelPreset

FUNCTIONAL_NOTE = "functional run - times mean nothing"


# --- helpers used inside the notebooks ---------------------------------------------------------


def prepare_runtime(device: str | None = None) -> DeviceInfo:
    """Pick the device and, without a GPU, switch Triton to its interpreter.

    Call it first, before anything imports `triton.language`: Triton decides interpreted vs
    compiled when a function is decorated, including its own library functions (the combine
    functions of `tl.sum`, ...), so switching later mixes both modes and fails inside kernels.
    device: None (the first visible GPU, else the CPU interpreter), "cpu" or "cuda". To use
    another GPU, set CUDA_VISIBLE_DEVICES (ROCR_VISIBLE_DEVICES on AMD), as sweeps do.
    """
    if device not in (None, "cpu", "cuda"):
        raise NotebookError(f"device must be None, 'cpu' or 'cuda', got {device!r}; select a "
                            "GPU with CUDA_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES")
    import torch

    use_cpu = device == "cpu" or not torch.cuda.is_available()
    if device == "cuda" and use_cpu:
        raise NotebookError("device 'cuda' asked for, but torch sees no GPU")
    if use_cpu and os.environ.get("TRITON_INTERPRET", "0") != "1":
        if "triton.language" in sys.modules:
            raise NotebookError("triton.language was imported before the interpreter was "
                                "switched on; restart the kernel and call prepare_runtime "
                                "before other imports")
        os.environ["TRITON_INTERPRET"] = "1"

    from qsa.measure.device import cpu_device, detect_device  # imports triton.language

    return cpu_device() if use_cpu else detect_device()


def results_root(root: str | Path | None) -> Path:
    """Where a notebook files its runs: `root` as given, or with None the repository's
    `profiles/`, whatever directory the kernel was started in (JupyterLab starts it in
    `notebooks/`, papermill and sweeps wherever they run)."""
    return Path(root) if root is not None else NOTEBOOK_DIR.parent / "profiles"


def grid(profiles: Mapping[str, Mapping[str, Sequence[Any]]], profile: str,
         **overrides: Any) -> dict[str, list[Any]]:
    """The grid of one profile, with explicit parameters replacing its lists.

    An override of None keeps the profile's list; a scalar becomes a one-element list, so a
    sweep spec can hand each point one value of a parameter the notebook otherwise loops over.
    """
    if profile not in profiles:
        raise NotebookError(f"unknown profile {profile!r}; known: {', '.join(profiles)}")
    out = {k: list(v) for k, v in profiles[profile].items()}
    for name, value in overrides.items():
        if value is None:
            continue
        out[name] = list(value) if isinstance(value, (list, tuple)) else [value]
    empty = sorted(k for k, v in out.items() if not v)
    if empty:
        raise NotebookError(f"empty grid dimension(s): {empty}")
    return out


def make_preset(name: str, overrides: Mapping[str, Any] | None = None) -> ModelPreset:
    """A preset by name with validated field overrides. An overridden preset is renamed
    `<name>+<field>=<value>,...` so that its records never pass for the real model's."""
    from qsa.presets import get_preset

    if not overrides:
        return get_preset(name)
    label = ",".join(f"{k}={v}" for k, v in sorted(overrides.items()))
    return get_preset(name, **overrides).replace(name=f"{name}+{label}")


def figures_dir(run_directory: str | Path, override: str | Path | None = None) -> Path:
    """Where a notebook writes its figures: `override`, else `<run dir>/figures`."""
    out = Path(override) if override else Path(run_directory) / "figures"
    out.mkdir(parents=True, exist_ok=True)
    return out


def banner(device: DeviceInfo) -> str:
    """One line saying what the numbers of this run are worth; displayed bold in a notebook."""
    if device.is_gpu:
        text = (f"Device {device.name} ({device.arch}), torch {device.torch_version}, "
                f"triton {device.triton_version}: timed with graph replay on cold caches.")
    else:
        text = (f"CPU, Triton interpreter: {FUNCTIONAL_NOTE.upper()}. This run checks that "
                "every kernel verifies and that the notebook works; set profile = \"gpu\" "
                "on a GPU host for numbers.")
    try:
        from IPython.display import Markdown, display

        display(Markdown(f"**{text}**"))
    except ImportError:
        print(text)
    return text


def load_results(results_root: str | Path = "profiles", sweep_dir: str | Path | None = None,
                 device: str | None = None, kinds: Sequence[str] | None = None,
                 latest_only: bool = True) -> tuple[pd.DataFrame, dict[str, dict[str, Any]]]:
    """Stored results and the run.json of each run: one sweep's passed points, or every
    finished run under `results_root` including the passed points of its sweeps
    (`<root>/<device>/sweeps/<name>`).

    Reads only finished runs, through the results store. With `latest_only`, a point measured
    by several runs keeps the rows of the newest run, so figures show each point once.
    """
    import json

    import pandas as pd

    from qsa.measure.results import RESULTS_FILE, RUN_FILE, load_runs
    from qsa.workbench.compare import latest_per_point
    from qsa.workbench.sweep import load_sweep

    if sweep_dir is not None:
        frames = [load_sweep(sweep_dir)]
        roots = [Path(sweep_dir) / "points"]
    else:
        frames = [load_runs(results_root, device=device)]
        frames += [load_sweep(d) for d in sorted(Path(results_root).glob("*/sweeps/*"))
                   if device in (None, d.parent.parent.name)]
        roots = [Path(results_root)]
    frames = [f for f in frames if not f.empty]
    df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(
        columns=["run_id", "device", "kind"])
    if device is not None and not df.empty:
        df = df[df["device"] == device]
    if kinds is not None and not df.empty:
        df = df[df["kind"].isin(list(kinds))]
    if latest_only and not df.empty:
        df = pd.concat([latest_per_point(part)
                        for _, part in df.groupby(["device", "kind"], sort=True)],
                       ignore_index=True)
    metas: dict[str, dict[str, Any]] = {}
    wanted = set(df["run_id"]) if not df.empty else set()
    for root in roots:
        for run_file in root.rglob(RUN_FILE):
            if run_file.parent.name in wanted and (run_file.parent / RESULTS_FILE).exists():
                metas[run_file.parent.name] = json.loads(run_file.read_text())
    return df.reset_index(drop=True), metas


def show(*results: Any) -> None:
    """Display figures inline from their written PNGs (works under any matplotlib backend)."""
    try:
        from IPython.display import Image, display
    except ImportError:
        return
    for res in results:
        for path in getattr(res, "paths", ()):
            if Path(path).suffix == ".png":
                display(Image(filename=str(path)))
