"""The package's house rules, read from its source (no GPU, nothing imported):

- no module reads another module's private names (``from .m import _x``, ``obj._x`` on anything
  but ``self`` / ``cls``; the package's private *modules*, ``from . import _abi``, are its own);
- no import circle between the package's modules;
- no module over the line budget.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "hisparse_cupy"
MAX_LINES = 510  # "about 500"
MODULES = sorted(PKG.rglob("*.py"))


def _name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


NAMES = {_name(p): p for p in MODULES}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _resolve(mod: str, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` in ``mod`` names."""
    if not node.level:
        return node.module or ""
    is_pkg = NAMES[mod].name == "__init__.py"
    base = mod.split(".")
    base = base[: len(base) - node.level + (1 if is_pkg else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def private_reads(mod: str, tree: ast.AST) -> list[str]:
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            src = _resolve(mod, node)
            for a in node.names:
                if _private(a.name) and f"{src}.{a.name}" not in NAMES:  # a module is fine
                    bad.append(f"line {node.lineno}: from {src} import {a.name}")
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            v = node.value
            if isinstance(v, ast.Name) and v.id in ("self", "cls"):
                continue
            if f"{ast.unparse(v)}.{node.attr}" in NAMES or (
                    isinstance(v, ast.Name) and f"hisparse_cupy.{node.attr}" in NAMES):
                continue  # a private module of the package, reached as an attribute
            bad.append(f"line {node.lineno}: {ast.unparse(node)}")
    return bad


def imports(mod: str, tree: ast.AST) -> set[str]:
    """Package modules ``mod`` imports at module level (imports inside functions are lazy)."""
    out = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            src = _resolve(mod, node)
            for a in node.names:
                full = f"{src}.{a.name}"
                out.add(full if full in NAMES else src)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in NAMES and m != mod}


TREES = {m: ast.parse(p.read_text()) for m, p in NAMES.items()}


# Private names of another library read on purpose, each with its reason (never the package's).
FOREIGN = {
    "hisparse_cupy.torch": {
        "effects._register_effectful_op": "torch's only way to make an operator an ordered effect",
        "effects._EffectType": "the effect kind that function takes",
        "op._opoverload": "a CustomOpDef's OpOverload, what that function registers",
    },
}


@pytest.mark.parametrize("mod", sorted(NAMES))
def test_no_private_names_of_other_modules(mod):
    allowed = FOREIGN.get(mod, {})
    reads = private_reads(mod, TREES[mod])
    assert [r for r in reads if r.split(": ", 1)[1] not in allowed] == []
    # the allowance is not stale: each allowed name is still read
    assert sorted(allowed) == sorted({r.split(": ", 1)[1] for r in reads} & set(allowed))


def test_the_rule_catches_a_private_read():
    tree = ast.parse("from ..cache import _dense_view\nx = step._swap\ny = self._ok\n"
                     "from ..kernels import _abi\n")
    assert sorted(private_reads("hisparse_cupy.streams.prefetch", tree)) == [
        "line 1: from hisparse_cupy.cache import _dense_view", "line 2: step._swap"]


def test_no_import_circle():
    graph = {m: imports(m, t) for m, t in TREES.items()}
    # a package's __init__ importing its submodules is not a circle by itself
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for n in sorted(graph[m]):
            if n.startswith(m + ".") and NAMES[m].name == "__init__.py":
                continue
            if state.get(n) == 1:
                raise AssertionError("import circle: " + " -> ".join(path + [n]))
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_the_circle_check_sees_the_graph():
    assert "hisparse_cupy.step" in imports("hisparse_cupy.cache", TREES["hisparse_cupy.cache"])


@pytest.mark.parametrize("path", MODULES + sorted((PKG / "kernels" / "cu").glob("*.c*")),
                         ids=lambda p: str(p.relative_to(PKG)))
def test_module_length(path):
    n = len(path.read_text().splitlines())
    budget = MAX_LINES if path.suffix == ".py" else 700
    assert n <= budget, f"{path.name}: {n} lines (budget {budget})"
