"""The package's house rules, read from its source (no GPU, nothing imported):

- no module reads another module's private names (``from .m import _x``, ``obj._x`` on anything
  but ``self`` / ``cls``; the package's private *modules*, ``from . import _abi``, are its own);
- no import circle between the package's modules;
- a folder's private module (``X/_y``) is imported only inside ``X/`` (others use ``X``'s
  face), lazy imports included, and every import of the package names what exists;
- a module's length past the hint is a warning (past twice the hint, a failure); at most 16
  modules in the package's root;
- a public module (no ``_`` in its dotted path) shows only its ``__all__``, and all of them
  together stay within a public-name budget;
- the measuring code (``hisparse_cupy.testing``: the probe, the knobs) is imported by nothing on
  a launch path;
- a function given a stream makes the CuPy arrays its work reads with that stream current.
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "hisparse_cupy"
MAX_LINES = 510  # "about 500": a hint (test_module_length)
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


def imported(mod: str, tree: ast.AST) -> list[tuple[int, str, str | None]]:
    """Every import in ``mod``, at module level or inside a function (a lazy import is an import
    all the same), as ``(line, module, name)``: ``name`` is what a ``from`` import takes from
    ``module`` (None for ``import module``, or when the name is a module itself)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            src = _resolve(mod, node)
            for a in node.names:
                full = f"{src}.{a.name}"
                out.append((node.lineno, full, None) if full in NAMES else
                           (node.lineno, src, a.name))
        elif isinstance(node, ast.Import):
            out.extend((node.lineno, a.name, None) for a in node.names)
    return out


def imports(mod: str, tree: ast.AST) -> set[str]:
    """The package's modules that ``mod`` imports, lazily or not."""
    return {m for _, m, _ in imported(mod, tree) if m in NAMES and m != mod}


def door(target: str) -> str | None:
    """The folder a module must be imported from inside of: the parent of the last private
    part of its dotted path (``X._y`` and everything under it: ``X``), or None for a module
    anyone may import."""
    parts = target.split(".")
    inner = [i for i, p in enumerate(parts) if i and _private(p)]
    return ".".join(parts[:inner[-1]]) if inner else None


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
                     "from .. import _abi\n")
    assert sorted(private_reads("hisparse_cupy.streams._prefetch", tree)) == [
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
    lazy = ast.parse("def f():\n    from ..demo import _sweep\n")
    assert imports("hisparse_cupy.streams._prefetch", lazy) == {"hisparse_cupy.demo._sweep"}


# Imports through a folder's private module from outside it that stay until the change that
# removes them (each with that change): none may be added.
DOORS_PENDING: dict[tuple[str, str], str] = {}


def through_doors(mod: str, tree: ast.AST) -> list[str]:
    """The imports in ``mod`` of a private module (``X/_y``) from outside its folder ``X``."""
    bad = []
    for line, target, _ in imported(mod, tree):
        d = door(target) if target.startswith("hisparse_cupy") else None
        if d is not None and mod != d and not mod.startswith(d + "."):
            bad.append(f"line {line}: {target}")
    return bad


@pytest.mark.parametrize("mod", sorted(NAMES))
def test_a_private_module_is_imported_only_inside_its_folder(mod):
    pending = {t for (m, t) in DOORS_PENDING if m == mod}
    bad = [b for b in through_doors(mod, TREES[mod]) if b.split(": ")[1] not in pending]
    assert bad == [], f"{mod} imports a folder's private module from outside it: {bad} " \
        f"(import what it needs from that folder's face, or move it)"


def test_the_door_rule_sees_through_faces_and_lazy_imports():
    tree = ast.parse("from .host._pool import HostKVPool\nfrom .host import HostPages\n"
                     "def f():\n    from ._kernels.launch import as_stream\n"
                     "    from .residency import _arena\n")
    assert through_doors("hisparse_cupy.cache", tree) == [
        "line 1: hisparse_cupy.host._pool", "line 5: hisparse_cupy.residency._arena"]
    assert door("hisparse_cupy._kernels.build") == "hisparse_cupy"
    assert door("hisparse_cupy.host._pool") == "hisparse_cupy.host"
    assert door("hisparse_cupy.cache") is None
    # the pending list is not stale: each entry is still an import through a door
    for (m, t), why in DOORS_PENDING.items():
        assert t in {b.split(": ")[1] for b in through_doors(m, TREES[m])}, (m, t, why)


def _module_names(mod: str) -> set[str]:
    """Names a ``from mod import name`` can take: what ``mod`` defines or imports at module
    level, its lazy table's keys, and its submodules."""
    out = set(_face(mod) or ())
    for node in TREES[mod].body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                out.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.If, ast.Try)):  # (names bound under a guard)
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    out.update((a.asname or a.name).split(".")[0] for a in sub.names)
                elif isinstance(sub, (ast.FunctionDef, ast.ClassDef)):
                    out.add(sub.name)
                elif isinstance(sub, ast.Assign):
                    out.update(n.id for t in sub.targets for n in ast.walk(t)
                               if isinstance(n, ast.Name))
    return out


