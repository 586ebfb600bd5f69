"""CUDA graphs of whole dense modules: each one's forward and backward replayed as two graphs.

Why: at LRM sizes a training step is host-bound. On one H100, a DHEN-large step ran 14.2 ms of
GPU kernels in a 29.5 ms step, the GPU idle 68% of it, with batches already made by loader
workers (``benchmarks/results/H100/2026-11-25-harness-e2e-dhen-1gpu.md``): 637 kernels a step
(``2026-11-25-harness-dhen-bf16-profile.json``), each launched from Python through the autograd
engine. Faster GEMMs cannot show in such a step.
Captured as CUDA graphs, the dense part of a step costs two graph launches per module.

What (``loka.dispatch.dense_graphs=true``, :func:`graph_dense_modules`): each chosen module's
``forward`` is replaced by a :class:`ModuleGraphs`. By default the chosen modules are the largest
submodules that hold parameters and no embedding tables (:func:`default_dense_modules`: DHEN's
``over_arch``; TorchRec DLRM's ``dense_arch`` and ``over_arch``); the embedding lookups and their
communication stay eager, as TorchRec runs them.

How (the scheme of ``torch.cuda.make_graphed_callables``, with eager fallbacks):

1. A training call (grad on, module in train mode, positional arguments only) waits for TorchRec
   awaitables among its arguments (a sharded module's output), flattens them with
   ``torch.utils._pytree`` (tensors, tuples, TorchRec ``KeyedTensor``\\ s) and
   forms a key: the argument structure, every tensor's shape, dtype and ``requires_grad``, the
   autocast state, and the kernels of every ``LokaLinear`` inside (a new dispatch plan is a new
   key).
2. After ``capture_after`` calls with one key, it runs ``warmup`` forward + backward passes on a
   side stream, then captures the forward into one graph and ``torch.autograd.grad`` of it into
   another, through detached aliases of the inputs and of the parameters
   (``torch.func.functional_call``), under autocast with its cast cache off (a cached cast would
   be read, not recomputed, on replay).
3. A replay copies the inputs into the static buffers, replays the forward and returns *copies*
   of the outputs (a caller may keep them). Its backward copies the incoming gradients in,
   replays the backward graph and hands autograd the static gradients: autograd adds them into
   the parameters' ``.grad``, where DDP's hooks see them, as after an eager backward.

Runs eagerly instead (and correctly): eval and ``no_grad`` calls; keyword arguments; a call
while any module inside has hooks (the Probe's probe steps register forward hooks); inside
another capture or a ``torch.compile`` trace; non-CUDA tensors; a second forward before the
first one's backward; a key not yet seen ``capture_after`` times (jagged inputs whose sizes
change every step never capture; after ``give_up_after`` distinct keys without a capture the
module stops forming keys, as HSTU's attention blocks do on jagged sequences); and every call
after a failed capture (logged once with its reason, in :attr:`ModuleGraphs.failure`). At most
``max_graphs`` keys are kept per module.

Contract: the module's forward must be a pure function of its arguments, parameters and buffers
on the GPU (no host synchronization, no data-dependent shapes, no Python state that changes
between steps); the optimizer must update parameters in place.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils import _pytree as pytree

from loka_torchrec.dispatch.linear import compiling
from loka_torchrec.dispatch.measure import release_generator

__all__ = ["ModuleGraphs", "graph_dense_modules", "default_dense_modules"]

logger = logging.getLogger(__name__)


def capturing() -> bool:
    """True while the current CUDA stream is being captured into a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


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


def _resolved(args: Tuple) -> Tuple:
    """``args`` with TorchRec's lazy awaitables resolved: a sharded module hands its output on as
    a ``LazyAwaitable`` (its ``KeyedTensor`` once waited for), which the module would resolve at
    first use anyway. Resolved as TorchRec resolves them, once: the result is kept on the
    awaitable, so a later use of the same object gets it again instead of waiting twice."""
    try:
        from torchrec.distributed.types import LazyAwaitable
    except ImportError:  # no TorchRec: nothing to wait for
        return args
    out = []
    for a in args:
        if isinstance(a, LazyAwaitable):
            if getattr(a, "_result", None) is None:
                a._result = a.wait()
            a = a._result
        out.append(a)
    return tuple(out)


