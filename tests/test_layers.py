"""The import contract: lower layers never import higher ones, and no module imports itself through others
(every import, at module level or inside a function). The store is the data model every component shares;
kernels are pure numerics. (The processes that launch the work never load torch: test_layers_integration.py.)"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable
from pathlib import Path

import replay

PACKAGE = Path(replay.__file__).parent

# Lowest first; a module may import its own layer and the ones below, never one above.
LAYERS = [
    ["replay", "replay.errors", "replay.processes", "replay.lifeline"],
    ["replay.config"],
    ["replay.store"],
    ["replay.kernels"],
    ["replay.recorder"],
    ["replay.train"],
    ["replay.launch"],
    ["replay.replayer"],
    ["replay.bisect", "replay.analysis", "replay.experiments"],
    ["replay.views", "replay.demo", "replay.cli", "replay.__main__"],
]
# Below their layer number, and still off limits: kernels are numerics only.
FORBIDDEN = {"replay.kernels": ["replay.store"]}


def _layer(module: str) -> int:
    best = max((prefix for layer in LAYERS for prefix in layer if module == prefix or module.startswith(prefix + ".")),
               key=len)
    return next(i for i, layer in enumerate(LAYERS) if best in layer)


def _modules() -> dict[str, Path]:
    """The package's modules by name, its compiled ones (replay/store/_crc32c.c) by their stubs."""
    out = {}
    for path in [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.pyi")]:
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path, modules: Iterable[str]) -> set[str]:
    """The package's modules `path` imports: `from replay.x import y` imports module replay.x.y where that is
    a module, else (a name of it) replay.x."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                         for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m == "replay" or m.startswith("replay.")}


@functools.cache   # parsed once for the tests that read it (they do not change it)
def _import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {module: _imports(path, modules) - {module} for module, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (its modules in import order, the first again at the end), or None."""
    state: dict[str, int] = {}   # 1: on the current path, 2: done (no cycle through it)
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            if state.get(imported) == 1:
                return path[path.index(imported):] + [imported]
            if imported not in state and (found := visit(imported)):
                return found
        state[module] = 2
        path.pop()
        return None

    return next((c for m in sorted(graph) if m not in state and (c := visit(m))), None)


def test_every_module_has_a_layer():
    assert all(_layer(m) is not None for m in _modules())


def test_no_module_imports_a_higher_layer():
    wrong = []
    for module, imports in sorted(_import_graph().items()):
        for imported in sorted(imports):
            forbidden = [p for top, ps in FORBIDDEN.items() if module.startswith(top) for p in ps]
            if _layer(imported) > _layer(module) or any(imported.startswith(p) for p in forbidden):
                wrong.append(f"{module} imports {imported}")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle():
    cycle = _cycle(_import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"b"}, "d": set()}) == ["b", "c", "b"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_contract_catches_what_it_forbids():
    assert _layer("replay.store.run_store") < _layer("replay.replayer.replays") < _layer("replay.views")
    assert _layer("replay.kernels.registry") > _layer("replay.store.lease")   # yet FORBIDDEN keeps them apart
