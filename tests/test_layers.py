"""The package's layers, read from its source: the IR (with the Backend interface and the process group
every backend's collectives share) imports nothing above it, the runtime reaches backends only through
the Backend interface (a backend object from schedule.py), nothing outside backends/ imports a backend's
own modules, backends know nothing of models or the engine, and no modules import each other in a circle.
Every import counts, those inside functions too."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "soma_runtime"
RUNTIME = ("soma_runtime.ir", "soma_runtime.engine", "soma_runtime.architectures", "soma_runtime.loaders", "soma_runtime.context",
           "soma_runtime.text", "soma_runtime.tasks")
REGISTRY = ("soma_runtime.backends",)      # the package's entry points: get, detect_all, gpu_available, run_op
ABOVE_IR = ("soma_runtime.backends", "soma_runtime.engine", "soma_runtime.architectures", "soma_runtime.loaders",
            "soma_runtime.tasks", "soma_runtime.server")
ABOVE_BACKENDS = ("soma_runtime.engine", "soma_runtime.architectures", "soma_runtime.tasks", "soma_runtime.server")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imports_of(path: Path) -> set[str]:
    """The package's modules a file imports (a name imported from a package counts as its submodule
    where there is one)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("soma_runtime"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("soma_runtime"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if is_module(sub) else node.module)
    return found


GRAPH = {module_name(p): imports_of(p) for p in PACKAGE.rglob("*.py")}


def within(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_ir_imports_nothing_above_it():
    leaks = sorted(f"{m} -> {i}" for m, deps in GRAPH.items() if within(m, ("soma_runtime.ir",))
                   for i in deps if within(i, ABOVE_IR))
    assert not leaks, "\n".join(leaks)


def test_the_runtime_imports_no_backends_module():
    """It holds a Backend (ir/backend.py) that schedule.py looked up; no registry entry point is needed."""
    leaks = sorted(f"{m} -> {i}" for m, deps in GRAPH.items() if within(m, RUNTIME)
                   for i in deps if within(i, ("soma_runtime.backends",)))
    assert not leaks, "\n".join(leaks)


def test_outside_backends_only_the_registry_is_imported_never_a_backends_own_modules():
    leaks = sorted(f"{m} -> {i}" for m, deps in GRAPH.items() if not within(m, ("soma_runtime.backends",))
                   for i in deps if within(i, ("soma_runtime.backends",)) and i not in REGISTRY)
    assert not leaks, "\n".join(leaks)


def test_backends_import_nothing_of_models_the_engine_or_the_server():
    leaks = sorted(f"{m} -> {i}" for m, deps in GRAPH.items() if within(m, ("soma_runtime.backends",))
                   for i in deps if within(i, ABOVE_BACKENDS))
    assert not leaks, "\n".join(leaks)


def test_no_modules_import_each_other_in_a_circle():
    """Tarjan's strongly connected components over the import graph: every one is a single module."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for n in GRAPH.get(m, ()):
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in on_stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = []
            while True:
                n = stack.pop()
                on_stack.discard(n)
                component.append(n)
                if n == m:
                    break
            if len(component) > 1 or m in GRAPH.get(m, ()):
                circles.append(sorted(component))

    for m in sorted(GRAPH):
        if m not in index:
            visit(m)
    assert not circles, circles
