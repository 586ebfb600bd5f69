import os

# Inductor's CPU (C++) kernels built at -O0 instead of -O3 (set before torch loads; the jobs the
# tests start inherit it): on 2 CI cores g++ -O3 took about a third of the compile tests' time. The
# generated code, and the graphs, graph breaks and recompiles the tests assert on, are the same.
os.environ.setdefault("TORCHINDUCTOR_DEBUG_COMPILE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Keep the two CI cores for the processes a test starts.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (on the GPU machine: bash scripts/device_benchmarks.sh gpu_tests)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
