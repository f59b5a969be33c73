"""Run the workbench notebooks with papermill, and the small helpers the notebooks share.

Notebooks live in git as jupytext percent-format `.py` files, so reviews read diffs, not JSON.
At run time a `.py` notebook is read into a NotebookNode and handed to papermill with an
explicit kernel name: a script carries no kernelspec, and the kernel must be the Python that
has qsa installed.
"""

from __future__ import annotations

import ast
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import nbformat
    import pandas as pd

    from qsa.measure.device import DeviceInfo
    from qsa.presets import ModelPreset

DEFAULT_KERNEL = "python3"
PARAMETERS_TAG = "parameters"
# Where the notebooks are in a source checkout (the package itself does not ship them).
NOTEBOOK_DIR = Path(__file__).resolve().parents[2] / "notebooks"
FUNCTIONAL_NOTE = "functional run - times mean nothing"


class NotebookError(ValueError):
    """A notebook or its parameters are not usable as given."""


def notebook_path(name: str | Path) -> Path:
    """`decode_scoring_sweep` -> notebooks/decode_scoring_sweep.py; existing paths pass through."""
    path = Path(name)
    if path.suffix in (".py", ".ipynb") and path.exists():
        return path
    candidate = NOTEBOOK_DIR / f"{path.stem}.py"
    if candidate.exists():
        return candidate
    raise NotebookError(f"no notebook {str(name)!r} (looked for it as a path and as "
                        f"{candidate})")


def read_notebook(path: str | Path) -> nbformat.NotebookNode:
    """A `.py` (jupytext percent) or `.ipynb` notebook as a NotebookNode (nbformat 4)."""
    path = Path(path)
    if path.suffix == ".ipynb":
        import nbformat

        return nbformat.read(path, as_version=4)
    import jupytext

    return jupytext.read(path)


def parameters_cell(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The one code cell tagged `parameters`; papermill injects its values right after it."""
    cells = [c for c in nb.cells
             if c.cell_type == "code" and PARAMETERS_TAG in c.get("metadata", {}).get("tags", [])]
    if len(cells) != 1:
        raise NotebookError(f"a notebook needs exactly one code cell tagged "
                            f"{PARAMETERS_TAG!r}, found {len(cells)}")
    return cells[0]


def notebook_parameters(nb_or_path: nbformat.NotebookNode | str | Path) -> dict[str, str]:
    """Parameter names of a notebook and the source text of their defaults, in cell order."""
    nb = nb_or_path if not isinstance(nb_or_path, (str, Path)) else read_notebook(nb_or_path)
    source = parameters_cell(nb).source
    out: dict[str, str] = {}
    for node in ast.parse(source).body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        for target in targets:
            if isinstance(target, ast.Name):
                out[target.id] = ast.get_source_segment(source, node.value) or ""
    return out


def check_kernel(kernel_name: str) -> None:
    """Fail early, with the fix, when the Jupyter kernel is missing or runs another Python.

    A `python3` spec installed with `--user` for some other interpreter shadows the venv's own
    and would run the notebook without this qsa (or with another copy of it).
    """
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    fix = (f"install one for this Python with: {sys.executable} -m ipykernel install "
           f"--sys-prefix --name {kernel_name}")
    try:
        spec = KernelSpecManager().get_kernel_spec(kernel_name)
    except NoSuchKernel:
        raise NotebookError(f"no Jupyter kernel named {kernel_name!r}; {fix}") from None
    exe = spec.argv[0] if spec.argv else ""
    if (spec.language.lower() == "python" and os.path.isabs(exe)
            and os.path.realpath(exe) != os.path.realpath(sys.executable)):
        raise NotebookError(f"Jupyter kernel {kernel_name!r} ({spec.resource_dir}) runs {exe}, "
                            f"not this Python ({sys.executable}). Remove or fix that spec, or "
                            f"install one under another name ({sys.executable} -m ipykernel "
                            "install --user --name qsa) and pass kernel_name='qsa' (a sweep "
                            "spec's kernel_name)")


def execute_notebook(path: str | Path, output_path: str | Path | None,
                     parameters: Mapping[str, Any] | None = None, *,
                     kernel_name: str = DEFAULT_KERNEL, cwd: str | Path | None = None,
                     timeout_s: float | None = None, log_output: bool = False
                     ) -> nbformat.NotebookNode:
    """Execute a notebook with papermill and return the executed NotebookNode.

    Unknown parameter names are an error here (papermill only warns, so a typo in a sweep spec
    would silently measure the defaults). On a failing cell papermill saves the notebook with
    the error and raises `PapermillExecutionError` (ename, evalue, cell_index); that propagates.
    """
    import papermill

    nb = read_notebook(path)
    params = dict(parameters or {})
    unknown = sorted(set(params) - set(notebook_parameters(nb)))
    if unknown:
        raise NotebookError(f"{path}: unknown parameters {unknown}; the notebook takes "
                            f"{sorted(notebook_parameters(nb))}")
    check_kernel(kernel_name)
    if output_path is not None:
        Path(output_path).parent.mkdir(parents=True, exist_ok=True)
    return papermill.execute_notebook(
        nb, None if output_path is None else str(output_path), parameters=params,
        kernel_name=kernel_name, language="python", cwd=None if cwd is None else str(cwd),
        progress_bar=False, log_output=log_output, execution_timeout=timeout_s)


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
