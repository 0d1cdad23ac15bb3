"""The public surface: pinned names, runnable docstring examples, the import direction (docs/design.md)."""

from __future__ import annotations

import ast
import doctest
import inspect
from pathlib import Path

import pytest

import fuselm

SRC = Path(fuselm.__file__).resolve().parent  # src/fuselm


def test_all_is_pinned():
    """Adding or removing a public name is a decision: update this list with it."""
    assert fuselm.__all__ == [
        "cross_entropy",
        "linear_cross_entropy",
        "linear_log_probs",
        "LogProbs",
        "apply_rotary",
        "swiglu",
        "geglu",
        "swiglu_packed",
        "geglu_packed",
        "rms_norm",
        "layer_norm",
        "CapturedStep",
        "nn",
        "distributed",
        "__version__",
    ]
    for name in fuselm.__all__:
        assert hasattr(fuselm, name), name
    assert fuselm.nn.__all__ == [
        "CrossEntropyLoss",
        "LinearCrossEntropyLoss",
        "LinearLogProbs",
        "SwiGLUMLP",
        "GeGLUMLP",
        "RMSNorm",
        "LayerNorm",
    ]
    assert fuselm.distributed.__all__ == [
        "cross_entropy",
        "linear_cross_entropy",
        "linear_log_probs",
        "VocabShard",
    ]
    assert isinstance(fuselm.__version__, str) and fuselm.__version__


def _public_callables():
    objs = [getattr(fuselm, n) for n in fuselm.__all__] + [getattr(fuselm.nn, n) for n in fuselm.nn.__all__]
    objs += [
        getattr(fuselm.distributed, n) for n in ("cross_entropy", "linear_cross_entropy", "linear_log_probs")
    ]
    return [o for o in objs if callable(o) and not inspect.ismodule(o)]


@pytest.mark.parametrize("obj", _public_callables(), ids=lambda o: f"{o.__module__}.{o.__qualname__}")
def test_docstring_examples_run(obj):
    """Every public function and module has a docstring example, and it runs as written."""
    tests = [t for t in doctest.DocTestFinder(recurse=False).find(obj) if t.examples]
    assert tests, f"{obj.__qualname__} has no docstring example"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted > 0
    assert result.failed == 0, (
        f"{result.failed} docstring example(s) of {obj.__qualname__} failed (see stdout)"
    )


# ---- import direction (docs/design.md section 1) ----