@pytest.mark.parametrize("mod", sorted(NAMES))
def test_every_import_of_the_package_names_what_exists(mod):
    """Each import of a package module or name, lazy ones too (many run only on a GPU), names a
    module that exists and a name it has: a rename that missed one fails here, not on a GPU."""
    bad = []
    for line, target, name in imported(mod, TREES[mod]):
        if not target.startswith("hisparse_cupy"):
            continue
        if target not in NAMES:
            bad.append(f"line {line}: no module {target}")
        elif name is not None and name != "*" and name not in _module_names(target):
            bad.append(f"line {line}: {target} has no {name}")
    assert bad == []


@pytest.mark.parametrize("path", MODULES + sorted((PKG / "cu").glob("*.c*")),
                         ids=lambda p: str(p.relative_to(PKG)))
def test_module_length(path):
    """A file's length is a hint, not a rule: past the hint a warning (split by responsibility,
    never to meet a count); past twice the hint a failure (a file nobody can hold in mind)."""
    n = len(path.read_text().splitlines())
    hint = MAX_LINES if path.suffix == ".py" else 700
    if n > hint:
        warnings.warn(f"{path.name}: {n} lines, past the hint of {hint}", stacklevel=1)
    assert n <= 2 * hint, f"{path.name}: {n} lines (twice the hint of {hint})"


# ----------------------------------------------------------------------------- the face
MAX_ROOT_MODULES = 16
# Names the package shows: the union of the public modules' __all__ (a module is public when no
# part of its dotted path starts with "_"). Raise it in the commit that adds a public name.
PUBLIC_NAME_BUDGET = 111  # + host.consecutive_runs, host.shared_pools, demo.run_cpu (62);
# integrations.transformers, its SparseMLA and RowCache (61); residency.Residency (62); the
# demo's building blocks the examples use instead of its private modules (62): Kernels, Rig,
# cpu_config, from_args, kv_rows, parser, prompt_kv


def _public(mod: str) -> bool:
    return not any(_private(p) for p in mod.split(".")[1:])


def _face(mod: str) -> set[str] | None:
    """The names a module shows: its literal ``__all__``, or the keys of the name -> module
    table an ``__init__`` passes to its lazy loader (``_LAZY`` / ``_NAMES``)."""
    found = None
    for node in TREES[mod].body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name == "__all__" and isinstance(node.value, (ast.List, ast.Tuple)):
                return set(ast.literal_eval(node.value))
            if name in ("_LAZY", "_NAMES") and isinstance(node.value, ast.Dict):
                found = set(ast.literal_eval(node.value))
    return found


def _defined(mod: str) -> set[str]:
    out = set()
    for node in TREES[mod].body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            out.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
    return {n for n in out if not n.startswith("_")}


def test_the_root_holds_few_modules():
    root = [p.name for p in PKG.glob("*.py")]
    assert len(root) <= MAX_ROOT_MODULES, sorted(root)


PUBLIC = sorted(m for m in NAMES if _public(m) and m != "hisparse_cupy.__main__")


@pytest.mark.parametrize("mod", PUBLIC)
def test_a_public_module_shows_only_its_all(mod):
    face = _face(mod)
    assert face is not None, f"{mod} is public but has no __all__"
    assert _defined(mod) <= face, f"{mod} defines public names outside __all__: " \
        f"{sorted(_defined(mod) - face)} (underscore them, or move them to a private module)"


