"""The packages of ``src/fp8kit`` only import downward: the import graph between top-level parts is a DAG.

Built from the AST of every module, imports inside functions included, ``if TYPE_CHECKING:`` blocks
excluded (annotations only). A cycle fails the test and is printed with the file and line of each edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "src" / "fp8kit"

#: The layers, bottom first (docs/architecture.md). A part may import only parts listed before it.
LAYERS = [
    "base", "fp8", "moe", "models", "data", "optim", "comm", "selective", "parallel", "config",
    "bench", "train", "integrations", "cli", "__main__", "__init__",
]


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str, is_pkg: bool):
    """Yield ``(imported module, line)`` for every import outside ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "fp8kit":  # from fp8kit import x: x may be a part
                for a in node.names:
                    yield f"fp8kit.{a.name}", node.lineno
            else:
                yield target, node.lineno
        stack.extend(ast.iter_child_nodes(node))


def _part(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "fp8kit":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def import_edges() -> dict[tuple[str, str], list[str]]:
    """``{(from part, to part): ["file:line", ...]}`` over all of ``src/fp8kit``."""
    edges: dict[tuple[str, str], list[str]] = {}
    for f in sorted(ROOT.rglob("*.py")):
        rel = f.relative_to(ROOT.parent).with_suffix("")
        is_pkg = rel.name == "__init__"
        module = ".".join(rel.parts[:-1] if is_pkg else rel.parts)
        src = _part(module)
        if is_pkg and module == "fp8kit":
            src = "__init__"
        tree = ast.parse(f.read_text(encoding="utf-8"))
        for target, line in _imports(tree, module, is_pkg):
            dst = _part(target)
            if dst is None or dst == src:
                continue
            edges.setdefault((src, dst), []).append(f"{f.relative_to(ROOT.parent)}:{line}")
    return edges


def find_cycle(edges) -> list[str] | None:
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    color: dict[str, int] = {}
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        color[n] = 1
        path.append(n)
        for m in sorted(graph.get(n, ())):
            if color.get(m) == 1:
                return path[path.index(m):] + [m]
            if not color.get(m):
                c = visit(m)
                if c:
                    return c
        path.pop()
        color[n] = 2
        return None

    for n in sorted(graph):
        if not color.get(n):
            c = visit(n)
            if c:
                return c
    return None


def test_import_graph_between_parts_is_acyclic():
    edges = import_edges()
    cycle = find_cycle(edges)
    if cycle:
        where = [f"{a} -> {b}: {', '.join(edges[(a, b)][:3])}" for a, b in zip(cycle, cycle[1:], strict=False)]
        raise AssertionError("import cycle between parts of fp8kit:\n  " + "\n  ".join(where))


def test_parts_import_only_lower_layers():
    edges = import_edges()
    parts = {p for e in edges for p in e}
    assert parts <= set(LAYERS), f"parts missing from LAYERS: {sorted(parts - set(LAYERS))}"
    upward = [
        f"{a} -> {b} ({', '.join(where[:2])})"
        for (a, b), where in sorted(edges.items())
        if LAYERS.index(b) > LAYERS.index(a)
    ]
    assert not upward, "imports that point up the layer order:\n  " + "\n  ".join(upward)


def test_cycle_finder_finds_a_cycle():
    # the checker itself can fail: a planted two-part cycle is reported with its edge
    assert find_cycle({("a", "b"): ["x"], ("b", "a"): ["y"]}) == ["a", "b", "a"]
    assert find_cycle({("a", "b"): ["x"], ("b", "c"): ["y"]}) is None
