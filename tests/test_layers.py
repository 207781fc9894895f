"""The package's layering, enforced: imports point down only (lazy imports inside functions included), no import
cycle between modules, and no module reaches for another module's ``_private`` name.

Layers, bottom to top (a module may import its own layer and the layers below):

    _checks, settings  <  kernels  <  functional  <  nn  <  runtime  <  checkpoints  <  models
    <  parallel, memory, d2l, hf, plot  <  demo, train, bench, cli, text  <  the package root
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
LAYERS = [
    ("sublayer._checks", "sublayer.settings"),
    ("sublayer.kernels",),
    ("sublayer.functional",),
    ("sublayer.nn",),
    ("sublayer.runtime",),
    ("sublayer.checkpoints",),
    ("sublayer.models",),
    ("sublayer.parallel", "sublayer.memory", "sublayer.d2l", "sublayer.hf", "sublayer.plot"),
    ("sublayer.demo", "sublayer.train", "sublayer.bench", "sublayer.cli", "sublayer.text"),
]


def _modules() -> dict[str, tuple[Path, bool]]:
    mods = {}
    for p in (SRC / "sublayer").rglob("*.py"):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        mods[".".join(parts[:-1] if is_pkg else parts)] = (p, is_pkg)
    return mods


MODULES = _modules()


def _layer(module: str) -> int:
    for rank, names in enumerate(LAYERS):
        if any(module == n or module.startswith(n + ".") for n in names):
            return rank
    if module == "sublayer" or module == "sublayer.__main__":
        return len(LAYERS)
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS in {__file__}")


def _imports(module: str) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every sublayer import in ``module``, lazy ones too."""
    path, is_pkg = MODULES[module]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names if a.name.startswith("sublayer")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("sublayer"):
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.append((sub, None, node.lineno) if sub in MODULES else (target, a.name, node.lineno))
    return out


def test_every_module_has_a_layer():
    for m in MODULES:
        _layer(m)


def test_imports_point_down_only():
    bad = [
        f"{m}:{line} imports {target} ({LAYERS[_layer(target)][0] if _layer(target) < len(LAYERS) else 'root'} layer)"
        for m in MODULES
        for target, _, line in _imports(m)
        if target in MODULES and _layer(target) > _layer(m)
    ]
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_no_import_cycle():
    graph = {m: {t for t, _, _ in _imports(m) if t in MODULES and t != m} for m in MODULES}
    # a package's __init__ importing its own children is its public face, not a dependency of theirs on it
    for m, (_, is_pkg) in MODULES.items():
        for child in [t for t in graph[m] if is_pkg and t.startswith(m + ".")]:
            if m in _closure(graph, child):
                graph[m].discard(child)  # checked below only through the children themselves
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _closure(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for n in graph[todo.pop()]:
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_another_modules_private_name():
    bad = [
        f"{m}:{line} imports {name} from {target}"
        for m in MODULES
        for target, name, line in _imports(m)
        if name is not None and name.startswith("_") and target != m
    ]
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


@pytest.mark.parametrize("upward", ["from ..models import gpt2", "from ..runtime import generation"])
def test_the_check_fails_on_an_upward_import(monkeypatch, tmp_path, upward):
    """The rule can fail: an nn module importing from a higher layer is reported."""
    fake = tmp_path / "fake.py"
    fake.write_text(f"def f():\n    {upward}\n")
    monkeypatch.setitem(MODULES, "sublayer.nn.fake", (fake, False))
    with pytest.raises(AssertionError, match="sublayer.nn.fake:2 imports"):
        test_imports_point_down_only()
