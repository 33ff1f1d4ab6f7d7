"""kvbridge's modules import one another one way: the import graph has no cycle.

A cycle between two modules means neither can be read, tested or replaced without the other; it
usually shows a type or a decision living on the wrong side of a layer. The graph is read from the
source with `ast`, so nothing is imported (the vLLM integration's modules need vLLM to import).

Every import counts, at module level or inside a function (a deferred import still ties the two
modules together), except imports under `if TYPE_CHECKING:`: annotations only, never executed.
An import names the most specific kvbridge module it reaches: `from kvbridge.engine import outputs`
is an edge to `kvbridge.engine.outputs`, `from kvbridge.engine.outputs import X` one to
`kvbridge.engine.outputs`.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "kvbridge"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _ImportCollector(ast.NodeVisitor):
    """Imported names of one module, split into executed imports and TYPE_CHECKING-only ones."""

    def __init__(self, module: str, is_package: bool) -> None:
        self.package = module if is_package else module.rpartition(".")[0]
        self.runtime: set[str] = set()
        self.type_only: set[str] = set()
        self._type_checking_depth = 0

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            self._type_checking_depth += 1
            for child in node.body:
                self.visit(child)
            self._type_checking_depth -= 1
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def _add(self, names: list[str]) -> None:
        (self.type_only if self._type_checking_depth else self.runtime).update(names)

    def visit_Import(self, node: ast.Import) -> None:
        self._add([alias.name for alias in node.names])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package.split(".")
            base = base[: len(base) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        # `from pkg import name` imports the submodule pkg.name if there is one, else a name of pkg:
        # `_resolve` walks up to the module that exists.
        self._add([prefix if alias.name == "*" else f"{prefix}.{alias.name}" for alias in node.names])


def _resolve(name: str, modules: set[str]) -> str | None:
    """The most specific kvbridge module `name` reaches, or None outside kvbridge."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(executed edges, TYPE_CHECKING-only edges), module -> kvbridge modules it imports."""
    paths = sorted(PACKAGE_ROOT.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    runtime: dict[str, set[str]] = {}
    type_only: dict[str, set[str]] = {}
    for path in paths:
        module = module_name(path)
        collector = _ImportCollector(module, path.name == "__init__.py")
        collector.visit(ast.parse(path.read_text(), str(path)))
        for names, graph in ((collector.runtime, runtime), (collector.type_only, type_only)):
            targets = {_resolve(n, modules) for n in names}
            graph[module] = {t for t in targets if t is not None and t != module}
        type_only[module] -= runtime[module]
    return runtime, type_only


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan), as a path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [_cycle_in(component, graph) for component in components]


def _cycle_in(component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first), ending where it starts."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & component):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return path[::-1] + [start]
                if nxt not in parents:
                    parents[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no cycle through {start} in its component")


def test_import_graph_has_no_cycle() -> None:
    runtime, _ = import_graph()
    cycles = find_cycles(runtime)
    described = "\n".join(" -> ".join(cycle) for cycle in cycles)
    assert not cycles, f"kvbridge has {len(cycles)} import cycle(s) (TYPE_CHECKING imports ignored):\n{described}"


# (importing package, imported package): data flows one way between the layers named here.
FORBIDDEN = [
    ("kvbridge.transfer", "kvbridge.engine"),  # the transport knows bytes and peers, not engines
    ("kvbridge.transfer", "kvbridge.connectors"),
    ("kvbridge.transfer", "kvbridge.serve"),
    ("kvbridge.connectors.base", "kvbridge.engine"),  # the connector contract stands alone
    ("kvbridge.engine", "kvbridge.connectors.nixl"),  # the engine knows the contract, not the connectors
    ("kvbridge.engine", "kvbridge.connectors.offload"),
    ("kvbridge.engine", "kvbridge.serve"),
    ("kvbridge.connectors", "kvbridge.serve"),
    ("kvbridge.serve", "kvbridge.connectors.nixl"),  # P/D params are connector-neutral (kv_transfer_params.py)
]


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_layers_import_one_way() -> None:
    runtime, _ = import_graph()
    broken = [
        f"{module} -> {target}"
        for module, targets in sorted(runtime.items())
        for target in sorted(targets)
        for importer, imported in FORBIDDEN
        if _within(module, importer) and _within(target, imported)
    ]
    assert not broken, "imports against the layering (TYPE_CHECKING imports ignored):\n" + "\n".join(broken)


def test_type_checking_imports_are_kept_apart() -> None:
    """The collector itself: a TYPE_CHECKING import is no edge, a function-level import is one."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "import kvbridge.config\n"
        "if TYPE_CHECKING:\n"
        "    from kvbridge.engine import request\n"
        "def f():\n"
        "    from . import errors\n"
    )
    collector = _ImportCollector("kvbridge.env", is_package=False)
    collector.visit(ast.parse(source))
    assert "kvbridge.config" in collector.runtime and "kvbridge.errors" in collector.runtime
    assert "kvbridge.engine.request" in collector.type_only
    assert "kvbridge.engine.request" not in collector.runtime


def test_find_cycles_reports_a_path() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
