"""Import boundaries: kernels load without the measurement stack, and every module of `qsa`
imports strictly downward (no import cycle, function-local imports included: a cycle hidden in a
function still makes import order matter and the layers meaningless)."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
KERNELS = sorted(p.stem for p in (ROOT / "qsa" / "kernels").glob("*.py") if p.stem != "__init__")

# module -> imported module -> line of the first such import
Graph = dict[str, dict[str, int]]


def test_no_kernel_module_loads_pandas():
    """Each kernel module imported in turn in one fresh interpreter (one process instead of one
    per module: torch's import is most of the cost); the first whose import brings pandas in
    is named."""
    code = ("import importlib, sys\n"
            f"for k in {KERNELS!r}:\n"
            "    importlib.import_module('qsa.kernels.' + k)\n"
            "    if 'pandas' in sys.modules:\n"
            "        print(k); break\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "", f"qsa.kernels.{out.stdout.strip()} loads pandas"


def package_modules(root: Path, package: str) -> dict[str, Path]:
    """Every module of `package` (a folder under `root`), by dotted name; a package is its
    __init__.py. Folders without an __init__.py (data such as suites/) hold no modules."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if not all((root.joinpath(*parts[:i]) / "__init__.py").is_file()
                   for i in range(1, len(parts))):
            continue
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _prefixes(name: str) -> Iterator[str]:
    parts = name.split(".")
    return (".".join(parts[:i]) for i in range(1, len(parts) + 1))


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
             modules: dict[str, Path]) -> Iterator[tuple[str, bool]]:
    """(module, explicit) for each module of the package an import statement loads. Explicit:
    the module the statement names (its names are used); else a package Python initialises on
    the way to a submodule."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name, True
            yield from ((p, False) for p in _prefixes(alias.name))
        return
    if node.level:  # relative: from the importing module's package, up level - 1 packages
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[:len(parts) - node.level + 1]
        base = ".".join([*parts, *([node.module] if node.module else [])])
    else:
        base = node.module or ""
    yield from ((p, False) for p in _prefixes(base))
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        yield (submodule, True) if submodule in modules else (base, True)


def import_graph(root: Path, package: str) -> Graph:
    """Which module of `package` imports which, from the source (every import statement, at
    top level, in functions or under TYPE_CHECKING; imports by computed name are not seen).

    `import a.b.c` runs a, a.b and a.b.c; but a package the importing module lies in is
    already being initialised when the module runs, so reaching it on the way to a submodule
    is no dependency (else every package whose __init__ imports its own submodules would be a
    false cycle). Naming that package's own contents (`from a import name`) is one."""
    modules = package_modules(root, package)
    graph: Graph = {m: {} for m in modules}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        initialising = set(_prefixes(module))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target, explicit in _targets(node, module, is_package, modules):
                if target in modules and target != module and \
                        (explicit or target not in initialising):
                    graph[module].setdefault(target, node.lineno)
    return graph


def strongly_connected(graph: Graph) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module: the import cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(components)


def cycle_in(graph: Graph, component: list[str]) -> list[str]:
    """One cycle through the component's first module, shortest first (breadth-first)."""
    start, members = component[0], set(component)
    came_from = {start: start}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if w in members and w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{component} is not strongly connected")


def describe_cycles(graph: Graph, modules: dict[str, Path], root: Path) -> list[str]:
    """Each cycle as `a -> b (file:line) -> ... -> a`, naming the import that closes each hop."""
    lines = []
    for component in strongly_connected(graph):
        cycle = cycle_in(graph, component)
        hops = [f"{b} ({modules[a].relative_to(root)}:{graph[a][b]})"
                for a, b in zip(cycle, cycle[1:])]
        lines.append(" -> ".join([cycle[0], *hops]) +
                     (f"  [cycle among {', '.join(component)}]" if len(component) > 2 else ""))
    return lines


def test_qsa_imports_strictly_downward():
    graph = import_graph(ROOT, "qsa")
    assert "qsa.kernels" in graph and "qsa.workbench.sweep" in graph  # the walk found the tree
    cycles = describe_cycles(graph, package_modules(ROOT, "qsa"), ROOT)
    assert not cycles, "import cycles in qsa (move the shared part down a layer):\n" + \
        "\n".join(cycles)


def _write_package(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_the_cycle_finder_names_a_cycle_hidden_in_a_function(tmp_path: Path) -> None:
    _write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/low/__init__.py": "from pkg.low.base import helper\n",
        "pkg/low/base.py": "def helper():\n    from ..high import run\n    return run\n",
        "pkg/high.py": "import pkg.low.base\n\ndef run():\n    return pkg.low.base\n",
        "pkg/leaf.py": "from pkg import high\n",
    })
    graph = import_graph(tmp_path, "pkg")
    assert strongly_connected(graph) == [["pkg.high", "pkg.low", "pkg.low.base"]]
    [line] = describe_cycles(graph, package_modules(tmp_path, "pkg"), tmp_path)
    assert line == ("pkg.high -> pkg.low.base (pkg/high.py:1) -> pkg.high (pkg/low/base.py:2)"
                    "  [cycle among pkg.high, pkg.low, pkg.low.base]")


def test_a_package_importing_its_own_submodules_is_no_cycle(tmp_path: Path) -> None:
    """An __init__ that re-exports its submodules, submodules that import each other by
    absolute or relative name, and a data folder without __init__.py: all downward."""
    _write_package(tmp_path, {
        "pkg/__init__.py": "from pkg.a import f\nfrom . import b\n",
        "pkg/a.py": "from pkg.b import g\nimport pkg.sub.c\n\ndef f():\n    return g\n",
        "pkg/b.py": "def g():\n    from .sub import c\n    return c\n",
        "pkg/sub/__init__.py": "from pkg.sub.c import h\n",
        "pkg/sub/c.py": "from pkg.sub import d\n\ndef h():\n    return d\n",
        "pkg/sub/d.py": "",
        "pkg/data/script.py": "import pkg\n",
    })
    graph = import_graph(tmp_path, "pkg")
    assert "pkg.data.script" not in graph
    assert graph["pkg.sub.c"] == {"pkg.sub.d": 1}  # its own package: initialised already
    assert set(graph["pkg.b"]) == {"pkg.sub", "pkg.sub.c"}
    assert strongly_connected(graph) == []


def test_naming_a_packages_own_contents_from_its_submodule_is_an_edge(tmp_path: Path) -> None:
    """`from pkg import name` in pkg.a while pkg/__init__.py imports pkg.a: whichever is
    imported first finds the other half-initialised."""
    _write_package(tmp_path, {
        "pkg/__init__.py": "from pkg.a import f\nNAME = 1\n",
        "pkg/a.py": "def f():\n    from pkg import NAME\n    return NAME\n",
    })
    assert strongly_connected(import_graph(tmp_path, "pkg")) == [["pkg", "pkg.a"]]
