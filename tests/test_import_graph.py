"""The package's import graph has no circle, and its layers import only downward.

Every import counts, a function's deferred ones included: a deferred import still ties the
two modules together. The layers are the table in docs/design.md ("Layers"), read from it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"proxy": "proxima.proxy", "trainer": "proxima.trainer", "proxima": "proxima"}


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports (a name imported from a package counts as its
    submodule where one exists, else as the package)."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in modules:
                    out.add(sub)
                elif target in modules:
                    out.add(target)
    out.discard(name)
    return out


def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_circle_finder_finds_a_circle() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(edges) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle() -> None:
    found = circles(graph())
    assert found == [], "\n".join(" <-> ".join(c) for c in found)


def _layers() -> list[list[str]]:
    """docs/design.md's "Layers" table, top (the edge) first: one row per layer, its
    packages and modules by dotted name."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if re.match(r"\| \d+ \|", line)]
    return [re.findall(r"`(proxima[\w.]*)`", row) for row in rows]


def _layer_of(module: str, layers: list[list[str]]) -> int | None:
    best: tuple[int, int] | None = None  # (length of the matching prefix, layer)
    for level, prefixes in enumerate(layers):
        for prefix in prefixes:
            matches = module == prefix or module.startswith(prefix + ".")
            if matches and (best is None or len(prefix) > best[0]):
                best = (len(prefix), level)
    return None if best is None else best[1]


def _above(target: str, module: str, layers: list[list[str]]) -> bool:
    """Whether ``target`` sits in a layer above ``module``'s (a lower index)."""
    t, m = _layer_of(target, layers), _layer_of(module, layers)
    return t is not None and m is not None and t < m


def test_every_module_has_a_layer_and_imports_only_its_own_or_lower_layers() -> None:
    layers = _layers()
    assert len(layers) >= 4
    edges = graph()
    proxy_modules = [m for m in edges if m.startswith("proxima.proxy.")]
    unplaced = [m for m in proxy_modules if _layer_of(m, layers) is None]
    assert unplaced == [], f"modules missing from docs/design.md's Layers table: {unplaced}"
    upward = [
        f"{m} (layer {_layer_of(m, layers)}) imports {t} (layer {_layer_of(t, layers)})"
        for m in proxy_modules
        for t in sorted(edges[m])
        if t.startswith("proxima.proxy")
        and _layer_of(t, layers)  # type: ignore[operator]
        < _layer_of(m, layers)  # type: ignore[operator]
    ]
    assert upward == [], "\n".join(upward)
