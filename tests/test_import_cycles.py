"""No import circles, in the Python package or in the Rust core: a newcomer can read either from
the bottom up, and no module's import order decides whether another one loads.

The rule for Python: every import that runs counts, at module level or inside a function (an
import moved into a function to break a cycle at load time still ties the two modules together).
Only imports under ``if TYPE_CHECKING:`` are exempt: they never run and name types for
annotations. A module importing a package's name (``from . import x``) depends on that package's
``__init__``; the implicit import of a parent package when a submodule loads does not count.

The rule for Rust: a top-level module of ``rust/dasllama/src`` (a folder or a file) depends on
another when any of its non-test code names ``crate::<other>``; test code (``tests*.rs``, and a
file's tail from ``#[cfg(test)] mod tests``) may reach anywhere.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "python" / "dasllama"
CORE = ROOT / "rust" / "dasllama" / "src"


def _modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package's __init__); a stub stands for a native module."""
    mods: dict[str, tuple[Path, bool]] = {}
    files = list(PKG.rglob("*.py")) + [p for p in PKG.rglob("*.pyi") if not p.with_suffix(".py").exists()]
    for p in files:
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        mods[".".join(parts)] = (p, is_pkg)
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(node: ast.AST, here: list[str], mods: dict[str, tuple[Path, bool]], deps: set[str]) -> None:
    """Add the modules the imports under `node` load to `deps` (`here`: the importing package)."""
    if isinstance(node, ast.If) and _is_type_checking(node.test):
        for n in node.orelse:
            _imports(n, here, mods, deps)
        return
    if isinstance(node, ast.Import):
        deps.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
        base = here[: len(here) - node.level + 1] if node.level else []
        target = ".".join(base + ([node.module] if node.module else []))
        for a in node.names:
            sub = f"{target}.{a.name}"
            deps.add(sub if sub in mods else target)
    for child in ast.iter_child_nodes(node):
        _imports(child, here, mods, deps)


def python_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for mod, (path, is_pkg) in mods.items():
        deps: set[str] = set()
        _imports(ast.parse(path.read_text(encoding="utf-8")), mod.split(".") if is_pkg else mod.split(".")[:-1], mods, deps)
        graph[mod] = {d for d in deps if d in mods and d != mod}
    return graph


def rust_graph() -> dict[str, set[str]]:
    tops = {p.stem if p.is_file() else p.name: p for p in CORE.iterdir() if (p.is_dir() or p.suffix == ".rs") and p.stem != "lib"}
    graph: dict[str, set[str]] = {}
    for name, top in tops.items():
        deps: set[str] = set()
        for f in [top] if top.is_file() else sorted(top.rglob("*.rs")):
            if f.stem.startswith("tests"):
                continue
            src = re.split(r"#\[cfg\(test\)\]\s*mod tests", f.read_text(encoding="utf-8"))[0]
            deps.update(re.findall(r"\bcrate::([a-z_][a-z0-9_]*)", src))
            for group in re.findall(r"\bcrate::\{([^}]*)\}", src):
                deps.update(re.findall(r"(?:^|,)\s*([a-z_][a-z0-9_]*)", group))
        graph[name] = {d for d in deps if d in tops and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
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
            strong(v)
    return out


def _describe(graph: dict[str, set[str]], comps: list[list[str]]) -> str:
    return "\n".join(f"{a} -> {sorted(graph[a] & set(c))}" for c in comps for a in c)


def test_the_cycle_finder_finds_a_cycle() -> None:
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(g) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graphs_see_the_imports() -> None:
    # The walkers find real edges (a finder that saw none would pass the tests below vacuously).
    py = python_graph()
    assert "dasllama.model" in py["dasllama.session"]
    assert "dasllama._native" in py["dasllama.model"]
    rs = rust_graph()
    assert {"model", "session"} <= rs["sched"]
    assert "quant" in rs["cpu"]


def test_python_package_has_no_import_cycle() -> None:
    g = python_graph()
    comps = cycles(g)
    assert not comps, "import cycles in python/dasllama:\n" + _describe(g, comps)


def test_rust_core_has_no_module_cycle() -> None:
    g = rust_graph()
    comps = cycles(g)
    assert not comps, "module cycles in rust/dasllama/src:\n" + _describe(g, comps)
