"""GEMM backends behind one registry.

Importing this package registers every backend. ``bf16``, ``emulated`` and ``scaled_mm`` are
pure torch; ``fbgemm``, ``te`` and ``triton`` import their libraries lazily and report
themselves unavailable, with the reason, where those libraries or a GPU are missing.
"""

from loka_torchrec.gemm.backends.base import (
    Availability,
    BackendUnavailableError,
    GemmBackend,
    backend_names,
    get_backend,
    register_backend,
)
from loka_torchrec.gemm.backends import high_precision, emulated, scaled_mm  # noqa: F401  (registers)
from loka_torchrec.gemm.backends import fbgemm, transformer_engine, triton  # noqa: F401  (registers; lazy imports)

__all__ = [
    "Availability",
    "BackendUnavailableError",
    "GemmBackend",
    "backend_names",
    "get_backend",
    "register_backend",
]
