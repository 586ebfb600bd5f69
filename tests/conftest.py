import os
import shutil

# Inductor's CPU code made cheap to build (set before torch loads; the jobs the tests start inherit
# it). The graphs, graph breaks and recompiles that the tests assert on do not depend on these: they
# change only the C++ that Inductor writes for a graph and how g++ builds it, which took most of a
# compile test's time on 2 CI cores (the compiled DHEN job: 171 CPU-s with -O0 alone, 87 with all three):
# - the kernels at -O0 instead of -O3;
os.environ.setdefault("TORCHINDUCTOR_DEBUG_COMPILE", "1")
# - scalar kernels only: no at::vec variant of each loop to generate and parse, and no test builds
#   probing which SIMD instruction sets the machine has;
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
# - the graph's wrapper in C++ with its kernels: one g++ run per graph instead of one per kernel
#   (each run loads the 150 MB precompiled header, about 0.7 s of a CI core). Not on a GPU machine:
#   Inductor records no CUDA graphs for a graph with a C++ wrapper, and the GPU tests assert on them.
if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TORCHINDUCTOR_CPP_WRAPPER", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Keep the two CI cores for the processes a test starts.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches empty before and after the test: compile counts and graphs start from nothing
    (a module's tests take it with ``pytestmark = pytest.mark.usefixtures("fresh_dynamo")``)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# The longest tests (seconds each takes in the 2-worker run on 2 CI cores with cold caches, longest
# first), run first: pytest-xdist hands tests out in collection order, so that the two workers end
# together instead of one worker starting a minute-long job when the other has nothing left. A
# test's position does not change what it asserts.
LONGEST_FIRST = (
    "tests/test_train_job.py::test_dhen_and_hstu_recipes_train_through_the_entry_point",  # 79 + 75 s compiled, 2 x 7 s
    "tests/test_compile.py",  # 44 s, Inductor
    "tests/test_e2e_compare.py::test_cpu_smoke_run_writes_json_md_and_plot",  # 31 s
    "tests/test_multirank.py::test_the_forced_race_aborts_a_rank_that_returns_and_not_one_that_ends_with_exit_process",  # 23 s
    "tests/test_faults.py",  # 23 s, 10 runs of the entry point, all on one worker
    "tests/test_production_faults.py",  # 11 runs of the entry point (2 ranks), all on one worker
    "tests/test_train_job.py",  # 66 s, the other runs of the entry point
    "tests/test_dmp_collection.py",  # 20 s, 4 runs of the entry point
    "tests/test_wheel.py",  # 30 s: builds, installs and runs the wheel
    "tests/test_torchrec_example.py",  # 20 s
    "tests/test_mods_functional.py::test_rewritten_scopes_and_dispatch_sites_compile_fullgraph_without_graph_breaks",  # 17 s
    "tests/test_sites.py::test_sites_compile_fullgraph_without_graph_breaks",  # 12 s
    "tests/test_models_dmp.py",  # 8 s
)


# Modules whose tests share an expensive module-scoped fixture (a 2-rank job, a subprocess, a
# reference run): pytest-xdist runs each of them on one worker, so that the fixture runs once.
SHARED_FIXTURE_MODULES = (
    "tests/test_comms_distributed.py",  # ranks: the 2-rank DMP job
    "tests/test_comms_kernel.py",  # interpreted: the Triton interpreter's subprocess
    "tests/test_faults.py",  # uninterrupted: the reference run
    "tests/test_wheel.py",  # wheel: the built wheel
    "tests/test_probe_inspect.py",  # run_dir, loka_run: a Probe run and a whole LoKA run
    "tests/test_production_faults.py",  # checkpointed: the run the resumes start from
)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: no-op without it
def pytest_xdist_make_scheduler(config, log):
    """``-n N`` (``--dist load``): tests are handed out one at a time, except those of
    :data:`SHARED_FIXTURE_MODULES`, handed out a module at a time. (``--dist loadgroup`` with
    ``xdist_group`` marks would do it, but pytest-xdist 3.8 cannot rename pytest 9's test ids.)"""
    if config.getvalue("dist") != "load":
        return None  # another --dist: pytest-xdist's own scheduler
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            module = nodeid.split("::", 1)[0]
            return module if module in SHARED_FIXTURE_MODULES else nodeid

    return Scheduling(config, log)


def _start_rank(item) -> int:
    """Where ``item`` starts: its place in :data:`LONGEST_FIRST`, or after all of them."""
    return next((i for i, prefix in enumerate(LONGEST_FIRST) if item.nodeid.startswith(prefix)), len(LONGEST_FIRST))


def pytest_collection_modifyitems(config, items):
    items.sort(key=_start_rank)  # stable: collection order within each rank
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (on the GPU machine: bash scripts/device_benchmarks.sh gpu_tests)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