def test_the_public_names_stay_within_the_budget():
    names = {(m, n) for m in PUBLIC for n in (_face(m) or ())}
    assert len(names) <= PUBLIC_NAME_BUDGET, sorted(names)


# ----------------------------------------------------------------------------- streams
# A function that takes the stream its work runs on (a parameter named ``stream`` or ``s``)
# makes the arrays that work reads with that stream current: made on CuPy's current stream,
# an array's fill and the kernel reading it on another stream are unordered, and the memory
# pool may hand it a block another array left (the step fuzz's "two rows for one token",
# benchmarks/NOTES.md "An array made on the wrong stream"). The functions allowed otherwise,
# and why:
STREAM_ALLOWED = {
    # the stager's arrays are filled on the current stream and its side stream (``stream``)
    # waits for them with an event; every other reader follows the side stream
    ("hisparse_cupy.streams._predict", "__init__"),
}
ALLOCATORS = {"arange", "array", "asarray", "ascontiguousarray", "concatenate", "empty",
              "empty_like", "full", "full_like", "ones", "stack", "where", "zeros",
              "zeros_like"}


def arrays_off_stream(tree: ast.AST) -> list[tuple[str, str]]:
    """``(function, "line N: cupy.f")`` for each CuPy array made outside a ``with`` block in a
    function that takes ``stream`` or ``s``."""
    out = []

    def visit(fn, node, in_with):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            f = getattr(child, "func", None)
            if (isinstance(child, ast.Call) and isinstance(f, ast.Attribute) and not in_with
                    and isinstance(f.value, ast.Name) and f.value.id == "cupy"
                    and f.attr in ALLOCATORS):
                out.append((fn.name, f"line {child.lineno}: cupy.{f.attr}"))
            visit(fn, child, in_with or isinstance(child, ast.With))

    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            params = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
            if params & {"stream", "s"}:
                visit(fn, fn, False)
    return out


@pytest.mark.parametrize("mod", sorted(m for m in NAMES
                                       if not m.startswith(("hisparse_cupy.demo",
                                                            "hisparse_cupy.testing"))))
def test_arrays_a_call_makes_are_made_on_its_stream(mod):
    bad = [(f, w) for f, w in arrays_off_stream(TREES[mod]) if (mod, f) not in STREAM_ALLOWED]
    assert bad == []


def test_the_stream_rule_catches_an_array_made_off_the_stream():
    tree = ast.parse("def init(rid, stream):\n    run(cupy.full(1, rid), stream=stream)\n"
                     "def ok(rid, s):\n    with s:\n        x = cupy.full(1, rid)\n"
                     "def other(rid):\n    return cupy.full(1, rid)\n")
    assert arrays_off_stream(tree) == [("init", "line 2: cupy.full")]
    for mod, fn in STREAM_ALLOWED:  # the allowance is not stale: each one still needs it
        assert fn in {f for f, _ in arrays_off_stream(TREES[mod])}, (mod, fn)


def test_the_probe_stays_off_the_production_path():
    """Only the measuring code and the CLI's ``check`` (lazily) import ``hisparse_cupy.testing``;
    nothing on a launch path does, at any depth."""
    users = set()
    for mod, tree in TREES.items():
        if mod.startswith("hisparse_cupy.testing"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                src = _resolve(mod, node)
                full = {f"{src}.{a.name}" for a in node.names} | {src}
                if any(f == "hisparse_cupy.testing" or f.startswith("hisparse_cupy.testing.")
                       for f in full):
                    users.add(mod)
    assert users <= {"hisparse_cupy._cli"}, sorted(users)


def test_the_face_rules_catch_a_stray_name_and_a_probe_import(monkeypatch):
    fake = "hisparse_cupy.fake"
    monkeypatch.setitem(TREES, fake, ast.parse(
        "from .testing.probe import copy_probe\n__all__ = ['shown']\ndef shown(): pass\n"
        "def stray(): pass\n_hidden = 1\n"))
    monkeypatch.setitem(NAMES, fake, PKG / "fake.py")
    assert _face(fake) == {"shown"} and _defined(fake) == {"shown", "stray"}
    with pytest.raises(AssertionError, match="stray"):
        test_a_public_module_shows_only_its_all(fake)
    with pytest.raises(AssertionError, match="hisparse_cupy.fake"):
        test_the_probe_stays_off_the_production_path()
