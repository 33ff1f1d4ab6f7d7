"""kvbridge's modules import one another one way: the import graph has no cycle, and no module
imports from a layer above its own (LAYERS, bottom first).

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


# kvbridge's layers, bottom first. A module may import from its own layer and the layers below it,
# never from one above, whether the import runs or sits under TYPE_CHECKING (an annotation still
# makes the lower layer's contract speak of the upper one). Entries name modules or packages; a
# module belongs to the most specific entry that names it or a package above it, and any other
# top-level module (kvbridge/NAME.py) to the bottom layer.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("basics", ()),  # config, errors, env, layout, block_hash, block_runs, kv_transfer_params, cli_errors, ...
    ("transfer", ("kvbridge.transfer",)),  # bytes and peers
    ("connectors", ("kvbridge.connectors",)),  # the connector contract and its implementations
    ("engine", ("kvbridge.engine",)),  # the reference engine, which drives connectors
    ("front ends", ("kvbridge.serve", "kvbridge.integrations")),  # HTTP serving; vLLM hosting connectors
    ("conformance kit", ("kvbridge.testing",)),  # drives a plugin's connector through the engine (pytest plugin)
    # `import kvbridge` (the public API) and `kvbridge CMD`; `kvbridge demo` runs the public API
    # next to the serve and proxy commands.
    ("commands", ("kvbridge", "kvbridge.cli", "kvbridge.cli_generate", "kvbridge.serve.demo")),
]

# (importing package, imported package): finer rules inside the order above, where a layer may
# know only part of a layer below it.
FORBIDDEN = [
    ("kvbridge.engine", "kvbridge.connectors.nixl"),  # the engine knows the contract, not the connectors
    ("kvbridge.engine", "kvbridge.connectors.offload"),
    ("kvbridge.serve", "kvbridge.connectors.nixl"),  # P/D params are connector-neutral (kv_transfer_params.py)
]


def layer_of(module: str) -> int | None:
    """Index in LAYERS of `module`'s layer; None when no entry names it (a new package: add it)."""
    name = module
    while name:
        for index, (_, members) in enumerate(LAYERS):
            if name in members:
                return index
        parent = name.rpartition(".")[0]
        if parent == "kvbridge":
            is_top_level_module = name == module and (PACKAGE_ROOT / f"{name.rpartition('.')[2]}.py").is_file()
            return 0 if is_top_level_module else None
        name = parent
    return None


def test_every_module_has_a_layer() -> None:
    runtime, _ = import_graph()
    unplaced = sorted(m for m in runtime if layer_of(m) is None)
    assert not unplaced, "modules in no layer of LAYERS (add their package):\n" + "\n".join(unplaced)


def test_no_module_imports_from_a_layer_above_it() -> None:
    runtime, type_only = import_graph()
    broken = []
    for graph, kind in ((runtime, ""), (type_only, " (under TYPE_CHECKING)")):
        for module, targets in sorted(graph.items()):
            for target in sorted(targets):
                here, there = layer_of(module), layer_of(target)
                if here is not None and there is not None and there > here:
                    broken.append(f"{module} ({LAYERS[here][0]}) -> {target} ({LAYERS[there][0]}){kind}")
    assert not broken, f"{len(broken)} import(s) from a layer above:\n" + "\n".join(broken)


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_forbidden_imports_within_the_order() -> None:
    runtime, _ = import_graph()
    broken = [
        f"{module} -> {target}"
        for module, targets in sorted(runtime.items())
        for target in sorted(targets)
        for importer, imported in FORBIDDEN
        if _within(module, importer) and _within(target, imported)
    ]
    assert not broken, "imports against the layering (TYPE_CHECKING imports ignored):\n" + "\n".join(broken)


def test_layer_of() -> None:
    names = [name for name, _ in LAYERS]
    assert names[layer_of("kvbridge.config")] == "basics"
    assert names[layer_of("kvbridge.connectors.nixl.scheduler")] == "connectors"
    assert names[layer_of("kvbridge.cli")] == names[layer_of("kvbridge")] == "commands"
    assert layer_of("kvbridge.no_such_package.module") is None


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
