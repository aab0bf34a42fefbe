"""ringmpi's import graph: no module-level cycle, no private name used across modules.

The graph is built from the source with :mod:`ast` (nothing is imported). An
import at module level (including class bodies and ``if``/``try`` blocks) runs when
the module is imported; one inside a function runs when the function is called.
The two are kept apart: a cycle of module-level imports fails (the order in which
modules are first imported then decides what exists), a cycle that needs a
function-level edge is reported by ``python tests/test_package.py`` but allowed.
A private name (``_x``, not a dunder) of another ringmpi module may not be imported
or read as ``module._x``: what a module shares it names publicly.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "ringmpi"


def module_files(pkg: Path = PKG) -> dict:
    """{dotted module name: path} of every .py file of the package."""
    out = {}
    for path in sorted(pkg.rglob("*.py")):
        parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _base(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    parts = mod.split(".")
    keep = len(parts) - node.level + (1 if is_pkg else 0)
    base = ".".join(parts[:keep])
    return f"{base}.{node.module}" if node.module else base


def _scopes(tree: ast.Module):
    """(node, at module level?) for every node of the tree."""
    stack = [(tree, True)]
    while stack:
        node, top = stack.pop()
        yield node, top
        inner = top and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        stack.extend((child, inner) for child in ast.iter_child_nodes(node))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def analyse(pkg: Path = PKG) -> tuple:
    """(module-level edges, function-level edges, private uses) of the package.

    Edges are {module: {imported module, ...}} within the package; a private use
    is a line ``"path:line: module uses other._name"``.
    """
    files = module_files(pkg)
    top, inner, private = {}, {}, []
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        aliases = {}  # local name -> ringmpi module it is bound to
        top[mod], inner[mod] = set(), set()
        where = f"{path.relative_to(pkg.parent)}"
        nodes = list(_scopes(tree))
        for node, at_top in nodes:
            edges = top[mod] if at_top else inner[mod]
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in files:
                        edges.add(a.name)
                        if a.asname:
                            aliases[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom):
                base = _base(mod, is_pkg, node)
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    if sub in files:  # from pkg import module
                        edges.add(sub)
                        aliases[a.asname or a.name] = sub
                    elif base in files:
                        edges.add(base)
                        if _private(a.name) and base != mod:
                            private.append(f"{where}:{node.lineno}: {mod} imports {base}.{a.name}")
        for node, _ in nodes:  # after every alias is known
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                target = aliases.get(node.value.id)
                if target and target != mod and _private(node.attr):
                    private.append(f"{where}:{node.lineno}: {mod} uses {target}.{node.attr}")
        top[mod].discard(mod)
        inner[mod].discard(mod)
    return top, inner, private


def cycles(edges: dict) -> list:
    """Strongly connected components with more than one module (Tarjan), sorted."""
    index, low, on, stack, out = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
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

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def test_graph_is_built():
    """The parser sees the package: known edges of both kinds are found."""
    top, inner, _ = analyse()
    assert "ringmpi.gpu.tile" in top and "ringmpi.gpu.configs" in top["ringmpi.gpu.tile"]
    assert any(inner.values()), "no function-level import found: the scope walk is broken"


def test_no_module_level_cycle():
    top, _, _ = analyse()
    found = cycles(top)
    assert not found, f"module-level import cycles: {found}"


def test_job_input_and_output_do_not_import_each_other():
    """The batch job reads through ringmpi.job.input and writes through ringmpi.job.output;
    neither side imports the other, at module level or inside a function (what both
    need lives in ringmpi.job.plan or below)."""
    top, inner, _ = analyse()
    crossing = [
        f"{m} -> {t}"
        for edges in (top, inner)
        for m, targets in edges.items()
        for t in targets
        for src, dst in (("input", "output"), ("output", "input"))
        if m.startswith(f"ringmpi.job.{src}") and t.startswith(f"ringmpi.job.{dst}")
    ]
    assert not crossing, crossing


# Private names allowed across modules (none: the fused forward and backward loaders share
# ringmpi.cpu.loader's public names since issue 21). The list must match exactly: a new use
# fails, and so does an entry that is gone.
KNOWN: set = set()


def test_no_private_names_across_modules():
    _, _, private = analyse()
    new = [p for p in private if p.split(": ", 1)[1] not in KNOWN]
    assert not new, "private names used across modules:\n" + "\n".join(new)
    gone = KNOWN - {p.split(": ", 1)[1] for p in private}
    assert not gone, f"no longer used: remove from KNOWN: {sorted(gone)}"


def test_checker_catches_a_cycle_and_a_private_import(tmp_path):
    """The checks can fail: a planted cycle and a planted private import are reported."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n\ndef f():\n    from . import c\n")
    (pkg / "sub" / "b.py").write_text(
        "from ..a import f\n\ndef g():\n    from .. import c\n    return c._hidden\n"
    )
    (pkg / "c.py").write_text("from .sub.b import _x\n")
    top, inner, private = analyse(pkg)
    assert cycles(top) == [["pkg.a", "pkg.sub.b"]]
    assert inner["pkg.a"] == {"pkg.c"} and inner["pkg.sub.b"] == {"pkg.c"}
    assert sorted(p.split(": ", 1)[1] for p in private) == [
        "pkg.c imports pkg.sub.b._x",
        "pkg.sub.b uses pkg.c._hidden",
    ]


NOT_MODULES = {
    "tests/test_package.py",
    "tests/test_docs_examples.py",
    "tests/test_job_scripts.py",
    "tests/test_stress.py",
    "tests/test_throughput_bench.py",
    "tests/gpu/test_gpu_check.py",
}


def test_every_module_has_its_tests_in_the_index():
    """docs/testing.md names the tests of every module, only files that exist, and every
    test file of the suite (in the table or among the tests of what is not a module)."""
    text = (ROOT / "docs" / "testing.md").read_text()
    rows = dict(re.findall(r"^\| `(ringmpi/[^`]+)` \| (.*) \|$", text, re.M))
    modules = {str(p.relative_to(ROOT)) for p in PKG.rglob("*.py") if p.name != "__main__.py"}
    assert modules - set(rows) == set(), (
        f"modules missing from docs/testing.md: {modules - set(rows)}"
    )
    assert set(rows) - modules == set(), f"no such module: {set(rows) - modules}"
    named = set()
    for mod, cell in rows.items():
        files = re.findall(r"`([^`]+)`", cell)
        assert files or "package docstring only" in cell, mod
        named.update(files)
    missing = {f for f in named if not (ROOT / f).is_file()}
    assert not missing, f"named in docs/testing.md but not there: {sorted(missing)}"
    suite = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")}
    unlisted = suite - named - NOT_MODULES
    assert not unlisted, f"test files in no row of docs/testing.md: {sorted(unlisted)}"


if __name__ == "__main__":
    t, i, p = analyse()
    both = {m: t[m] | i[m] for m in t}
    print("module-level cycles:", cycles(t) or "none")
    print("cycles through function-level imports:", cycles(both) or "none")
    print("private names across modules:", *(p or ["none"]), sep="\n  ")
