import os

import pytest
import torch

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
