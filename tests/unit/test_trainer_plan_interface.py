"""The trainer sees one declared plan interface (checked on ``ndtrain/train/trainer.py``'s syntax tree).

* no ``type(...)`` / ``isinstance`` / ``hasattr`` / ``getattr`` calls: what the trainer needs of the
  gradient synchroniser is declared on ``GradSync`` / ``OuterSync`` (``ndtrain.parallel.api``);
* no branch on a pipeline degree (``.pp``) and no DiLoCo / DDP class named: ``parallelize`` builds
  them and the plan says what differs;
* clipping in two hops: the trainer calls ``GradSync.clip_grad_norm``, and every ``GradSync``
  implementation's ``clip_grad_norm`` calls ``ndtrain.optim.clip_grad_norm`` itself;
* the rollback takes the declared ``Restorable`` protocol: ``fault.bad_steps`` names nothing of
  ``ndtrain.train``.
A planted ``hasattr`` / ``.pp`` in a copy of the source is found (the checks can fail).
"""
from __future__ import annotations

import ast
from pathlib import Path

import ndtrain

ROOT = Path(ndtrain.__file__).parent


def _violations(src: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                "type", "isinstance", "hasattr", "getattr"):
            out.append(f"line {node.lineno}: {node.func.id}()")
        if isinstance(node, ast.Attribute) and node.attr == "pp":
            out.append(f"line {node.lineno}: .pp")
        if isinstance(node, ast.Name) and node.id in ("DiLoCo", "DataParallel"):
            out.append(f"line {node.lineno}: {node.id}")
    return out


def test_trainer_asks_the_plan_not_the_axes():
    src = (ROOT / "train" / "trainer.py").read_text()
    assert _violations(src) == []
    planted = src.replace("self.outer = self.plan.outer", "self.outer = self.plan.outer if hasattr(self.dp, 'x') "
                          "and self.mesh.dims.pp == 1 else None")
    assert len(_violations(planted)) == 2


def _calls(fn: ast.FunctionDef) -> set[str]:
    return {n.func.id if isinstance(n.func, ast.Name) else n.func.attr
            for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute))}


def test_clipping_is_two_hops_from_the_trainer():
    trainer = ast.parse((ROOT / "train" / "trainer.py").read_text())
    assert any(isinstance(n, ast.Attribute) and n.attr == "clip_grad_norm" and isinstance(n.value, ast.Attribute)
               and n.value.attr == "dp" for n in ast.walk(trainer))  # self.dp.clip_grad_norm
    impls = 0
    for path in (ROOT / "parallel" / "dp" / "grad_sync.py", ROOT / "parallel" / "zero" / "sharded_state.py"):
        tree = ast.parse(path.read_text())
        imported = any(isinstance(n, ast.ImportFrom) and n.module == "ndtrain.optim"
                       and "clip_grad_norm" in {a.name for a in n.names} for n in ast.walk(tree))
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef) and fn.name == "clip_grad_norm":
                impls += 1
                assert imported and "clip_grad_norm" in _calls(fn), path  # straight into optim
    assert impls == 2


def test_the_rollback_imports_nothing_of_the_training_loop():
    tree = ast.parse((ROOT / "fault" / "bad_steps.py").read_text())
    mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    mods |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any(m and m.startswith(("ndtrain.train", "ndtrain.checkpoint")) for m in mods), mods
    assert "Restorable" in {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
