"""No import cycle between the modules of the fsdpx package.

The graph is static: every module under fsdpx/ is parsed with `ast`, and an edge A -> B is
an `import fsdpx.B` / `from fsdpx.B import ...` / `from fsdpx import B` (relative imports
resolved) executed when A is imported: module-level statements, including those inside
module-level `try`/`if` blocks. Not counted:

- imports inside functions and methods (they run later, when the module is complete: the
  usual way to break a load-order cycle on purpose);
- imports under `if TYPE_CHECKING:` (type checkers only).

Importing `fsdpx.a.b` also runs `fsdpx/a/__init__.py`, so an edge to a submodule is also
an edge to each package above it. A cycle is printed as `a -> b -> ... -> a`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import fsdpx

ROOT = Path(fsdpx.__file__).resolve().parent

KNOWN_CYCLES: dict[frozenset[str], str] = {}
"""Cycles that exist and are owned by another change, by their set of modules -> why.
Empty: there are none today."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _load_time_imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """Import statements that run when the module body runs (see the module docstring)."""
    out: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                out += _load_time_imports(node.body)
            out += _load_time_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                out += _load_time_imports(block)
            for handler in node.handlers:
                out += _load_time_imports(handler.body)
        elif isinstance(node, (ast.With, ast.For, ast.While)):
            out += _load_time_imports(node.body)
    return out


def _targets(
    node: ast.Import | ast.ImportFrom, module: str, is_pkg: bool, modules: set[str]
) -> set[str]:
    """The fsdpx modules `node` (in `module`) imports, with the packages above them."""
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module if is_pkg else module.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{base}" if base else package
        names = [base]
        # `from fsdpx.pkg import sub` imports the submodule when there is one.
        names += [f"{base}.{alias.name}" for alias in node.names]
    out: set[str] = set()
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in modules and prefix != module:
                out.add(prefix)
    return out


def import_graph() -> dict[str, set[str]]:
    """fsdpx module -> the fsdpx modules it imports at load time."""
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(files)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        edges: set[str] = set()
        for node in _load_time_imports(tree.body):
            edges |= _targets(node, name, path.name == "__init__.py", modules)
        # A package's own __init__ runs before its submodules: not an edge out of them,
        # and the parent packages of `name` are always loaded first.
        graph[name] = {e for e in edges if not name.startswith(e + ".")}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan), each
    as a path a -> ... -> a."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, comp) for comp in components]


def _cycle_in(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first)."""
    start = min(comp)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle in component {sorted(comp)}")


def test_finder_sees_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_graph_reads_the_package() -> None:
    graph = import_graph()
    # Edges the package is known to have (so an empty or broken parse cannot pass).
    assert "fsdpx.config" in graph["fsdpx.estimate"]
    assert "fsdpx.offload" in graph["fsdpx.sharding"]
    # A function-level import is not a load-time edge: estimate imports measure_memory lazily.
    assert "fsdpx.estimate_measured" not in graph["fsdpx.estimate"]


def test_no_import_cycle_in_fsdpx() -> None:
    cycles = find_cycles(import_graph())
    unknown = [c for c in cycles if frozenset(c) not in KNOWN_CYCLES]
    assert not unknown, "import cycles between fsdpx modules:\n" + "\n".join(
        " -> ".join(c) for c in unknown
    )


def test_importing_every_module_keeps_the_public_functions() -> None:
    """A submodule named like a public function (fsdpx/shard.py once) replaces the
    function as a package attribute once something imports the submodule directly."""
    code = (
        "import importlib, pkgutil, fsdpx\n"
        "for m in pkgutil.walk_packages(fsdpx.__path__, 'fsdpx.'):\n"
        "    if not m.name.startswith('fsdpx.demo.train'):\n"
        "        importlib.import_module(m.name)\n"
        "bad = [n for n in fsdpx.__all__ if type(getattr(fsdpx, n)).__name__ == 'module']\n"
        "print(bad)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