def _capturable(tensors: Sequence[torch.Tensor]) -> bool:
    """CUDA graphs need every argument tensor on a CUDA device."""
    return all(t.is_cuda for t in tensors)


def _spec_key(spec) -> Any:
    try:
        hash(spec)
        return spec
    except TypeError:  # a context that is not hashable (older torch): its text stands in
        return repr(spec)


def _autocast_state(device_type: str) -> Tuple[bool, Optional[torch.dtype]]:
    if torch.is_autocast_enabled(device_type):
        return True, torch.get_autocast_dtype(device_type)
    return False, None


def _autocast(state: Tuple[bool, Optional[torch.dtype]], device_type: str):
    enabled, dtype = state
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype, cache_enabled=False)


class _CapturedCall:
    """Forward and backward graphs of one module at one key, with their static buffers."""

    def __init__(self, owner: "ModuleGraphs", leaves: List[Any], spec, autocast_state, warmup: int) -> None:
        module = owner.module
        self.spec = spec
        self.tensor_slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        first = leaves[self.tensor_slots[0]]
        device = first.device
        self.device = device
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.param_stamp = tuple(p.data_ptr() for p in self.params)
        # Static inputs start as copies of this call's values, so that the warm-up runs on real data.
        self.static_inputs = [leaves[i].detach().clone() for i in self.tensor_slots]
        self.input_grad = [leaves[i].requires_grad for i in self.tensor_slots]
        # The argument structure without this call's tensors (their slots are filled per run).
        self._leaves = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]

        def run(inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]):
            args_leaves = list(self._leaves)
            for slot, t in zip(self.tensor_slots, inputs):
                args_leaves[slot] = t
            args = pytree.tree_unflatten(args_leaves, self.spec)
            with owner.bypass(), _autocast(autocast_state, device.type):
                return torch.func.functional_call(module, dict(zip(self.param_names, params)), args)

        def aliases():
            inputs = [t.detach().requires_grad_(g) for t, g in zip(self.static_inputs, self.input_grad)]
            params = [p.detach().requires_grad_(True) for p in self.params]
            return inputs, params

        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                inputs, params = aliases()
                outs = [o for o in pytree.tree_leaves(run(inputs, params)) if isinstance(o, torch.Tensor)]
                diff = [o for o in outs if o.requires_grad]
                wanted = [t for t in (*inputs, *params) if t.requires_grad]
                if diff and wanted:
                    torch.autograd.grad(diff, wanted, [torch.zeros_like(o) for o in diff], allow_unused=True)
            del inputs, params, outs, diff, wanted
        torch.cuda.current_stream(device).wait_stream(side)

        # Fresh aliases: their gradient accumulators are made inside the capture (see layer_graph).
        self.inputs, self.param_aliases = aliases()
        pool = torch.cuda.graph_pool_handle()
        self.fwd_graph, self.bwd_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.fwd_graph, pool=pool, capture_error_mode="thread_local"):
            outputs = run(self.inputs, self.param_aliases)
        out_leaves, self.out_spec = pytree.tree_flatten(outputs)
        if not out_leaves or not all(isinstance(o, torch.Tensor) for o in out_leaves):
            raise TypeError("the module's output must be a tensor or a structure of tensors")
        self.static_outputs = out_leaves
        self.out_diff = [o.requires_grad for o in out_leaves]
        diff = [o for o in out_leaves if o.requires_grad]
        self.static_grad_outputs = [torch.zeros_like(o) for o in diff]
        self.wanted = [t for t in (*self.inputs, *self.param_aliases) if t.requires_grad]
        grads: Sequence[Optional[torch.Tensor]] = ()
        if diff and self.wanted:
            with torch.cuda.graph(self.bwd_graph, pool=pool, capture_error_mode="thread_local"):
                grads = torch.autograd.grad(diff, self.wanted, self.static_grad_outputs, allow_unused=True)
        else:
            self.bwd_graph = None
        it = iter(grads)
        # One gradient per tensor the replay takes (inputs, then parameters); None where none flows.
        self.static_grads = tuple(
            (next(it, None) if t.requires_grad else None) for t in (*self.inputs, *self.param_aliases)
        )
        self._owner: Optional[weakref.ref] = None

    def busy(self) -> bool:
        """A replayed forward still waits for its backward (the graph's activations are in use)."""
        return self._owner is not None and self._owner() is not None

    def forward(self, ctx, inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        for static, t in zip(self.static_inputs, inputs):
            if static.data_ptr() != t.data_ptr():
                static.copy_(t)
        self.fwd_graph.replay()
        self._owner = weakref.ref(ctx)
        return [o.clone() for o in self.static_outputs]

    def backward(self, grad_outputs: Sequence[Optional[torch.Tensor]]) -> Tuple[Optional[torch.Tensor], ...]:
        diff_grads = [g for g, d in zip(grad_outputs, self.out_diff) if d]
        for static, g in zip(self.static_grad_outputs, diff_grads):
            if g is None:
                static.zero_()
            elif static.data_ptr() != g.data_ptr():
                static.copy_(g)
        if self.bwd_graph is not None:
            self.bwd_graph.replay()
        self._owner = None
        return self.static_grads


class _ModuleReplay(torch.autograd.Function):
    """The module's outputs by replaying a captured call; gradients from the captured backward."""

    @staticmethod
    def forward(ctx, captured: _CapturedCall, *tensors):  # type: ignore[override]
        ctx.captured = captured
        outputs = captured.forward(ctx, tensors[: len(captured.static_inputs)])
        ctx.mark_non_differentiable(*[o for o, d in zip(outputs, captured.out_diff) if not d])
        return tuple(outputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grad_outputs):  # type: ignore[override]
        grads = ctx.captured.backward(grad_outputs)
        needs = ctx.needs_input_grad[1:]
        return (None, *(g if need else None for g, need in zip(grads, needs)))


class ModuleGraphs:
    """The replacement ``forward`` of one module: replays CUDA graphs where it can (module docstring).

    Args:
        module: the module; its ``forward`` is replaced by this object (:meth:`remove` restores it).
        name: its name in the model, for logs.
        capture_after: training calls with one key before it is captured (>= 1).
        max_graphs: keys kept captured (least recently used dropped).
        warmup: eager forward + backward passes on a side stream before each capture.
        give_up_after: distinct keys seen without any capture after which the module runs
            eagerly for good, without forming keys (its inputs change shape every call).

    Attributes:
        failure: why capturing failed (the module then stays eager), else ``None``.
        gave_up: why the module stopped trying (its input shapes never repeat), else ``None``.
        captures, replays, eager_calls: counters for the run summary.
        eager_reasons: eager calls by reason (``"eval or no_grad"``, ``"hooks"``, ``"warming up"``,
            ``"busy"``, ...).
    """

    def __init__(
        self, module: nn.Module, name: str = "", *, capture_after: int = 3, max_graphs: int = 2, warmup: int = 2,
        give_up_after: int = 64,
    ) -> None:
        if capture_after < 1 or max_graphs < 1 or warmup < 1 or give_up_after < 1:
            raise ValueError("ModuleGraphs: capture_after, max_graphs, warmup and give_up_after must be >= 1")
        if isinstance(module.__dict__.get("forward"), ModuleGraphs):
            raise ValueError(f"module {name or type(module).__name__} already has CUDA graphs")
        self.module, self.name = module, name or type(module).__name__
        self.capture_after, self.max_graphs, self.warmup = capture_after, max_graphs, warmup
        self.eager: Callable[..., Any] = module.forward
        self._calls: "collections.OrderedDict[Any, _CapturedCall]" = collections.OrderedDict()
        self._seen = Sightings(16 * max_graphs)
        self._bypass = False
        self._submodules = list(module.modules())
        self._dispatched = [m for m in self._submodules if hasattr(m, "kernels") and hasattr(m, "set_kernels")]
        self.failure: Optional[str] = None
        self.give_up_after = give_up_after
        self.gave_up: Optional[str] = None
        self._new_keys = 0  # distinct keys seen while nothing was captured
        self.captures = self.replays = self.eager_calls = 0
        self.eager_reasons: "collections.Counter[str]" = collections.Counter()
        module.forward = self  # an instance attribute: nn.Module.__call__ finds it first

    def remove(self) -> None:
        """Give the module its own ``forward`` back and drop the graphs."""
        if self.module.__dict__.get("forward") is self:
            del self.module.forward
        self._calls.clear()

    @contextlib.contextmanager
    def bypass(self):
        """Calls inside run the module's own forward (the warm-up and the capture)."""
        previous, self._bypass = self._bypass, True
        try:
            yield
        finally:
            self._bypass = previous

    def summary(self) -> Dict[str, Any]:
        return {"module": self.name, "captures": self.captures, "replays": self.replays,
                "eager_calls": self.eager_calls, "eager_reasons": dict(self.eager_reasons),
                "failure": self.failure, "gave_up": self.gave_up}  # fmt: skip

    # ------------------------------------------------------------------ the call
    def __call__(self, *args, **kwargs):
        if self._bypass:
            return self.eager(*args, **kwargs)
        args = _resolved(args)  # once, for the replay and the eager forward alike
        out = "keyword arguments" if kwargs else self._try_replay(args)
        if isinstance(out, str):  # why this call runs eagerly
            self.eager_calls += 1
            self.eager_reasons[out] += 1
            return self.eager(*args, **kwargs)
        return out

    def _try_replay(self, args: Tuple) -> Any:
        """The outputs from a replay, or a string: why this call must run eagerly."""
        if self.failure is not None:
            return "capture failed"
        if self.gave_up is not None:
            return "input shapes never repeat"
        why = self._ineligible()
        if why is not None:
            return why
        leaves, spec = pytree.tree_flatten(args)
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        if not tensors or not _capturable(tensors):
            return "not CUDA tensors"
        device_type = tensors[0].device.type
        autocast_state = _autocast_state(device_type)
        key = (
            _spec_key(spec),
            tuple((tuple(t.shape), t.dtype, t.requires_grad, t.device) if isinstance(t, torch.Tensor) else ("leaf", repr(t)) for t in leaves),
            autocast_state,
            tuple(m.kernels for m in self._dispatched),
        )
        call = self._calls.get(key)
        if call is not None and call.param_stamp != tuple(p.data_ptr() for p in call.params):
            del self._calls[key]  # parameters were replaced (not updated in place): capture again
            call = None
        if call is None:
            sightings = self._seen.add(key)
            if sightings < self.capture_after:
                if sightings == 1 and self.captures == 0:
                    self._new_keys += 1
                    if self._new_keys >= self.give_up_after:
                        self.gave_up = f"{self._new_keys} distinct input shapes and none seen {self.capture_after} times"
                        logger.info("dense graphs: %s runs eagerly from now on: %s", self.name, self.gave_up)
                return "warming up"
            call = self._capture(key, leaves, spec, autocast_state)
            if call is None:
                return "capture failed"
        self._calls.move_to_end(key)
        if call.busy():
            return "busy"
        self.replays += 1
        outputs = _ModuleReplay.apply(call, *[leaves[i] for i in call.tensor_slots], *call.params)
        return pytree.tree_unflatten(list(outputs), call.out_spec)

    def _ineligible(self) -> Optional[str]:
        """Why no call in the current state may replay, or ``None``."""
        if not (self.module.training and torch.is_grad_enabled()):
            return "eval or no_grad"
        if capturing() or compiling():
            return "inside a capture or a compile"
        hooks = nn.modules.module
        if hooks._global_forward_hooks or hooks._global_forward_pre_hooks or hooks._global_backward_hooks:
            return "global module hooks"
        if any(
            m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or getattr(m, "_backward_pre_hooks", None)
            for m in self._submodules
        ):
            return "module hooks"
        return None

    def _capture(self, key, leaves, spec, autocast_state) -> Optional[_CapturedCall]:
        try:
            call = _CapturedCall(self, leaves, spec, autocast_state, self.warmup)
        except Exception as exc:  # something inside cannot be captured: stay eager, say why once
            self.failure = f"{type(exc).__name__}: {exc}"
            logger.warning("dense CUDA graphs: capturing %s failed, it runs eagerly: %s", self.name, self.failure,
                           exc_info=True)  # fmt: skip
            self._calls.clear()
            release_generator(next(t for t in leaves if isinstance(t, torch.Tensor)).device)
            return None
        if len(self._calls) >= self.max_graphs:
            self._calls.popitem(last=False)
        self._calls[key] = call
        self.captures += 1
        logger.info("dense CUDA graphs: captured %s (capture %d)", self.name, self.captures)
        return call


def _is_table(module: nn.Module) -> bool:
    return "Embedding" in type(module).__name__  # nn.Embedding(Bag), TorchRec's collections, sharded ones


def default_dense_modules(model: nn.Module, prefix: str = "") -> List[str]:
    """The largest submodules that hold parameters and no embedding tables, by name.

    A child without tables is taken whole; a child with tables inside (a wrapper of the whole
    model, or an arch that embeds positions) is searched the same way, and so is a
    ``ModuleList``/``ModuleDict`` (never called itself); a table module itself is left out. DHEN: ``over_arch``; TorchRec's DLRM (as the project wraps it): ``model.dense_arch``
    and ``model.over_arch``.
    """
    names = []
    for name, child in model.named_children():
        if _is_table(child):
            continue
        if any(_is_table(m) for m in child.modules()) or isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            names += default_dense_modules(child, f"{prefix}{name}.")  # containers are never called
        elif any(True for _ in child.parameters()):
            names.append(prefix + name)
    return names


def graph_dense_modules(
    model: nn.Module, names: Sequence[str] = (), *, capture_after: int = 3, max_graphs: int = 2, give_up_after: int = 64
) -> Dict[str, ModuleGraphs]:
    """Give each named submodule of ``model`` (default: :func:`default_dense_modules`) CUDA graphs.

    Call it on the unsharded model, before ``DistributedModelParallel`` wraps it (graphs are
    captured lazily, on the GPU, after ``capture_after`` training calls).

    Args:
        model: the model.
        names: submodule names (``model.get_submodule``), or empty for the default choice.
        capture_after, max_graphs, give_up_after: see :class:`ModuleGraphs`.

    Returns:
        name -> its :class:`ModuleGraphs` (counters, ``failure``, ``remove()``).

    Example::

        >>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        >>> model = torch.nn.ModuleDict({"over_arch": mlp})
        >>> sorted(graph_dense_modules(model))
        ['over_arch']
        >>> model["over_arch"](torch.randn(2, 4)).shape  # on a CPU: the module's own forward
        torch.Size([2, 1])
    """
    chosen = list(names) or default_dense_modules(model)
    graphs: Dict[str, ModuleGraphs] = {}
    for name in chosen:
        try:
            module = model.get_submodule(name)
        except AttributeError as exc:
            raise ValueError(f"dispatch.dense_graph_modules: no submodule {name!r} in the model ({exc})") from None
        graphs[name] = ModuleGraphs(
            module, name, capture_after=capture_after, max_graphs=max_graphs, give_up_after=give_up_after
        )
    return graphs
