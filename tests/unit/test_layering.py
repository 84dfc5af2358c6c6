"""The package's layout holds: every import points down the floors of ``docs/design.md``'s map,
no module imports itself back through others, and an import inside a function is only ever an
optional dependency, said so in a comment. Read from the source (ast), nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "omni_dist_offload"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE

#: The top-level modules of the engine (with ``transfer/``): the floor everything stands on.
CORE_MODULES = {"config", "plan", "layout", "hostmem", "residency", "budget", "ring", "tenants", "apply", "trace",
                "storage", "sharedmem"}

#: floor -> the floors it may import (itself always). The map in docs/design.md says the same.
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "models": set(),
    "runtime": set(),
    "loading": {"core", "models", "runtime"},
    "tools": {"core", "models", "loading", "runtime"},
    "app": {"core", "models", "loading", "runtime", "tools"},
    "door": {"core", "app", "runtime"},  # __init__ (the public API) and __main__
}

#: Third-party modules an import inside a function may bring in: the optional extras.
OPTIONAL = {"fastapi", "uvicorn", "prometheus_client", "matplotlib", "imageio", "peft"}
#: Package modules that import only optional extras, and so may be imported late too.
OPTIONAL_INTERNAL = {f"{PACKAGE}.app.serve.run"}
#: Late imports made on purpose, by importer: ``__main__`` decides how the process starts (see
#: [Note: serve on the C allocator]) before the CLI brings in torch and diffusers.
STARTS_FIRST = {(f"{PACKAGE}.__main__", f"{PACKAGE}.app.cli")}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def floor(module: str) -> str:
    parts = module.split(".")[1:]
    if not parts or parts[0] in ("__main__",):
        return "door"
    if parts[0] in CORE_MODULES or parts[0] == "transfer":
        return "core"
    return parts[0]


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    is_package = MODULES[module].name == "__init__.py"
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(module: str) -> list[tuple[str, ast.stmt, bool]]:
    """(imported module, statement, inside a function) for every import of ``module``; a name
    imported from a package counts as its submodule when there is one."""
    tree = ast.parse(MODULES[module].read_text())
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                found.extend((alias.name, child, in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                target = _resolve(module, child)
                for alias in child.names:
                    sub = f"{target}.{alias.name}"
                    found.append((sub if sub in MODULES else target, child, in_function))
            visit(child, inner)

    visit(tree, False)
    return found


def _internal(name: str) -> str | None:
    """The package module ``name`` is, or lies in; None for a third-party module."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def test_the_map_covers_every_module():
    floors = {floor(m) for m in MODULES}
    assert floors <= set(ALLOWED), floors - set(ALLOWED)
    assert {"core", "loading", "models", "app", "tools", "runtime", "door"} <= floors


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down_the_floors(module):
    mine = floor(module)
    wrong = []
    for target, node, _ in imports(module):
        internal = _internal(target)
        if internal is None or internal == PACKAGE and mine == "door":
            continue
        theirs = floor(internal)
        if theirs != mine and theirs not in ALLOWED[mine]:
            wrong.append(f"line {node.lineno}: {internal} ({theirs})")
    assert not wrong, f"{module} ({mine}) may import only {sorted(ALLOWED[mine] | {mine})}: {wrong}"


def test_no_import_cycles():
    graph = {m: {t for name, _, late in imports(m) if not late and (t := _internal(name)) and t != m}
             for m in MODULES}
    done: set[str] = set()

    def walk(node: str, path: list[str]) -> None:
        if node in path:
            cycle = path[path.index(node):] + [node]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        if node in done:
            return
        for nxt in sorted(graph[node]):
            walk(nxt, path + [node])
        done.add(node)

    for module in sorted(graph):
        walk(module, [])


@pytest.mark.parametrize("module", sorted(MODULES))
def test_late_imports_are_optional_dependencies_and_say_so(module):
    lines = MODULES[module].read_text().splitlines()
    bad = []
    for target, node, late in imports(module):
        if not late:
            continue
        optional = (target.split(".")[0] in OPTIONAL or _internal(target) in OPTIONAL_INTERNAL
                    or (module, _internal(target)) in STARTS_FIRST)
        said = "#" in lines[node.lineno - 1] or lines[node.lineno - 2].strip().startswith("#")
        if not (optional and said):
            bad.append(f"line {node.lineno}: {target}")
    assert not bad, (f"{module}: imports inside functions must be optional extras "
                     f"({sorted(OPTIONAL)}) with a comment saying so: {bad}")


def test_the_checks_catch_what_they_look_for(tmp_path, monkeypatch):
    """The helpers above see a wrong-way arrow, a cycle and a late import, so the tests cannot
    pass by seeing nothing."""
    core, tool = f"{PACKAGE}.ring", f"{PACKAGE}.tools.bench"
    fake = {core: tmp_path / "ring.py", tool: tmp_path / "bench.py"}
    fake[core].write_text("from .tools import bench\n\ndef f():\n    import numpy\n")
    fake[tool].write_text("from ..ring import x\n")
    monkeypatch.setattr(__import__(__name__), "MODULES", {**MODULES, **fake})
    found = imports(core)
    assert [(t, late) for t, _, late in found] == [(tool, False), ("numpy", True)]
    assert floor(core) == "core" and floor(tool) == "tools" and "tools" not in ALLOWED["core"]
    assert [t for t, _, _ in imports(tool)] == [core]  # with the first line: a cycle
