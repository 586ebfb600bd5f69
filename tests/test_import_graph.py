"""No module of the project imports itself back through others: imports flow one way.

Every import counts, also those inside functions (a deferred import hides a cycle from the
interpreter, not from a reader). ``from package import name`` is an edge to the submodule
``package.name`` where that is a module, else to the package.
"""

import ast
import graphlib
import os
from typing import Dict, List, Optional, Set

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Source folder -> the package it is installed as (pyproject.toml maps kernels/).
SOURCES = {"loka_torchrec": "loka_torchrec", "loka_job": "loka_job", "kernels": "loka_torchrec.kernels"}


def _modules() -> Dict[str, str]:
    """Dotted module name -> file, for every ``.py`` file of the project's packages."""
    modules = {}
    for folder, package in SOURCES.items():
        base = os.path.join(ROOT, folder)
        for path, _, files in os.walk(base):
            for name in files:
                if name.endswith(".py"):
                    rel = os.path.relpath(os.path.join(path, name), base)[: -len(".py")]
                    dotted = ".".join([package] + rel.split(os.sep))
                    modules[dotted.removesuffix(".__init__")] = os.path.join(path, name)
    return modules


def _targets(node: ast.AST, module: str, is_package: bool) -> List[str]:
    """What an import statement names: ``import`` its modules; ``from`` its base, then each
    ``base.name`` (a submodule where ``name`` is one)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:  # relative: from the module's package, one level up per extra dot
        parts = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
        base = ".".join(parts + ([node.module] if node.module else []))
    else:
        base = node.module
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def _edges(modules: Dict[str, str]) -> Dict[str, Set[str]]:
    edges: Dict[str, Set[str]] = {}
    for module, path in modules.items():
        is_package = path.endswith("__init__.py")
        for node in ast.walk(ast.parse(open(path).read())):
            named = _targets(node, module, is_package)
            if isinstance(node, ast.ImportFrom):  # `from pkg import sub` is an edge to pkg.sub, not pkg
                named = [t for t in named[1:] if t in modules] or named[:1]
            for target in named:
                if target in modules and target != module:
                    edges.setdefault(module, set()).add(target)
    return edges


def _cycle(edges: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One import cycle (its first module repeated at the end), or ``None``."""
    try:
        graphlib.TopologicalSorter(edges).prepare()
    except graphlib.CycleError as error:
        return list(reversed(error.args[1]))  # the sorter lists a cycle against the import direction
    return None


def test_the_graph_sees_imports_inside_functions_and_finds_a_cycle():
    cycle = _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert cycle is not None and cycle[0] == cycle[-1] and sorted(cycle[1:]) == ["a", "b", "c"]
    assert _cycle({"a": {"b"}, "d": {"a", "b"}}) is None
    source = "def f():\n    from loka_job.training import data\n"
    node = ast.parse(source).body[0].body[0]
    assert _targets(node, "loka_job.x", False) == ["loka_job.training", "loka_job.training.data"]
    relative = ast.parse("from ._compat import tl").body[0]
    assert _targets(relative, "loka_torchrec.kernels.fp8_gemm", False)[0] == "loka_torchrec.kernels._compat"


def test_no_module_imports_itself_back():
    modules = _modules()
    assert "loka_job.training.data" in modules and "loka_torchrec.kernels.fp8_gemm" in modules
    cycle = _cycle(_edges(modules))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
