"""Structural rules of the package (ARCHITECTURE.md), checked by parsing every module with ``ast``.

* model code, ``optim.py`` and ``precision.py`` never import ``ndtrain.parallel`` (also not inside
  a function): parallelism is applied from outside;
* no import cycle among ``ndtrain`` modules, counting top-level and function-level imports (a
  function-local import that only dodges a cycle is still a cycle);
* no file in ``ndtrain/`` over 400 lines, no function over 80 lines.
"""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "ndtrain"
MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 80


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _imports(name: str) -> set[str]:
    """``ndtrain`` modules imported anywhere in module ``name`` (``from a import b`` counts a.b when
    that is a module, else a); relative imports resolved."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = package.split(".")
                base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:  # "ndtrain.parallel.comm.all_reduce" -> the module
                t = t.rpartition(".")[0]
            if t.startswith("ndtrain") and t != name:
                out.add(t)
    return out


GRAPH = {name: _imports(name) for name in MODULES}


def _parents(name: str) -> set[str]:
    """Importing a.b.c runs a/__init__ and a/b/__init__ first: those are edges too."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))} & set(MODULES)


def test_model_optim_precision_never_import_parallel():
    bad = []
    for name, deps in GRAPH.items():
        if name.startswith("ndtrain.model") or name in ("ndtrain.optim", "ndtrain.precision"):
            bad += [f"{name} imports {d}" for d in sorted(deps) if d.startswith("ndtrain.parallel")]
    assert not bad, "\n".join(bad)


def _find_cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(GRAPH[v] - _parents(v) - {v}):
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

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    cycles = _find_cycles()
    assert not cycles, "import cycles (top-level or function-level imports):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_a_cycle(monkeypatch):
    """The check itself: a fake a -> b -> a edge pair is reported."""
    monkeypatch.setitem(GRAPH, "ndtrain.optim", GRAPH["ndtrain.optim"] | {"ndtrain.metrics"})
    monkeypatch.setitem(GRAPH, "ndtrain.metrics", GRAPH["ndtrain.metrics"] | {"ndtrain.optim"})
    assert any({"ndtrain.optim", "ndtrain.metrics"} <= set(c) for c in _find_cycles())


def test_file_length():
    long = [f"{p.relative_to(PKG.parent)}: {n} lines" for p in MODULES.values()
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert not long, f"files over {MAX_FILE_LINES} lines:\n" + "\n".join(long)


def test_function_length():
    long = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PKG.parent)}:{node.lineno} {node.name}: {n} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)
