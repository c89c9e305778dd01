"""The packages of gyre_slurm import each other without a cycle, and the layering holds:
`common` (shared file I/O and request checking) imports no other package, and the runtime
never reaches into the simulator (it builds its policy in `sched`).

Imports are read with `ast` from every module, function-level (lazy) imports included,
so a cycle hidden behind an import inside a function counts too."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "gyre_slurm"


def _module_name(path: Path) -> tuple[str, bool]:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _imported(tree: ast.AST, module: str, is_pkg: bool):
    """(line, dotted name) of every gyre_slurm import in a module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: None if is_pkg else -1]
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            yield node.lineno, name
            for alias in node.names:  # `from gyre_slurm import sim` names a package
                yield node.lineno, f"{name}.{alias.name}"


def package_graph() -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) -> where ('file:line imports name')."""
    packages = {p.name for p in PKG.iterdir() if (p / "__init__.py").is_file()}
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted(PKG.rglob("*.py")):
        module, is_pkg = _module_name(path)
        parts = module.split(".")
        if len(parts) < 2 or parts[1] not in packages:
            continue  # gyre_slurm/cli.py, errors.py: top-level modules, not packages
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, name in _imported(tree, module, is_pkg):
            target = name.split(".")
            if len(target) < 2 or target[0] != "gyre_slurm" or target[1] not in packages:
                continue
            if target[1] != parts[1]:
                edges[(parts[1], target[1])].append(
                    f"{path.relative_to(PKG.parent)}:{line} imports {name}")
    return edges


def find_cycle(edges) -> list[str] | None:
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


@pytest.fixture(scope="module")
def graph():
    return package_graph()


def test_no_import_cycle_among_packages(graph):
    assert graph, "no imports read: is the package path right?"
    cycle = find_cycle(graph)
    if cycle:
        evidence = [w for a, b in zip(cycle, cycle[1:]) for w in graph[(a, b)][:2]]
        pytest.fail("import cycle " + " -> ".join(cycle) + ":\n  " + "\n  ".join(evidence))


def test_find_cycle_sees_a_cycle():
    assert find_cycle({("a", "b"): [], ("b", "c"): [], ("c", "a"): []}) == ["a", "b", "c", "a"]
    assert find_cycle({("a", "b"): [], ("a", "c"): [], ("b", "c"): []}) is None


@pytest.mark.parametrize("importer, forbidden", [
    ("common", None),  # None: any other package
    ("runtime", "sim"),
    ("sched", "runtime"),
    ("sched", "sim"),
])
def test_layering(graph, importer, forbidden):
    bad = [w for (a, b), where in graph.items() for w in where
           if a == importer and (forbidden is None or b == forbidden)]
    assert not bad, "\n".join(bad)


def test_the_runtimes_parts_take_typed_dependencies():
    """Nothing in runtime/ takes an untyped coordinator, and every constructor names its
    dependencies with their types (the job state, the world, the gateway, ...)."""
    untyped = []
    for path in sorted((PKG / "runtime").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for arg in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
                if arg.annotation is None and arg.arg not in ("self", "cls") and (
                        node.name == "__init__" or arg.arg.startswith("coord")):
                    untyped.append(f"{path.name}:{node.lineno} {node.name}({arg.arg})")
    assert not untyped, untyped