ABOVE_OPS = (
    "fuselm.nn",
    "fuselm.hf",
    "fuselm.trl",
    "fuselm.distributed",
    "fuselm.lora",
    "fuselm.integrations",
)
OP_FOLDERS = sorted(p.name for p in (SRC / "ops").iterdir() if p.is_dir() and (p / "__init__.py").exists())
# The modules inside public op folders (fuselm.ops.swiglu.op, ...): private to the op; a package above
# the ops that may use only their public surface imports the folder (`from fuselm.ops.swiglu import f`).
OP_PRIVATE_MODULES = tuple(
    f"fuselm.ops.{op}.{m.stem}"
    for op in OP_FOLDERS
    if not op.startswith("_")
    for m in sorted((SRC / "ops" / op).glob("*.py"))
    if m.stem != "__init__"
)
RULES = {
    "ops": ("ops", (*ABOVE_OPS, "fuselm.cli", "fuselm.demo", "transformers", "trl")),
    "ops/_common": ("ops/_common", tuple(f"fuselm.ops.{op}" for op in OP_FOLDERS if op != "_common")),
    "nn": (
        "nn",
        (
            "fuselm.hf",
            "fuselm.trl",
            "fuselm.distributed",
            "fuselm.integrations",
            "fuselm.cli",
            "transformers",
            "trl",
        ),
    ),
    "distributed": (
        "distributed",
        ("fuselm.nn", "fuselm.hf", "fuselm.trl", "fuselm.integrations", "fuselm.cli", "transformers", "trl"),
    ),
    # hf and trl sit below the engines' integrations
    "hf": ("hf", ("fuselm.integrations", "fuselm.cli")),
    "trl": ("trl", ("fuselm.integrations", "fuselm.cli")),
    # lora: framework-agnostic math over the ops' public functions (fuselm.ops.<op> packages only);
    # bitsandbytes lazily inside lora/frozen.py only (test_lora_imports_bitsandbytes_lazily)
    "lora": (
        "lora",
        (
            "fuselm.nn",
            "fuselm.hf",
            "fuselm.trl",
            "fuselm.distributed",
            "fuselm.integrations",
            "fuselm.cli",
            "fuselm.demo",
            "fuselm.ops._common",
            *OP_PRIVATE_MODULES,
            "transformers",
            "peft",
            "trl",
        ),
    ),
    # offload.py: framework-agnostic activation offloading; torch and the standard library only
    # (tests/test_offloaded_checkpoint.py checks the "only"); fuselm.hf.offload wires it into transformers
    "offload": (
        "offload.py",
        ("fuselm", "transformers", "peft", "trl", "accelerate", "bitsandbytes", "triton"),
    ),
    # graph_step.py: a captured training step; torch and the standard library only (any model's step)
    "graph_step": (
        "graph_step.py",
        ("fuselm", "transformers", "peft", "trl", "accelerate", "bitsandbytes", "triton"),
    ),
    "demo": ("demo", ("fuselm.cli",)),
    # the benchmark lab (benchmarks/fuselm_bench) sits on top of the package, outside the wheel
    "src": (".", ("tests", "kit", "fuselm_bench")),
    # an op folder imports ops/_common and itself, never a sibling op folder
    **{
        f"ops/{op}": (
            f"ops/{op}",
            tuple(f"fuselm.ops.{other}" for other in OP_FOLDERS if other not in (op, "_common")),
        )
        for op in OP_FOLDERS
        if op != "_common"
    },
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in a module's source, relative imports resolved."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((node.lineno, target))
            # `from fuselm import nn` imports the subpackage fuselm.nn
            found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
    return found


def _file_imports(path: Path) -> list[tuple[int, str]]:
    source = path.read_text(encoding="utf-8")
    return _imports(source, _module_name(path), is_package=path.name == "__init__.py")


def _forbidden(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("rule", list(RULES))
def test_import_direction(rule):
    folder, prefixes = RULES[rule]
    files = sorted((SRC / folder).rglob("*.py")) if (SRC / folder).is_dir() else [SRC / folder]
    assert files, f"no source files found under src/fuselm/{folder}"
    bad = [
        f"{path.relative_to(SRC.parent)}:{line} imports {name}"
        for path in files
        for line, name in _file_imports(path)
        if _forbidden(name, prefixes)
    ]
    assert not bad, "imports must point downward (docs/design.md section 1):\n" + "\n".join(bad)


LAB = SRC.parents[1] / "benchmarks" / "fuselm_bench"  # the benchmark lab, in the repository only


def test_the_package_holds_no_benchmark_code():
    """The wheel's packages (pyproject: every package under src/) are fuselm's alone, none of them the lab's;
    importing fuselm, its command line and its demo loads no module of the lab (`fuselm bench` loads it
    from the repository when it runs)."""
    import subprocess
    import sys

    # what setuptools' package discovery (pyproject: where = ["src"]) puts in the wheel
    packages = [
        ".".join(d.relative_to(SRC.parent).parts)
        for d in SRC.parent.rglob("*")
        if (d / "__init__.py").is_file()
    ]
    assert "fuselm" in packages and all(p == "fuselm" or p.startswith("fuselm.") for p in packages)
    assert not any("bench" in p.split(".") for p in packages), packages
    assert (LAB / "__init__.py").is_file() and not (SRC / "bench").exists()
    code = (
        "import sys, fuselm, fuselm.cli, fuselm.demo.train, fuselm.nn, fuselm.hf, fuselm.lora, "
        "fuselm.distributed\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('fuselm_bench', 'kit')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_lab_imports_the_package_not_the_tests():
    """benchmarks/fuselm_bench imports fuselm like any user (absolute imports) and never the tests, nor
    fuselm.demo: the lab's models and loop are its own (training.py, step_timing.py)."""
    bad = []
    for path in sorted(LAB.rglob("*.py")):
        module = ".".join(path.relative_to(LAB.parent).with_suffix("").parts).removesuffix(".__init__")
        for line, name in _imports(path.read_text(encoding="utf-8"), module, path.name == "__init__.py"):
            if _forbidden(name, ("tests", "kit", "fuselm.demo")):
                bad.append(f"{path.relative_to(LAB.parents[1])}:{line} imports {name}")
    assert not bad, "\n".join(bad)
    assert any(
        name == "fuselm" for _, name in _imports((LAB / "fresh_process.py").read_text(), "fuselm_bench.x")
    )


def _imports_with_scope(path: Path) -> list[tuple[int, str, bool]]:
    """(line, module, inside a function body) of every import of a file, relative imports resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    in_function: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_function.update(id(n) for n in ast.walk(node) if n is not node)
    module = _module_name(path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = _imports(ast.unparse(node), module, is_package=path.name == "__init__.py")
            found += [(node.lineno, name, id(node) in in_function) for _, name in names]
    return found


def test_lora_imports_bitsandbytes_lazily():
    """fuselm.lora imports bitsandbytes in one module (frozen.py), inside functions only: importing
    fuselm.lora never imports bitsandbytes (an optional dependency)."""
    bad = []
    for path in sorted((SRC / "lora").rglob("*.py")):
        for line, name, lazy in _imports_with_scope(path):
            if _forbidden(name, ("bitsandbytes",)) and (path.name != "frozen.py" or not lazy):
                bad.append(f"{path.relative_to(SRC.parent)}:{line} imports {name}")
    assert not bad, "bitsandbytes only lazily in fuselm/lora/frozen.py:\n" + "\n".join(bad)
    assert any(
        _forbidden(name, ("bitsandbytes",)) and lazy
        for _, name, lazy in _imports_with_scope(SRC / "lora" / "frozen.py")
    ), "the scanner must see frozen.py's lazy bitsandbytes import (else this test checks nothing)"


def test_lora_rule_forbids_private_op_modules():
    """The lora rule names every module of the public op folders (the public surface is the package)."""
    assert "fuselm.ops.swiglu.op" in OP_PRIVATE_MODULES and "fuselm.ops.swiglu.kernels" in OP_PRIVATE_MODULES
    assert not _forbidden("fuselm.ops.swiglu.gated_backward", RULES["lora"][1])
    assert _forbidden("fuselm.ops._common.guard", RULES["lora"][1])


def test_import_scanner_resolves_relative_imports():
    """The scanner sees relative and from-imports of a module under ops as the absolute names."""
    source = (
        "import transformers.models\nfrom ... import nn\nfrom ...nn.loss import X\nfrom .kernels import k\n"
    )
    names = [name for _, name in _imports(source, "fuselm.ops.some_op.op")]
    assert "transformers.models" in names
    assert "fuselm.nn" in names and "fuselm.nn.loss" in names
    assert "fuselm.ops.some_op.kernels" in names
    assert [n for _, n in _imports("from . import op", "fuselm.ops.some_op", is_package=True)] == [
        "fuselm.ops.some_op",
        "fuselm.ops.some_op.op",
    ]
    assert _forbidden("fuselm.nn.loss", ("fuselm.nn",)) and not _forbidden("fuselm.nnx", ("fuselm.nn",))


@pytest.mark.parametrize(
    "module",
    [
        "fuselm.ops._common.guard",
        "fuselm.ops._common.dispatch",
        "fuselm.ops._common.loss.options",
        "fuselm.cli",
        "fuselm.integrations.axolotl",
        "fuselm.integrations.torchtitan",
    ],
)
def test_helper_module_examples_run(module):
    """The docstring examples of the shared helpers and the command line run as written."""
    import importlib

    mod = importlib.import_module(module)
    failed, attempted = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert attempted > 0 and failed == 0, f"{module}: {failed} of {attempted} examples failed"
