"""The code's shape, measured: what the architecture issue's figures come from (docs/architecture.md).

    python benchmarks/code_shape.py [PACKAGE_DIR]    # default: the replay package beside this file

Prints, for the package's source alone (no import of it): `Loop`'s constructor (its parameters and lines),
the longest functions, the import cycles (every import, at module level or inside a function), the
comparisons of a launcher with a string or of a manifest's command with None, and the imports made inside
functions. Run it on an older checkout to compare (`git worktree add /tmp/old REV`).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

LAUNCHER_NAMES = {"custom", "deepspeed", "local"}


def modules(package: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_of(tree: ast.AST, known: set[str]) -> set[str]:
    """The package's modules this one imports: `from a.b import c` names a.b.c when that is a module."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in known}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _is_launcher_check(node: ast.Compare) -> bool:
    sides = [node.left, *node.comparators]
    text = [ast.unparse(s) for s in sides]
    strings = {s.value for s in sides if isinstance(s, ast.Constant) and isinstance(s.value, str)}
    for s in sides:
        if isinstance(s, ast.Tuple | ast.List | ast.Set):
            strings |= {e.value for e in s.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    if strings & LAUNCHER_NAMES and any("launcher" in t for t in text):
        return True
    is_none = any(isinstance(s, ast.Constant) and s.value is None for s in sides)
    return is_none and any(t.endswith(".command") for t in text)


def function_imports(tree: ast.AST) -> int:
    count = 0
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import | ast.ImportFrom) and node is not fn:
                    count += 1
    return count


def main(package: Path) -> None:
    mods = modules(package)
    trees = {name: ast.parse(path.read_text()) for name, path in mods.items()}

    for name, tree in trees.items():
        for cls in ast.walk(tree):
            if isinstance(cls, ast.ClassDef) and cls.name == "Loop" and name.startswith("replay.recorder"):
                init = next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
                a = init.args
                n = len(a.args) - 1 + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
                print(f"Loop.__init__ ({name}): {n} parameters, {init.end_lineno - init.lineno + 1} lines")

    functions = []
    for name, tree in trees.items():
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                functions.append((fn.end_lineno - fn.lineno + 1, f"{name}:{fn.name}"))
    functions.sort(reverse=True)
    print("longest functions (lines):")
    for length, where in functions[:10]:
        print(f"  {length:4d}  {where}")

    graph = {name: imports_of(tree, set(mods)) - {name} for name, tree in trees.items()}
    found = cycles(graph)
    print(f"import cycles: {len(found)}")
    for component in found:
        print("  " + " <-> ".join(component))

    checks: dict[str, int] = {}
    for name, tree in trees.items():
        asserted = {id(n) for a in ast.walk(tree) if isinstance(a, ast.Assert) for n in ast.walk(a)}   # invariants
        n = sum(_is_launcher_check(node) for node in ast.walk(tree)
                if isinstance(node, ast.Compare) and id(node) not in asserted)
        if n:
            checks[name] = n
    print(f"launcher string / command-is-None checks: {sum(checks.values())} in {len(checks)} modules")
    for name, n in sorted(checks.items(), key=lambda kv: -kv[1]):
        print(f"  {n:3d}  {name}")

    inner = {name: function_imports(tree) for name, tree in trees.items()}
    print(f"imports inside functions: {sum(inner.values())} in {sum(1 for n in inner.values() if n)} modules")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "replay")
