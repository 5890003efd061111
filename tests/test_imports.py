"""No import cycles among engine's modules, not even deferred ones: every import statement counts, at module level
or inside a function, and so does the package whose __init__ an import runs first.

    python tests/test_imports.py      lists each cycle with the import lines that close it
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]   # the repository root is the package `engine`
NOT_ENGINE = {"tests", "bench", "docs"}      # folders of the repository that are not part of the package


def engine_modules() -> dict[str, Path]:
    """Module name -> file, for every module of the package."""
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[0] in NOT_ENGINE or any(p.startswith(".") or p.endswith(".egg-info") for p in parts):
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(("engine", *parts))] = path
    return modules


def _imported(node: ast.Import | ast.ImportFrom, package: str, modules: dict[str, Path]) -> list[str]:
    """The modules of the package an import statement names (`from a import b`: a.b where it is a module, else a)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = package.split(".")
        base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]


def import_graph(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """Module -> {module it imports: line of the first such import}."""
    graph: dict[str, dict[str, int]] = {name: {} for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _imported(node, package, modules):
                while target and target not in modules:   # a name inside a module: the module
                    target = target.rpartition(".")[0]
                # the target and the packages above it that are not this module's own (those ran before it)
                while target and target != "engine":
                    if target != name and not (name + ".").startswith(target + "."):
                        graph[name].setdefault(target, node.lineno)
                    target = target.rpartition(".")[0]
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(graph[child])))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def describe(component: list[str], graph: dict[str, dict[str, int]], modules: dict[str, Path]) -> str:
    lines = [f"cycle among {', '.join(component)}:"]
    for name in component:
        for target, line in sorted(graph[name].items()):
            if target in component:
                lines.append(f"    {modules[name].relative_to(ROOT)}:{line} imports {target}")
    return "\n".join(lines)


def test_no_import_cycles():
    modules = engine_modules()
    assert "engine.cli.app" in modules and "engine.core.errors" in modules
    graph = import_graph(modules)
    assert "engine.core.errors" in graph["engine.cli.app"]   # imports are found
    found = cycles(graph)
    assert not found, "\n".join(describe(c, graph, modules) for c in found)


if __name__ == "__main__":
    modules = engine_modules()
    graph = import_graph(modules)
    found = cycles(graph)
    print("\n".join(describe(c, graph, modules) for c in found) or "no import cycles")
    sys.exit(1 if found else 0)
