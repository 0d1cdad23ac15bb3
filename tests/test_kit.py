"""The test kit's rule: no test module imports another one (shared helpers live in tests/kit, importable as
``kit`` through pyproject's ``pythonpath``), and no test edits sys.path but the one subprocess script that
has no pytest around it and the test of `fuselm bench`'s own path edit (monkeypatch undoes it)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SUBPROCESS_SCRIPTS = {"hf/test_dynamo_explain.py"}  # its SCRIPT runs in a fresh `python -c` process
# tests whose subject is a sys.path edit, undone by monkeypatch: `fuselm bench` putting the lab on the path
PATH_SUBJECT = {"bench/test_bench.py"}


def _modules_imported(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_no_test_module_imports_another():
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        tree = ast.parse(path.read_text())
        rel = path.relative_to(TESTS).as_posix()
        for name in _modules_imported(tree):
            if name.split(".")[-1].startswith("test_") or name in ("workers", "hf_models"):
                offenders.append(f"{rel} imports {name}")
        if "sys.path" in path.read_text() and rel not in {*SUBPROCESS_SCRIPTS, *PATH_SUBJECT, "test_kit.py"}:
            offenders.append(f"{rel} edits sys.path")
    assert not offenders, offenders


def test_kit_modules_hold_no_tests():
    for path in (TESTS / "kit").glob("*.py"):
        tree = ast.parse(path.read_text())
        tests = [
            n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("test")
        ]
        assert not tests, f"{path.name} defines tests: {tests}"
