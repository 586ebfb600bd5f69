"""CUDA graphs of one ``LokaLinear``'s forward and backward, one pair per input shape.

Why: an FP8 layer launches about a dozen small kernels per training step (quantize the input, the
weight and the gradient, and three GEMMs), each from Python. At LRM sizes the host time of those
launches is far above the GPU time: forward + backward of an 8192x2048x1024 layer took 1.5 ms of
host time for 0.17 ms on the GPU on an H200 (``benchmarks/results/H200/2026-11-22-profile-linear.txt``).
Captured once as two CUDA graphs, a step of the layer costs two graph launches plus the copies of
the input and the incoming gradient into the graphs' static buffers.

How (the same scheme as ``torch.cuda.make_graphed_callables``, specialised to one layer):

1. After an input shape has been seen ``capture_after`` times in training (forward with autograd
   on), the layer's ``_LokaLinearFunction`` runs ``warmup`` times on a side stream (so Triton
   compiles and cuBLAS allocates its workspace outside the capture), then its forward is captured
   into one graph and ``torch.autograd.grad`` of it into another, both through detached aliases
   of the input buffer and the parameters (same memory, gradient accumulators of their own).
   Inside a capture the layer quantizes its weight on every replay (no Python-side cache: the
   optimizer updates the weight in place, the graph reads it where it lies) and counts
   non-finite scales on the device.
2. A call copies ``x`` into the static input, replays the forward graph and returns the static
   output; its backward copies ``dy`` in, replays the backward graph and returns the static
   gradients. Those are returned as held tensors, so autograd copies or adds them into
   ``.grad`` and never adopts the graph's buffer as a parameter's gradient.

Contract (what a caller must know):

* The returned output is the graph's buffer: it stays valid until this layer's next training
  forward at the same shape. A second forward of the layer before the first one's backward (a
  layer used twice in a step, or a forward whose graph is still alive) runs eagerly instead.
* Inputs of a new shape run eagerly until seen ``capture_after`` times; at most ``max_graphs``
  shapes are kept per layer (least recently used dropped), so jagged inputs whose row count
  changes every step never capture.
* Eval and ``torch.no_grad`` calls, ``torch.compile`` tracing and CPU tensors always run eagerly.
* A capture that fails (a backend that cannot be captured) is logged once with its reason and the
  layer stays eager (see ``LayerGraphs.failure``). PyTorch leaves the device's default random
  generator marked as capturing after a failed capture (every later random op on that device
  would then raise "Offset increment outside graph capture"); the layer captures one trivial
  graph afterwards to hand the generator back (:func:`release_generator`).
"""

from __future__ import annotations

import collections
import logging
import weakref
from typing import Optional, Tuple

import torch

__all__ = ["LayerGraphs", "Sightings", "capturing", "compiling", "release_generator"]

logger = logging.getLogger(__name__)
_traceback_logged = False  # the first failed capture in a process is logged with its traceback


def capturing() -> bool:
    """True while the current CUDA stream is being captured into a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def compiling() -> bool:
    """True while ``torch.compile`` (Dynamo) traces the calling code."""
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and hasattr(compiler, "is_compiling"):
        return bool(compiler.is_compiling())
    return bool(torch._dynamo.is_compiling())  # older spelling


def release_generator(device: torch.device) -> None:
    """Hand ``device``'s default CUDA generator back to eager use after a failed capture.

    A capture marks the generators it registers as capturing and unmarks them only when it ends
    cleanly; one that raises leaves the mark, and every later random op on the device fails. A
    capture of one trivial kernel sets and clears the mark again. Harmless when nothing failed.
    """
    try:
        scratch = torch.zeros(1, device=device)
        with torch.cuda.device(device):
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                scratch.add_(1)
            del graph
    except Exception as exc:  # the device itself is in error: nothing more to do here
        logger.warning("could not reset the CUDA generator of %s after a failed capture: %s", device, exc)


class Sightings:
    """How many times each key (an input shape, a plan) was seen; the most recent ``limit`` keys
    are kept, so that jagged inputs whose shape changes every step cannot grow it without bound."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._counts: "collections.OrderedDict[Tuple, int]" = collections.OrderedDict()

    def add(self, key) -> int:
        """Count one more sighting of ``key``; returns its count."""
        count = self._counts.pop(key, 0) + 1
        self._counts[key] = count
        if len(self._counts) > self.limit:
            self._counts.popitem(last=False)
        return count

    def clear(self) -> None:
        self._counts.clear()


