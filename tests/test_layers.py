"""The layers import downward only, and module-level imports have no circles.

tools (CLI, launcher, benchmarks, profiling) -> services -> shared. A service never
imports another service: they meet on the protocol. Read from the source with `ast`,
so a lazy import inside a function counts as much as one at the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"shared": 0, "services": 1, "tools": 2}


def _modules() -> dict[str, Path]:
    out = {}
    for layer in LAYERS:
        for p in (ROOT / layer).rglob("*.py"):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(["moemesh", *parts])] = p
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module an import names: the longest prefix that is one of ours."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(name: str, path: Path, top_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in tree.body if top_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            for a in node.names:  # `from pkg import sub` depends on sub, not on pkg's __init__
                full = f"{base}.{a.name}"
                out.add(full if full in MODULES else base)
    return {m for m in (_resolve(i) for i in out if i.startswith("moemesh.")) if m and m != name}


def _layer(mod: str) -> str:
    return mod.split(".")[1]


def test_every_import_runs_downward():
    upward = []
    for name, path in MODULES.items():
        for dep in _imports(name, path, top_only=False):
            if LAYERS[_layer(dep)] > LAYERS[_layer(name)]:
                upward.append(f"{name} -> {dep}")
            elif _layer(name) == _layer(dep) == "services" and name.split(".")[2] != dep.split(".")[2]:
                upward.append(f"{name} -> {dep} (one service importing another)")
    assert not upward, "\n".join(upward)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_module_level_imports_have_no_circles():
    graph = {name: _imports(name, path, top_only=True) for name, path in MODULES.items()}
    assert not _cycles(graph)


@pytest.mark.parametrize("graph, want", [
    ({"a": {"b"}, "b": {"a"}, "c": set()}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
])
def test_the_circle_finder_finds_circles(graph, want):
    assert _cycles(graph) == want
