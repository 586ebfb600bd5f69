"""The FP8 kernels a configuration offers on a device, and the check that a named one can run there."""

from __future__ import annotations

import logging
from typing import List

import torch

from loka_torchrec.dispatch.config import DispatchConfig
from loka_torchrec.evidence import KernelChoice
from loka_torchrec.gemm.backends import backend_names, get_backend
from loka_torchrec.gemm.backends.base import BackendUnavailableError

__all__ = ["require_runnable", "resolve_candidates"]

logger = logging.getLogger("loka_torchrec.dispatch")


def resolve_candidates(config: DispatchConfig, device: torch.device) -> List[KernelChoice]:
    """The FP8 candidates of ``config`` that can run on ``device``.

    ``"auto"`` expands to every recipe of every registered FP8 backend that is available here
    and declares ``in_auto`` (``emulated`` and ``triton`` excluded: name them to use them). A candidate named explicitly that cannot run here raises
    :class:`BackendUnavailableError` naming it and why, unless ``config.fallback == "bf16"``
    (then it is dropped with a warning).
    """
    out: List[KernelChoice] = []
    for name in config.candidates:
        if name == "auto":
            for backend_name in backend_names():
                if backend_name in ("bf16", "emulated"):
                    continue
                backend = get_backend(backend_name)
                if backend.in_auto and backend.availability(device).ok:
                    out.extend(
                        KernelChoice(backend_name, r) for r in backend.auto_recipes(device)
                        if not config.compiled or backend.compile_reason(r) is None
                    )
            continue
        choice = KernelChoice.parse(name, field="dispatch.candidates")
        if require_runnable(choice, config, device, field="dispatch.candidates"):
            out.append(choice)
    return sorted(set(out))


def require_runnable(choice: KernelChoice, config: DispatchConfig, device: torch.device, *, field: str) -> bool:
    """Check that ``choice`` can run on ``device`` (compiled, with ``config.compiled``); raise or warn
    per ``config.fallback``: ``False`` where it cannot and ``fallback`` is ``"bf16"``."""
    backend = get_backend(choice.backend)  # ValueError naming the unknown backend
    if choice.recipe not in backend.recipes:
        raise ValueError(f"{field}: backend {choice.backend!r} has no recipe {choice.recipe!r}; it has {', '.join(backend.recipes)}")
    available = backend.availability(device)
    problem = None if available.ok else f"backend {choice.backend!r} is unavailable on {device}: {available.reason}"
    if problem is None and config.compiled:
        problem = backend.compile_reason(choice.recipe)
    if problem is None:
        return True
    message = f"{field}: {problem}"
    if config.fallback == "error":
        raise BackendUnavailableError(message + " (set dispatch.fallback=bf16 to run such GEMMs in bf16 instead)")
    logger.warning("%s; falling back to bf16 (dispatch.fallback=bf16)", message)
    return False
