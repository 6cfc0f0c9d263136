"""The house's layers: every import points down.

The nodes are the modules directly in ``pdfabric/`` (protocol, config, wire, profile, envs: one node,
``pdfabric``) and each subpackage (``pdfabric.<folder>``). From the bottom up:

    pdfabric (protocol and config)  <  kernels  <  engine  <  kvtransfer  <  worker (what every worker
    kind shares)  <  prefill, decode (the kinds)  <  kinds (their table)  <  router  <  bench  <  cli
    (the command line, the launcher)

Inside the router the rooms point down too: routing < dispatch < platform < front.

A module may import its own node and any node below it, at module level or inside a function (an
import inside a function is still a dependency), and never one above it; the nodes of one layer
(prefill, decode) do not import each other. Nor do modules import each other, directly or round a
circle (a type-only import counts: name the other side through a ``Protocol`` instead).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS: tuple[tuple[str, ...], ...] = (
    ("pdfabric",),
    ("kernels",),
    ("engine",),
    ("kvtransfer",),
    ("worker",),
    ("prefill", "decode"),
    ("kinds",),
    ("router",),
    ("bench",),
    ("cli",),
)
RANK = {node: rank for rank, nodes in enumerate(LAYERS) for node in nodes}
# The router's rooms, bottom to top; the modules directly in router/ (its error type, the JSON body
# reader) sit below them all.
ROUTER_ROOMS = ("routing", "dispatch", "platform", "front")


def _modules() -> dict[str, Path]:
    """Every module of the package by its dotted name, from the source tree (a node's folder may
    hold rooms: subpackages, such as ``router/front/``)."""
    out = {f"pdfabric.{p.stem}": p for p in (ROOT / "pdfabric").glob("*.py")}
    for node in RANK:
        if node != "pdfabric":
            for p in (ROOT / node).rglob("*.py"):
                parts = p.relative_to(ROOT / node).with_suffix("").parts
                parts = parts[:-1] if parts[-1] == "__init__" else parts
                out[".".join(("pdfabric", node, *parts))] = p
    return out


def _node(module: str) -> str | None:
    """The node a dotted name of pdfabric belongs to (None outside pdfabric)."""
    parts = module.split(".")
    if parts[0] != "pdfabric":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in RANK else "pdfabric"


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The pdfabric modules a file imports anywhere in it (``from pdfabric.x import y`` names the
    module ``pdfabric.x.y`` when there is one, else ``pdfabric.x``)."""
    found = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Import):
            found.update(a.name for a in n.names if a.name.startswith("pdfabric"))
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module and n.module.startswith("pdfabric"):
            for a in n.names:
                sub = f"{n.module}.{a.name}"
                found.add(sub if sub in modules or n.module == "pdfabric" else n.module)
    return found


def _edges() -> set[tuple[str, str]]:
    modules = _modules()
    return {(module, target) for module, path in modules.items() for target in _imports(path, set(modules))}


def test_every_node_of_the_layers_exists() -> None:
    for node in RANK:
        assert node == "pdfabric" or (ROOT / node).is_dir(), node
        assert (ROOT / "pdfabric" / node / "__init__.py").is_file() or node == "pdfabric", node


def test_imports_point_down() -> None:
    upward = set()
    for module, target in _edges():
        source, dest = _node(module), _node(target)
        if source is None or dest is None or source == dest:
            continue
        if RANK[dest] >= RANK[source]:  # a node above, or beside it in its layer
            upward.add((module, target))
    assert upward == set(), "imports that point up (move what they need down)"


def test_the_router_rooms_point_down() -> None:
    """routing (registry, prediction, admission) < dispatch (the request core) < platform (tenants,
    catalog, rollouts, admin) < front (HTTP): a room imports only itself, the rooms below it and
    the router's own modules."""
    rank = {room: i for i, room in enumerate(ROUTER_ROOMS)}

    def room(module: str) -> int:
        parts = module.split(".")
        return rank.get(parts[3], -1) if len(parts) > 3 and parts[1] == "router" else -1

    upward = {(a, b) for a, b in _edges() if _node(a) == _node(b) == "router" and room(b) > room(a)}
    assert upward == set(), "router modules that import a room above their own"
    rooms = {p.name for p in (ROOT / "router").iterdir() if p.is_dir() and not p.name.startswith(("_", "."))}
    assert rooms == set(ROUTER_ROOMS)


def _circles(edges: set[tuple[str, str]]) -> set[frozenset[str]]:
    """The groups of two or more modules that reach each other through imports (Tarjan's strongly
    connected components, iterative)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: set[frozenset[str]] = set()
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.add(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        out.add(frozenset(group))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def test_no_import_circles() -> None:
    assert _circles({(a, b) for a, b in _edges() if a != b}) == set(), "modules that import each other"


def test_circles_are_found() -> None:
    edges = {("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"), ("d", "e"), ("e", "d"), ("f", "a")}
    assert _circles(edges) == {frozenset("abc"), frozenset("de")}


def test_the_test_sees_the_imports() -> None:
    """The checker finds what it checks: a known import at module level and one inside a function."""
    edges = _edges()
    assert ("pdfabric.router.front.serve", "pdfabric.router.front.openai_api") in edges
    assert ("pdfabric.router.platform.catalog", "pdfabric.engine.default_model") in edges  # inside a function
    assert len(_modules()) > 120
