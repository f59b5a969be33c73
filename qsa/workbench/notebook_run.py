"""Running a workbench notebook with papermill: finding it, reading its parameters, checking
the Jupyter kernel, executing it.

Notebooks live in git as jupytext percent-format `.py` files, so reviews read diffs, not JSON.
At run time a `.py` notebook is read into a NotebookNode and handed to papermill with an
explicit kernel name: a script carries no kernelspec, and the kernel must be the Python that
has qsa installed. The sweep runner and the notebook helpers both build on this module.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import nbformat
    from papermill.exceptions import PapermillExecutionError

DEFAULT_KERNEL = "python3"
PARAMETERS_TAG = "parameters"
# Where the notebooks are in a source checkout (the package itself does not ship them).
NOTEBOOK_DIR = Path(__file__).resolve().parents[2] / "notebooks"


class NotebookError(ValueError):
    """A notebook or its parameters are not usable as given."""


def lab_command() -> str:
    """The one shell command that opens the notebooks in JupyterLab from this Python's
    environment: installing the `lab` extra first where JupyterLab is missing (the main job's
    set-up installs only `dev`, which keeps it light and able to run from an offline
    wheelhouse without JupyterLab's hundred-odd packages)."""
    root = NOTEBOOK_DIR.parent
    jupyter = Path(sys.executable).with_name("jupyter")
    open_lab = f"{shlex.quote(str(jupyter))} lab {shlex.quote(str(NOTEBOOK_DIR))}"
    if importlib.util.find_spec("jupyterlab") is not None:
        return open_lab
    install = (f"{shlex.quote(sys.executable)} -m pip install -c "
               f"{shlex.quote(str(root / 'constraints.txt'))} -e {shlex.quote(f'{root}[lab]')}")
    return f"{install} && {open_lab}"


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
                     timeout_s: float | None = None, log_output: bool = False,
                     progress: bool = False) -> nbformat.NotebookNode:
    """Execute a notebook with papermill and return the executed NotebookNode.

    Unknown parameter names are an error here (papermill only warns, so a typo in a sweep spec
    would silently measure the defaults). On a failing cell papermill saves the notebook with
    the error and raises `PapermillExecutionError` (ename, evalue, cell_index); that propagates
    (`cell_error` says it in one line). `progress`: papermill's per-cell progress bar on stderr.
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
        progress_bar=progress, log_output=log_output, execution_timeout=timeout_s)


def cell_error(exc: PapermillExecutionError, executed: str | Path) -> str:
    """A failing cell's error in one line, with the executed notebook that shows its
    traceback (papermill's own message repeats the cell's source and the whole traceback)."""
    evalue = " ".join(str(exc.evalue).split())
    return (f"cell [{exc.exec_count}] raised {exc.ename}: {evalue} (traceback in the executed "
            f"notebook {executed})")


def results_lines(nb: nbformat.NotebookNode) -> list[str]:
    """The `results: <run dir>` lines an executed notebook printed (each workbench notebook
    prints one per run it stores), so a caller can say where its results went."""
    return [line.strip() for cell in nb.cells if cell.cell_type == "code"
            for o in cell.get("outputs", []) if o.get("output_type") == "stream"
            for line in str(o.get("text", "")).splitlines() if line.startswith("results:")]
