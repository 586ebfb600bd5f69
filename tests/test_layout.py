"""The library stands apart from the reference job: no Hydra, no job modules, no import cycles."""

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB_ONLY = ("hydra", "omegaconf", "torchmetrics", "tqdm", "loka_job")


def test_the_library_imports_and_prepares_without_the_jobs_dependencies(tmp_path):
    """Every library module imports, and prepare() runs, with Hydra & co. made unimportable."""
    blocked = "; ".join(f"sys.modules[{name!r}] = None" for name in JOB_ONLY)
    code = f"""
import sys, pkgutil, importlib; {blocked}
import torch, loka_torchrec
for info in pkgutil.walk_packages(loka_torchrec.__path__, "loka_torchrec."):
    importlib.import_module(info.name)
model = torch.nn.Sequential(torch.nn.Linear(16, 8))
loka = loka_torchrec.prepare(model, loka_torchrec.LokaConfig(enabled=True), run_dir=sys.argv[1])
with loka.step(1):
    model(torch.randn(4, 16)).sum().backward()
loka.close()
print("ok", len(loka.report.converted))
"""
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300, cwd="/")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-2:] == ["ok", "1"]


def _imports(path: str):
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


def test_no_library_module_names_the_job():
    for folder, _, files in os.walk(os.path.join(ROOT, "loka_torchrec")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                bad = [m for m in _imports(path) if m.split(".")[0] in JOB_ONLY]
                assert not bad, f"{os.path.relpath(path, ROOT)} imports {bad}"


def _units():
    """Import edges between the library's parts (subpackages and top-level modules), every import
    counted, also those inside functions."""
    edges = {}
    lib = os.path.join(ROOT, "loka_torchrec")
    for folder, _, files in os.walk(lib):
        for name in files:
            if not name.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(folder, name), lib)
            unit = rel.split(os.sep)[0].removesuffix(".py")
            for module in _imports(os.path.join(folder, name)):
                parts = module.split(".")
                if parts[0] == "loka_torchrec" and len(parts) > 1 and parts[1] != unit:
                    edges.setdefault(unit, set()).add(parts[1])
    return edges


def test_probe_and_dispatch_meet_only_at_evidence_and_the_parts_form_no_cycle():
    edges = _units()
    assert "dispatch" not in edges.get("probe", set()) and "probe" not in edges.get("dispatch", set()), edges
    seen, stack = set(), []

    def visit(unit):  # depth-first search for a back edge
        if unit in stack:
            raise AssertionError(f"import cycle: {' -> '.join(stack[stack.index(unit):] + [unit])}")
        if unit in seen:
            return
        stack.append(unit)
        for other in sorted(edges.get(unit, ())):
            visit(other)
        stack.pop()
        seen.add(unit)

    for unit in sorted(edges):
        visit(unit)