class _CapturedStep:
    """Forward and backward graphs of one layer at one input shape, with their static buffers."""

    def __init__(self, layer, plan, x2d: torch.Tensor, warmup: int) -> None:
        from loka_torchrec.dispatch.linear import _LokaLinearFunction

        device = x2d.device
        weight, bias = layer.weight, layer.bias
        self.param_stamp = _stamp(weight, bias)
        self.static_x = torch.zeros(x2d.shape, dtype=x2d.dtype, device=device)

        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                inputs = _leaves(self.static_x, x2d.requires_grad, weight, bias)
                y = _LokaLinearFunction.apply(*inputs, layer, plan)
                torch.autograd.grad(y, [t for t in inputs if t is not None and t.requires_grad], torch.zeros_like(y))
            del inputs, y
        torch.cuda.current_stream(device).wait_stream(side)

        # Fresh leaves for the capture: their gradient accumulators are made inside the forward
        # capture, on the capture stream (see _leaves).
        self.inputs = _leaves(self.static_x, x2d.requires_grad, weight, bias)
        wanted = [t for t in self.inputs if t is not None and t.requires_grad]
        pool = torch.cuda.graph_pool_handle()
        self.fwd_graph, self.bwd_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (a data loader's pin-memory thread) do not
        # invalidate the capture, as they would in the default "global" mode.
        with torch.cuda.graph(self.fwd_graph, pool=pool, capture_error_mode="thread_local"):
            self.static_y = _LokaLinearFunction.apply(*self.inputs, layer, plan)
        self.static_dy = torch.zeros_like(self.static_y)
        with torch.cuda.graph(self.bwd_graph, pool=pool, capture_error_mode="thread_local"):
            grads = torch.autograd.grad(self.static_y, wanted, grad_outputs=self.static_dy)
        it = iter(grads)
        # One gradient per entry of self.inputs (None where that input did not require grad).
        self.static_grads = tuple(next(it) if (t is not None and t.requires_grad) else None for t in self.inputs)
        self._owner: Optional[weakref.ref] = None  # the autograd node of the forward awaiting its backward

    def busy(self) -> bool:
        """A replayed forward still waits for its backward (its output buffers are in use)."""
        return self._owner is not None and self._owner() is not None

    def forward(self, ctx, x2d: torch.Tensor) -> torch.Tensor:
        if self.static_x.data_ptr() != x2d.data_ptr():
            self.static_x.copy_(x2d)
        self.fwd_graph.replay()
        self._owner = weakref.ref(ctx)
        return self.static_y.detach()

    def backward(self, dy: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        if self.static_dy.data_ptr() != dy.data_ptr():
            self.static_dy.copy_(dy)
        self.bwd_graph.replay()
        self._owner = None
        return self.static_grads


class _GraphReplay(torch.autograd.Function):
    """``y = x W^T + b`` by replaying a captured step; gradients from the captured backward."""

    @staticmethod
    def forward(ctx, step: _CapturedStep, x2d, weight, bias):  # type: ignore[override]
        ctx.step = step
        return step.forward(ctx, x2d)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):  # type: ignore[override]
        grad_x, grad_w, grad_b = ctx.step.backward(dy)
        needs = ctx.needs_input_grad
        return (
            None,
            grad_x if needs[1] else None,
            grad_w if needs[2] else None,
            grad_b if needs[3] else None,
        )


def _leaves(static_x: torch.Tensor, x_grad: bool, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> Tuple:
    """``(x, W, b)`` as new autograd leaves over the same memory as the static input and the parameters.

    The parameters' own gradient accumulators were made by earlier eager steps on the default
    stream, and may be kept alive (by a graph still referenced, or by DDP's hooks); a backward
    captured through them would make the default stream wait on the capturing one, which CUDA
    refuses. Detached aliases have accumulators of their own, made where they are first used.
    The optimizer's in-place updates of the parameters are seen through the shared memory.
    """
    def leaf(t: Optional[torch.Tensor], grad: bool) -> Optional[torch.Tensor]:
        return None if t is None else t.detach().requires_grad_(grad)

    return (leaf(static_x, x_grad), leaf(weight, weight.requires_grad),
            leaf(bias, bias is not None and bias.requires_grad))  # fmt: skip


def _stamp(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> Tuple:
    return (weight.data_ptr(), None if bias is None else bias.data_ptr(), weight.requires_grad,
            None if bias is None else bias.requires_grad)  # fmt: skip


class LayerGraphs:
    """A layer's captured steps, keyed by input shape; see the module docstring.

    Args:
        capture_after: training forwards at one shape before it is captured (>= 1).
        max_graphs: captured shapes kept per layer.
        warmup: eager forward + backward runs on a side stream before each capture.

    Attributes:
        failure: why capturing failed for this layer (it then stays eager), else ``None``.
        captures, replays: counters, for logs and tests.
    """

    def __init__(self, capture_after: int = 2, max_graphs: int = 4, warmup: int = 2) -> None:
        if capture_after < 1 or max_graphs < 1 or warmup < 1:
            raise ValueError("LayerGraphs: capture_after, max_graphs and warmup must be >= 1")
        self.capture_after, self.max_graphs, self.warmup = capture_after, max_graphs, warmup
        self._steps: "collections.OrderedDict[Tuple, _CapturedStep]" = collections.OrderedDict()
        self._seen = Sightings(16 * max_graphs)
        self.failure: Optional[str] = None
        self.captures = 0
        self.replays = 0

    def clear(self) -> None:
        """Drop every captured step (their memory goes back to the allocator); ``failure`` too."""
        self._steps.clear()
        self._seen.clear()
        self.failure = None

    # A deep copy or pickle of a layer gets no graphs (they hold this process's device memory).
    def __deepcopy__(self, memo) -> "LayerGraphs":
        return LayerGraphs(self.capture_after, self.max_graphs, self.warmup)

    def __getstate__(self) -> dict:
        return {"capture_after": self.capture_after, "max_graphs": self.max_graphs, "warmup": self.warmup}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["capture_after"], state["max_graphs"], state["warmup"])

    def __len__(self) -> int:
        return len(self._steps)

    def run(self, layer, plan, x2d: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """``y2d`` from a graph replay, or ``None`` when this call must run eagerly."""
        if self.failure is not None or not self._capturable(x2d):
            return None
        key = (tuple(x2d.shape), x2d.dtype, x2d.requires_grad, plan)
        step = self._steps.get(key)
        if step is not None and step.param_stamp != _stamp(weight, bias):
            del self._steps[key]  # the layer's parameters were replaced: capture again
            step = None
        if step is None:
            if self._seen.add(key) < self.capture_after:
                return None
            step = self._capture(layer, plan, x2d, key)
            if step is None:
                return None
        self._steps.move_to_end(key)
        if step.busy():
            return None  # this shape's buffers still serve an earlier forward
        self.replays += 1
        return _GraphReplay.apply(step, x2d, weight, bias)

    @staticmethod
    def _capturable(x2d: torch.Tensor) -> bool:
        return x2d.is_cuda and not capturing()

    def _new_step(self, layer, plan, x2d: torch.Tensor) -> _CapturedStep:
        return _CapturedStep(layer, plan, x2d, self.warmup)

    def _capture(self, layer, plan, x2d: torch.Tensor, key: Tuple) -> Optional[_CapturedStep]:
        global _traceback_logged
        try:
            step = self._new_step(layer, plan, x2d)
        except Exception as exc:  # a backend that cannot run inside a capture: stay eager
            self.failure = f"{type(exc).__name__}: {exc}"
            logger.warning(
                "LokaLinear(%d, %d): CUDA graph capture at input %s failed, running eagerly: %s",
                layer.in_features, layer.out_features, tuple(x2d.shape), self.failure,
                exc_info=not _traceback_logged,
            )
            _traceback_logged = True
            self._steps.clear()
            if x2d.is_cuda:
                release_generator(x2d.device)
            return None
        if len(self._steps) >= self.max_graphs:
            self._steps.popitem(last=False)
        self._steps[key] = step
        self.captures += 1
        return step
