"""Process-group set-up for ``torchrun`` (or a single process) on CPU/gloo or CUDA/nccl, and the
end of a rank's process.

Why a rank ends with :func:`exit_process` (``os._exit``) rather than by returning: with torch 2.13
and Python 3.11 a rank could die with SIGABRT ("terminate called without an active exception") at
interpreter exit (2 of 40 runs of the plain TorchRec example on a loaded 2-core machine, about
1 job in 50 in CI). A gloo ``Work`` keeps Python objects alive: the ``contextvars.Context`` that
``Tensor.backward`` stashes in the thread-local state (``torch.autograd.graph._engine_run_backward``),
which every collective issued during a backward copies (DDP's gradient all-reduce, TorchRec's
backward all-to-alls), and the Python objects of its tensors once Python has let go of them.
When the gloo worker thread that finished a ``Work`` holds its last reference, ``~AsyncWork``
(``noexcept``) releases those objects on that thread and takes the GIL to do it. If the main
thread is starting interpreter finalization meanwhile, CPython 3.11 ends the worker with
``pthread_exit`` in ``take_gil``, and the forced unwind through the ``noexcept`` frame calls
``std::terminate``. ``destroy_process_group`` does not stop gloo's worker threads (gloo's
``shutdown`` is a no-op) and no Python call waits for them, so the one way to rule the race out
is not to finalize: after an orderly shutdown (:func:`shutdown_distributed`) the rank flushes its
output and ends with ``os._exit``. ``docs/reliability.md`` has the core-file stacks and
``scripts/gloo_exit_abort.py`` reproduces it with torch alone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from datetime import timedelta
from typing import Any, Iterable, List, NoReturn

import torch
import torch.distributed as dist

__all__ = ["DistContext", "exit_process", "init_distributed", "pipeline_in_flight", "resolve_device", "shutdown_distributed"]


@dataclasses.dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(name: str) -> torch.device:
    """``"auto"`` -> cuda if a GPU is visible else cpu; ``"cpu"`` / ``"cuda"`` as given."""
    if name not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device: expected one of auto, cpu, cuda; got {name!r}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but no CUDA GPU is visible (use device=cpu)")
    return torch.device(name)


def init_distributed(device_name: str = "auto", *, timeout_s: int = 600) -> DistContext:
    """Initialize the default process group from torchrun's environment, or a 1-rank group.

    CPU uses gloo, CUDA uses nccl with ``LOCAL_RANK`` picking the GPU.
    """
    device = resolve_device(device_name)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPUs are visible")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:  # a plain single process: make a 1-rank group
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    return DistContext(rank, world_size, local_rank, local_world_size, device, backend)


def pipeline_in_flight(pipeline: Any) -> List[Any]:
    """The input distributions a TorchRec train pipeline has issued and not yet used: the
    awaitables of the prefetched batches (``TrainPipelineContext.input_dist_tensors_requests``),
    whose all-to-alls may still be running when the training loop stops. Reads TorchRec 1.8's
    ``pipeline.contexts``: a TorchRec that renames it fails here, loudly."""
    return [request for context in pipeline.contexts for request in context.input_dist_tensors_requests.values()]


def shutdown_distributed(pending: Iterable[Any] = ()) -> None:
    """End the default process group in order: wait for ``pending`` (awaitables or ``Work`` of
    collectives still in flight, e.g. :func:`pipeline_in_flight`), then a barrier, so that no rank
    leaves while a peer is still in a collective with it, then ``destroy_process_group``. A no-op
    without a process group."""
    for request in pending:
        request.wait()
    if not dist.is_initialized():
        return
    if dist.get_world_size() > 1:
        dist.barrier()
    dist.destroy_process_group()


def exit_process(code: int = 0) -> NoReturn:
    """End this process now with ``code``, without interpreter finalization (see the module's
    docstring for the gloo abort this avoids): stdout, stderr and the logging handlers are flushed
    first, since ``os._exit`` runs no exit handlers. Call it last, after
    :func:`shutdown_distributed`."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed or replaced streams
            pass
    logging.shutdown()
    os._exit(code)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
