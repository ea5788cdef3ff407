"""Which strategies a change touches: what a cell of the strategy runs, read from the source (ast: imports inside
functions count, as DeepSpeed's lazy ones do) against the files `git diff` names between two commits (and the work
tree's uncommitted changes). A cell runs its strategy's module and its launcher's (harness.launch.launcher), every
module of the project each imports, directly or through others, and of the workloads package only what its
workload's module runs.

    python -c "from harness.touched import touched_strategies; print(touched_strategies('.', 'HEAD~3'))"

What a strategy's files leave out is common to every strategy (the rank's step loop, the runner): the A/B tier
(harness/ab.py) times DDP on every change for those. The three registries are read as their literal dicts: a change
to a registry's entries alone touches the strategies those entries build, not every strategy that imports it, and
`registered_strategies` reads which strategies a commit holds without running its code.
"""

from __future__ import annotations

import ast
import os
import subprocess
from functools import cache
from pathlib import Path
from typing import Mapping, Sequence

PROJECT_PACKAGES = ("harness", "workloads")
STRATEGY_REGISTRY = "harness/strategies/__init__.py"
LAUNCHER_REGISTRY = "harness/launch/launcher/__init__.py"
WORKLOAD_REGISTRY = "workloads/__init__.py"
# Each registry's file and its literal dict (STYLE.md: one literal dict per registry).
REGISTRIES = {STRATEGY_REGISTRY: "STRATEGIES", LAUNCHER_REGISTRY: "LAUNCHERS", WORKLOAD_REGISTRY: "WORKLOADS"}
# Modules written for a family of strategies, which its members run as their own code: a change to one is timed
# on every member that runs it (harness/ab.py never rotates those out). The members are read from the imports.
FAMILY_MODULES = frozenset({
    "harness/strategies/deepspeed_common.py",   # the DeepSpeed strategies' start-up: ZeRO-1/2/3, pipeline, AutoTP
    "harness/strategies/zero.py",               # ZeRO's trainer, which AutoTP runs across its replicas
    "harness/strategies/fsdp2.py",              # FSDP2's trainer, which FSDP2+TP runs
    "harness/strategies/tp.py",                 # the tensor-parallel strategy FSDP2+TP builds on
    "harness/strategies/tensor_parallel.py",    # the Megatron layout of tp, fsdp2-tp and autotp
    "harness/strategies/mesh_layout.py",        # the (dp, tp) layout fsdp2-tp and autotp share
    "harness/strategies/parameter_server.py",   # the server the asynchronous parameter server builds on
    "harness/strategies/plain.py",              # the plain loop's trainer, which bare, dataparallel and tp build on
})
EXTRA_STRATEGIES_ENV = "PARBENCH_EXTRA_STRATEGIES"     # harness.strategies: FILE.py:DICT[,...], which launches inherit


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


def _launcher_module(strategy: object) -> str | None:
    """The module of the launcher that starts `strategy`'s ranks (its `launcher` key in LAUNCHERS)."""
    from harness.launch.launcher import LAUNCHERS

    launcher = LAUNCHERS.get(getattr(strategy, "launcher", None))
    return None if launcher is None else type(launcher).__module__


def strategy_files(root: Path, strategies: Mapping[str, object],
                   workload: str | None = None) -> dict[str, frozenset[str]]:
    """{strategy: the files, relative to `root`, that a cell of it runs}: its module's, its launcher's and what they
    import. With `workload`, the workloads package's files are only those that workload's module runs: a cell of
    gpt-tiny imports the Llama's module but builds no Llama, so a change there cannot move its step time."""
    root = root.resolve()
    kept_workload_files = None
    if workload is not None:
        from workloads import get_workload

        kept_workload_files = _closure(root, type(get_workload(workload)).__module__)
    files = {}
    for name, strategy in strategies.items():
        modules = [strategy.__module__, _launcher_module(strategy)]
        paths = frozenset().union(*(_closure(root, module) for module in modules if module))
        if kept_workload_files is not None:
            paths = frozenset(p for p in paths if p.parts[len(root.parts)] != "workloads" or p in kept_workload_files)
        files[name] = frozenset(str(p.relative_to(root)) for p in paths)
    return files


def changed_files(repo: Path, base: str) -> set[str]:
    """The files that differ between commit `base` and the work tree (committed or not)."""
    done = subprocess.run(["git", "diff", "--name-only", base], cwd=repo, capture_output=True, text=True, check=True)
    return {line for line in done.stdout.splitlines() if line}


# ---- the registries, read as their literal dicts ----------------------------------------------------------------


def literal_entries(source: str, name: str) -> dict[str, str] | None:
    """{key: its value, as an ast dump} of the module-level literal dict `name` in `source`; None where it has none."""
    for node in ast.parse(source).body:
        if _assigned_name(node) == name and isinstance(node.value, ast.Dict):
            keys = node.value.keys
            if all(isinstance(key, ast.Constant) and isinstance(key.value, str) for key in keys):
                return {key.value: ast.dump(value) for key, value in zip(keys, node.value.values)}
    return None


