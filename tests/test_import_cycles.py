"""No import cycles: every module imports on its own, and the import graph, read from the
sources, has no cycle but the known ones.

A cycle works only in the order its modules happen to be imported in (or through an import
hidden in a function), and breaks the day a new caller imports the other end first. The graph
has an edge for every import that runs, at module level or in a function: those under
`if TYPE_CHECKING:` never do, so they are left out.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvctl"

KNOWN_CYCLES: set[frozenset[str]] = set()
"""None: every module imports one way."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: all but those in `if TYPE_CHECKING:` blocks."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child.test):
                for other in child.orelse:
                    visit(other)
                continue
            visit(child)

    visit(tree)
    return found


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """`name`, or the closest package of it that is one of ours."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (`from package import module` counts as the
    module; `from module import name` as the module)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, *([node.module] if node.module else [])])
                targets = [f"{base}.{alias.name}" for alias in node.names] or [base]
            for target in targets:
                known = _known(target, modules)
                if known is not None and known != name:
                    edges.add(known)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_every_module_imports_in_a_fresh_interpreter() -> None:
    script = (
        "import importlib, pkgutil, kvctl\n"
        "for m in pkgutil.walk_packages(kvctl.__path__, 'kvctl.'):\n"
        "    if not m.name.endswith('__main__'):\n"
        "        importlib.import_module(m.name)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def test_the_graph_sees_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [frozenset({"a", "b", "c"})]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_type_only_imports_are_no_edge() -> None:
    modules = sources()
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import kvctl.api\n"
        "def f():\n    import kvctl.units\n"
    )
    names = [alias.name for node in _imports(tree) for alias in node.names]
    assert names == ["TYPE_CHECKING", "kvctl.units"]
    assert (
        _known("kvctl.agent.http.routes.pools.pool_of", modules) == "kvctl.agent.http.routes.pools"
    )


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(sources())


def test_server_and_routes_import_one_way(graph) -> None:
    routes = {name for name in graph if name.startswith("kvctl.agent.http.routes")}
    assert routes & graph["kvctl.agent.http.server"], "the server wires the routers"
    for route in routes:
        assert "kvctl.agent.http.server" not in graph[route], f"{route} imports the server"


def test_no_import_cycle_but_the_known_ones(graph) -> None:
    found = set(cycles(graph))
    assert not [c for c in found if any(m.startswith("kvctl.agent.") for m in c)]
    assert found <= KNOWN_CYCLES, sorted(sorted(c) for c in found - KNOWN_CYCLES)
