"""The layers import downwards: `harness/spec.py` (the data type) imports no registry, and the strategies, the
launchers and the workloads do not import each other in a circle. Every import counts, those inside functions
too: a late import closes a circle as surely as one at the top of a module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def import_graph(folders=("harness", "workloads")) -> dict[str, set[str]]:
    """{module: the project's modules it imports anywhere in its text}, TYPE_CHECKING-only imports left out."""
    files = {}
    for folder in folders:
        for path in (ROOT / folder).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            files[name.removesuffix(".__init__")] = path
    graph = {name: set() for name in files}
    for name, path in files.items():
        tree = ast.parse(path.read_text())
        type_only = {id(node) for guard in ast.walk(tree) if isinstance(guard, ast.If)
                     and ast.unparse(guard.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
                     for node in ast.walk(guard)}
        for node in ast.walk(tree):
            if id(node) in type_only:
                continue
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_the_spec_imports_no_registry_and_nothing_imports_in_a_circle():
    graph = import_graph()
    assert not {target for target in graph["harness.spec"]
                if target.startswith(("harness.strategies", "harness.launch", "workloads"))}, graph["harness.spec"]
    assert circles(graph) == []


def test_a_late_import_that_closes_a_circle_is_found():
    # The circle this test was written against: spec -> strategies (late, in RunSpec.__post_init__) ->
    # launch.launcher -> spec.
    graph = {"harness.spec": {"harness.strategies"}, "harness.strategies": {"harness.launch.launcher"},
             "harness.launch.launcher": {"harness.spec"}, "harness.cli": {"harness.spec"}}
    assert circles(graph) == [{"harness.spec", "harness.strategies", "harness.launch.launcher"}]
    source = import_graph()
    assert "harness.launch.launcher" in source["harness.strategies"]    # still there: only the spec's edge went
