"""Shared plumbing of the kernel modules: the Triton import guard and launch-time checks.

Each kernel module imports ``triton`` and ``tl`` from here. Where Triton is missing (a CPU
machine without it) they are stand-ins that let the module import, so its pure-torch reference
stays usable; every launcher calls :func:`require_triton` first and fails with the import error.

Triton picks the compiled or the interpreted (``TRITON_INTERPRET=1``) implementation when a kernel
is decorated, i.e. when its module is imported; :data:`INTERPRET` records that choice so that
launchers accept CPU tensors exactly when the kernels run in the interpreter.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Optional

import torch

from loka_torchrec.fp8 import Fp8Format

__all__ = [
    "INTERPRET",
    "TRITON_IMPORT_ERROR",
    "triton",
    "tl",
    "require_triton",
    "check_launch_device",
    "device_guard",
    "fp8_format",
    "next_power_of_2",
    "tracing",
]


class _MissingTriton:
    """Stands in for ``triton`` and ``triton.language`` so kernel modules import without Triton.

    Attribute access returns the stand-in itself; calling it with one function returns that
    function (``@triton.jit``), any other call returns the stand-in (``triton.autotune(...)``,
    ``triton.Config(...)``), so decorators and config lists evaluate to harmless objects.
    """

    def __getattr__(self, name: str) -> "_MissingTriton":
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return self


try:
    import triton
    import triton.language as tl

    TRITON_IMPORT_ERROR: Optional[str] = None
except Exception as exc:  # ImportError, or a broken install (e.g. a missing CUDA library)
    triton = _MissingTriton()  # type: ignore[assignment]
    tl = _MissingTriton()  # type: ignore[assignment]
    TRITON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""Whether the kernels of this process were decorated for the Triton CPU interpreter."""

_KERNEL_FORMATS = (Fp8Format.E4M3, Fp8Format.E5M2)


def require_triton(what: str) -> None:
    """Raise a clear error when Triton is not importable."""
    if TRITON_IMPORT_ERROR is not None:
        raise RuntimeError(f"{what} needs Triton, which is not importable here ({TRITON_IMPORT_ERROR})")


def check_launch_device(t: torch.Tensor, name: str) -> None:
    """Kernels run on CUDA tensors, or on CPU tensors under the Triton interpreter."""
    if t.is_cuda or (INTERPRET and t.device.type == "cpu"):
        return
    where = "CUDA" + (" (or CPU under TRITON_INTERPRET=1)" if not INTERPRET else " or CPU")
    raise ValueError(f"{name}: expected a {where} tensor, got one on {t.device}")


_NO_GUARD = contextlib.nullcontext()


def device_guard(t: torch.Tensor):
    """``torch.cuda.device(t.device)`` where ``t`` is not on the current device (Triton launches there)."""
    if t.is_cuda and t.device.index is not None and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return _NO_GUARD


def fp8_format(fmt: "Fp8Format | str", *, field: str = "fmt") -> Fp8Format:
    """Parse an FP8 format the kernels can write (E4M3 or E5M2, the OCP formats of NVIDIA GPUs)."""
    fmt = Fp8Format.parse(fmt, field=field)
    if fmt not in _KERNEL_FORMATS:
        raise ValueError(f"{field}: the Triton kernels write e4m3 or e5m2, not {fmt.value}")
    return fmt


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def tracing() -> bool:
    """Whether ``torch.compile`` is tracing the caller (then kernels go through their custom ops).

    In eager mode the launchers are called directly: a ``torch.library`` op adds tens of
    microseconds of dispatch per call, as much as a small GEMM takes on the GPU.
    """
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling())
