"""Structural rules of the package (ARCHITECTURE.md), checked by parsing every module with ``ast``.

* model code, ``optim/`` and ``precision.py`` never import ``ndtrain.parallel`` (also not inside
  a function): parallelism is applied from outside;
* no import cycle among ``ndtrain`` modules, counting top-level and function-level imports (a
  function-local import that only dodges a cycle is still a cycle);
* no two-way imports between folders: at every level of the package, its sub-folders and modules
  (``ndtrain.train`` vs ``ndtrain.parallel``; ``parallel.tp`` vs ``parallel.zero``) import each other
  one way only. Imports under ``if TYPE_CHECKING:`` (annotations) do not run and do not count;
* the planner imports nothing of the trainer (only pure leaves: config types, rules, mixer spec);
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


def _runtime_nodes(tree: ast.AST):
    """Every node except those under ``if TYPE_CHECKING:`` (type-only imports never run)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", getattr(child.test, "attr", "")) == "TYPE_CHECKING":
                todo.extend(child.orelse)
                continue
            todo.append(child)


def _imports(name: str) -> set[str]:
    """``ndtrain`` modules imported anywhere in module ``name`` (``from a import b`` counts a.b when
    that is a module, else a); relative imports resolved."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
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
        if name.startswith(("ndtrain.model", "ndtrain.optim")) or name == "ndtrain.precision":
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
    monkeypatch.setitem(GRAPH, "ndtrain.optim", GRAPH["ndtrain.optim"] | {"ndtrain.train.metrics"})
    monkeypatch.setitem(GRAPH, "ndtrain.train.metrics", GRAPH["ndtrain.train.metrics"] | {"ndtrain.optim"})
    assert any({"ndtrain.optim", "ndtrain.train.metrics"} <= set(c) for c in _find_cycles())


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


def _unit(module: str, package: str) -> str | None:
    """The child of ``package`` that ``module`` lives in (``ndtrain.train.loop`` in ``ndtrain`` ->
    ``ndtrain.train``), None outside ``package``."""
    if not module.startswith(package + "."):
        return None
    return package + "." + module[len(package) + 1:].split(".")[0]


def _folder_loops(graph: dict[str, set[str]]) -> list[str]:
    """Pairs of siblings (folders or modules under one package) that import each other."""
    packages = {n for n, p in MODULES.items() if p.name == "__init__.py"}
    loops = []
    for pkg in sorted(packages):
        edges = {(a, b) for src, deps in graph.items() for dst in deps
                 if (a := _unit(src, pkg)) and (b := _unit(dst, pkg)) and a != b}
        loops += [f"{a} <-> {b}" for a, b in sorted(edges) if a < b and (b, a) in edges]
    return loops


def test_no_two_way_imports_between_folders():
    loops = _folder_loops(GRAPH)
    assert not loops, "folders that import each other:\n" + "\n".join(loops)


def test_the_folder_check_finds_a_planted_loop():
    """The check itself: one planted edge parallel -> train (train already imports parallel)."""
    planted = dict(GRAPH)
    planted["ndtrain.parallel.comm"] = GRAPH["ndtrain.parallel.comm"] | {"ndtrain.train.metrics"}
    assert "ndtrain.parallel <-> ndtrain.train" in _folder_loops(planted)


TRAINER_SIDE = ("ndtrain.train", "ndtrain.cli", "ndtrain.calibration", "ndtrain.checkpoint", "ndtrain.fault",
                "ndtrain.data", "ndtrain.model", "ndtrain.ops", "ndtrain.hf", "ndtrain.inference", "ndtrain.tools")


def test_planner_imports_nothing_of_the_trainer():
    bad = [f"{n} imports {d}" for n, deps in GRAPH.items() if n.startswith("ndtrain.planner")
           for d in sorted(deps) if d.startswith(TRAINER_SIDE) or d == "ndtrain.parallel.parallelize"]
    assert not bad, "\n".join(bad)


def test_every_module_is_in_the_architecture_doc():
    """docs/architecture.md's "Every module" table names each module of the package (its rows:
    "| `<path relative to ndtrain/>` | <first sentence of the module docstring> |")."""
    doc = (PKG.parent / "docs" / "architecture.md").read_text()
    missing = [str(p.relative_to(PKG)) for p in MODULES.values() if f"| `{p.relative_to(PKG)}` |" not in doc]
    assert not missing, "modules missing from docs/architecture.md's module table:\n" + "\n".join(missing)