def _assigned_name(node: ast.stmt) -> str | None:
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return node.target.id
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    return None


def _beyond_entries(source: str, name: str) -> str:
    """What `source` runs besides its imports, its docstring and the dict `name`, as an ast dump: equal on two sides
    where a change rewrote the dict's entries (and the imports they need) alone. Comments are not in the ast."""
    body = ast.parse(source).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    kept = [node for node in body
            if not isinstance(node, (ast.Import, ast.ImportFrom)) and _assigned_name(node) != name]
    return ast.dump(ast.Module(body=kept, type_ignores=[]))


def _source_at(repo: Path, commit: str | None, path: str) -> str | None:
    """`path`'s text at `commit` (in the work tree where None); None where it does not exist there."""
    if commit is None:
        file = Path(repo) / path
        return file.read_text() if file.is_file() else None
    done = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=repo, capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else None


def changed_entries(repo: Path, base: str, path: str) -> set[str] | None:
    """The keys of registry `path`'s dict that the change since `base` adds, removes or rewrites; None where the
    change reaches beyond the entries (and their imports), or either side has no literal dict to compare."""
    name = REGISTRIES[path]
    old, new = _source_at(repo, base, path), _source_at(repo, None, path)
    if old is None or new is None:
        return None
    before, after = literal_entries(old, name), literal_entries(new, name)
    if before is None or after is None or _beyond_entries(old, name) != _beyond_entries(new, name):
        return None
    return {key for key in before.keys() | after.keys() if before.get(key) != after.get(key)}


def _built_by_entry(path: str, key: str, strategies: Mapping[str, object], workload: str | None) -> set[str]:
    """The strategies whose cells registry `path`'s entry `key` builds: that strategy; those its launcher starts;
    with a workload's entry, every strategy where it is the cells' workload (or no workload is named)."""
    if path == STRATEGY_REGISTRY:
        return {key} & set(strategies)
    if path == LAUNCHER_REGISTRY:
        return {name for name, strategy in strategies.items() if getattr(strategy, "launcher", None) == key}
    return set(strategies) if workload in (None, key) else set()


def registered_strategies(repo: Path, commit: str | None = None) -> list[str] | None:
    """The strategies a commit registers (the work tree where `commit` is None), read without running its code: the
    keys of its registry's literal dict, then those PARBENCH_EXTRA_STRATEGIES adds (every side's launches inherit it).
    None where its registry holds no literal dict."""
    source = _source_at(repo, commit, STRATEGY_REGISTRY)
    names = literal_entries(source, REGISTRIES[STRATEGY_REGISTRY]) if source is not None else None
    if names is None:
        return None
    return list(names) + [name for name in extra_strategies() if name not in names]


def extra_strategies() -> list[str]:
    """The names the PARBENCH_EXTRA_STRATEGIES files' dicts hold (FILE.py:DICT, each a literal dict)."""
    names: list[str] = []
    for entry in filter(None, os.environ.get(EXTRA_STRATEGIES_ENV, "").split(",")):
        path, _, attribute = entry.rpartition(":")
        if path and Path(path).is_file():
            names += literal_entries(Path(path).read_text(), attribute) or {}
    return names


# ---- which strategies a change touches ----------------------------------------------------------------------------


def touched_strategies(repo: Path | str, base: str, strategies: Mapping[str, object] | None = None,
                       workload: str | None = None) -> dict[str, list[str]]:
    """{strategy: the changed files among those its cells (of `workload`, where named) run}, for the strategies the
    change since `base` touches. A registry whose change rewrote entries alone counts for the strategies those
    entries build (a new strategy's entry touches no other); one changed beyond its entries, for all that run it."""
    if strategies is None:
        from harness.strategies import STRATEGIES
        strategies = STRATEGIES
    repo = Path(repo)
    changed = changed_files(repo, base)
    by_entry: dict[str, set[str]] = {}
    for path in REGISTRIES:
        if path in changed and (keys := changed_entries(repo, base, path)) is not None:
            changed.discard(path)
            for key in keys:
                for name in _built_by_entry(path, key, strategies, workload):
                    by_entry.setdefault(name, set()).add(path)
    touched = {name: sorted((files & changed) | by_entry.get(name, set()))
               for name, files in strategy_files(repo, strategies, workload).items()}
    return {name: files for name, files in touched.items() if files}


def must_time(repo: Path | str, touched: Mapping[str, Sequence[str]],
              strategies: Mapping[str, object]) -> dict[str, list[str]]:
    """{strategy: the files of its own code the change touched}, for the touched strategies whose own module (its
    class's) or a family module it runs (FAMILY_MODULES) changed: the A/B tier times those before any other."""
    root = Path(repo).resolve()
    found = {}
    for name, files in touched.items():
        own = module_path(root, strategies[name].__module__)
        mine = {str(own.relative_to(root))} if own is not None else set()
        if hits := [file for file in files if file in mine or file in FAMILY_MODULES]:
            found[name] = hits
    return found
