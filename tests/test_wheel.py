"""The distribution a user installs: the wheel holds every module and recipe of the source tree, and,
installed (not editable) where the source tree cannot be imported, it imports, its entry points run
and the TorchRec example trains with LoKA on 2 gloo ranks.

The wheel is built from a copy of the tree (an in-tree build's ``build/`` keeps files of earlier
builds, which would hide a missing package). The install goes into a fresh virtual environment that
sees this environment's packages (torch, TorchRec, ...) through a ``.pth`` path line: a plain path
entry, so the ``.pth`` files there, among them the editable install's finder, are not run, and
``loka_torchrec`` can come only from the wheel.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Source folder -> where its files are installed (kernels/ and recipes/ are relocated by setup.py).
INSTALLED_AS = {
    "loka_torchrec": "loka_torchrec",
    "loka_job": "loka_job",
    "kernels": "loka_torchrec/kernels",
    "recipes": "loka_job/recipes",
}
NOT_BUILT_FROM = (".git", ".venv", "build", "*.egg-info", "__pycache__", "outputs", "multirun", "runs", "regenerated",
                  "tests", "benchmarks")  # fmt: skip


def _run(cmd, **kwargs):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kwargs)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel ``pip wheel`` builds from a copy of the source tree."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*NOT_BUILT_FROM))
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(source)])
    (path,) = (tmp / "dist").glob("loka_torchrec-*.whl")
    return path


def _source_files():
    """Installed path of every module and recipe file of the source tree."""
    files = set()
    for folder, installed in INSTALLED_AS.items():
        for directory, subdirs, names in os.walk(os.path.join(ROOT, folder)):
            subdirs[:] = [d for d in subdirs if d != "__pycache__"]
            rel = os.path.relpath(directory, os.path.join(ROOT, folder))
            for name in names:
                if name.endswith((".py", ".yaml")):
                    files.add(os.path.normpath(os.path.join(installed, rel, name)))
    return files


@pytest.mark.slow
def test_the_wheel_holds_every_module_and_recipe_of_the_source_tree(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = _source_files()
    assert {"loka_torchrec/gemm/recipes.py", "loka_torchrec/kernels/fp8_gemm.py", "loka_job/recipes/model/dlrm.yaml"} <= expected
    assert not expected - names, f"missing from the wheel: {sorted(expected - names)}"
    tops = {name.split("/")[0] for name in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"loka_torchrec", "loka_job"}, tops
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "loka-train = loka_job.train:main" in text and "loka-inspect = loka_torchrec.probe.inspect:main" in text


IMPORT_EVERY_MODULE = """
import importlib, importlib.resources, json, pkgutil, sys
import loka_torchrec, loka_job.recipes
modules = []
for package in (loka_torchrec, importlib.import_module("loka_job")):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)
        modules.append(info.name)
recipe = importlib.resources.files("loka_job.recipes") / "model" / "dlrm.yaml"
print(json.dumps({"file": loka_torchrec.__file__, "modules": modules, "recipe": recipe.is_file()}))
"""


@pytest.mark.slow
def test_the_installed_wheel_imports_runs_loka_inspect_and_the_torchrec_example(wheel, tmp_path):
    env_dir = tmp_path / "env"
    _run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)])
    python = str(env_dir / "bin" / "python")
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip()
    stack = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    with open(os.path.join(site, "torch_stack.pth"), "w") as f:  # this environment's packages, as path entries
        f.write("\n".join(stack) + "\n")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", str(wheel)])

    elsewhere = tmp_path / "elsewhere"  # the working directory: not the source tree
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    found = json.loads(_run([python, "-P", "-c", IMPORT_EVERY_MODULE], cwd=elsewhere, env=env).splitlines()[-1])
    assert found["file"] == os.path.join(site, "loka_torchrec", "__init__.py"), found["file"]
    assert {"loka_torchrec.gemm.recipes", "loka_torchrec.kernels.fp8_gemm", "loka_job.train"} <= set(found["modules"])
    assert found["recipe"]

    usage = _run([str(env_dir / "bin" / "loka-inspect"), "--help"], cwd=elsewhere, env=env)
    assert usage.startswith("usage: loka-inspect")

    shutil.copy(os.path.join(ROOT, "scripts", "torchrec_dlrm_example.py"), elsewhere)  # as a user's own script
    run_dir = elsewhere / "run"
    cmd = [python, "-P", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "torchrec_dlrm_example.py",
           "--steps", "10", "--probe_warmup", "4", "--run_dir", str(run_dir)]  # fmt: skip
    out = _run(cmd, cwd=elsewhere, env=env)
    assert f"10 steps; LoKA's plan and logs: {run_dir}" in out
    plan = json.loads((run_dir / "dispatch_plan.json").read_text())
    assert 0 < plan["step"] <= 4 and len(plan["layers"]) == 5
