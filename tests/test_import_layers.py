"""Import boundaries: kernels load without the measurement stack, and the measurement and
workbench modules named in review import one way only (a cycle makes import order matter)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNELS = sorted(p.stem for p in (ROOT / "qsa" / "kernels").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_kernel_module_does_not_load_pandas(kernel):
    code = f"import sys, qsa.kernels.{kernel}; print('pandas' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def _qsa_imports(module: str) -> set[str]:
    """Every qsa module a module imports, at top level or inside functions."""
    tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("qsa"):
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("qsa"))
    return names


@pytest.mark.parametrize("a,b", [("qsa.measure.device", "qsa.measure.results"),
                                 ("qsa.workbench.notebooks", "qsa.workbench.sweep"),
                                 ("qsa.arena.offload", "qsa.arena.page_file")])
def test_no_import_cycle(a, b):
    assert not (b in _qsa_imports(a) and a in _qsa_imports(b)), f"{a} and {b} import each other"
