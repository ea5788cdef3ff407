"""Which strategies a change touches: a strategy's own module, and every module of the project it imports, directly
or through others, read from the source (ast: imports inside functions count, as DeepSpeed's lazy ones do), against
the files `git diff` names between two commits (and the work tree's uncommitted changes).

    python -c "from harness.touched import touched_strategies; print(touched_strategies('.', 'HEAD~3'))"

What a strategy's files leave out is common to every strategy (the rank's step loop, the launchers, the workloads):
the A/B tier (harness/ab.py) times DDP on every change for those.
"""

from __future__ import annotations

import ast
import subprocess
from functools import cache
from pathlib import Path
from typing import Mapping

PROJECT_PACKAGES = ("harness", "workloads")


def module_path(root: Path, module: str) -> Path | None:
    """The file of `module` under `root` (a package's __init__.py), or None where it is not the project's."""
    if module.split(".")[0] not in PROJECT_PACKAGES:
        return None
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported_modules(path: Path, module: str) -> set[str]:
    """The modules `path` (module `module`) names in its imports, anywhere in it; `from a import b` names both a
    and a.b (b may be a module), relative imports resolved against `module`'s package."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                origin = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            names.add(origin)
            names.update(f"{origin}.{alias.name}" for alias in node.names)
    return names


@cache
def _closure(root: Path, module: str) -> frozenset[Path]:
    """The project's files `module` runs: its own, every module it imports and theirs, and the packages they sit
    in (importing a.b.c runs a/__init__.py and a/b/__init__.py). A package reached only as the parent of a module
    counts as its own file, its imports not followed: harness/strategies/__init__.py imports every strategy for
    its registry, which would otherwise make each strategy run all the others."""
    files: set[Path] = set()
    pending = [module]
    seen: set[str] = set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        for k in range(1, len(parts)):
            if (parent := module_path(root, ".".join(parts[:k]))) is not None:
                files.add(parent)
        path = module_path(root, name)
        if path is None:
            continue
        files.add(path)
        pending.extend(_imported_modules(path, name))
    return frozenset(files)


def strategy_files(root: Path, strategies: Mapping[str, type]) -> dict[str, frozenset[str]]:
    """{strategy: the files, relative to `root`, that its module runs}."""
    root = root.resolve()
    return {name: frozenset(str(p.relative_to(root)) for p in _closure(root, cls.__module__))
            for name, cls in strategies.items()}


def changed_files(repo: Path, base: str) -> set[str]:
    """The files that differ between commit `base` and the work tree (committed or not)."""
    done = subprocess.run(["git", "diff", "--name-only", base], cwd=repo, capture_output=True, text=True, check=True)
    return {line for line in done.stdout.splitlines() if line}


def touched_strategies(repo: Path | str, base: str, strategies: Mapping[str, type] | None = None) -> dict[str, list[str]]:
    """{strategy: the changed files among those it runs}, for the strategies the change since `base` touches."""
    if strategies is None:
        from harness.strategies import STRATEGIES
        strategies = STRATEGIES
    repo = Path(repo)
    changed = changed_files(repo, base)
    touched = {name: sorted(files & changed) for name, files in strategy_files(repo, strategies).items()}
    return {name: files for name, files in touched.items() if files}
