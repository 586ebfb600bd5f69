"""``torch.compile`` for a TorchRec model's dense part, the way LoKA runs on a GPU.

The embedding tables stay eager, as in TorchRec (their lookups are FBGEMM kernels behind
TorchRec's sharded modules and input distribution); the dense modules around them (DLRM's
``dense_arch`` and ``over_arch``, DHEN's and HSTU's ``over_arch``) are compiled in place (as
``nn.Module.compile`` does it), so module types, parameter objects and ``state_dict`` keys do not change,
and ``DistributedModelParallel`` and TorchRec's train pipelines wrap the model as before.

``LokaLinear`` layers inside them trace into the same graph (``fullgraph=True``): their operand
quantization fuses into the producing ops, the plan is static state, and a new plan recompiles
once. Steps that must run eagerly (the Probe's statistics hooks, the steps before the first plan
whose row counts Dispatch reads) run inside :func:`eager`.

Example::

    >>> import torch
    >>> model = torch.nn.ModuleDict({"over_arch": torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU())})
    >>> compile_dense(model, "default")
    ['over_arch']
    >>> with eager():
    ...     model["over_arch"](torch.randn(2, 4)).shape
    torch.Size([2, 8])
"""

from __future__ import annotations

import contextlib
import functools
import logging
import types
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

try:  # TorchRec's awaitable, resolved before a compiled module runs; the library imports without TorchRec
    from torchrec.distributed.types import LazyAwaitable
except ImportError:  # no TorchRec: nothing to wait for
    LazyAwaitable = None

__all__ = [
    "COMPILE_MODES",
    "RECOMPILE_LIMIT",
    "compile_dense",
    "compiled_call",
    "cuda_graph_stats",
    "dense_modules",
    "eager",
    "end_compiled_step",
    "resolve_awaitables",
    "resolve_compile_mode",
    "uses_cuda_graphs",
    "wants_static_shapes",
]

logger = logging.getLogger(__name__)

COMPILE_MODES = ("auto", "none", "default", "reduce-overhead", "max-autotune-no-cudagraphs")
"""``train.compile`` values: ``auto`` is ``reduce-overhead`` (Inductor with CUDA graphs) on CUDA and
``none`` elsewhere; the others are ``torch.compile`` modes (``none``: eager)."""


def resolve_compile_mode(mode: str, device: "torch.device | str") -> Optional[str]:
    """The ``torch.compile`` mode for ``mode`` on ``device``; ``None`` means run eagerly.

    Raises:
        ValueError: ``mode`` is not one of :data:`COMPILE_MODES`.
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"train.compile: expected one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    if mode == "auto":
        return "reduce-overhead" if torch.device(device).type == "cuda" else None
    return None if mode == "none" else mode


def _table_types() -> Tuple[type, ...]:
    """Embedding-table module types: PyTorch's, and TorchRec's collections (plain and sharded)."""
    types_: List[type] = [nn.Embedding, nn.EmbeddingBag]
    try:
        from torchrec.distributed.embedding_types import ShardedEmbeddingModule
        from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface, EmbeddingCollectionInterface

        types_ += [EmbeddingBagCollectionInterface, EmbeddingCollectionInterface, ShardedEmbeddingModule]
    except ImportError:  # no TorchRec: PyTorch's tables only
        pass
    return tuple(types_)


def _is_table(module: nn.Module) -> bool:
    """An embedding table (or collection of them). A user's module that merely has "Embedding" in
    its name and holds a dense layer beside its tables is not one: it is searched like any module
    with tables inside, so that its dense layers compile. Other table kinds (a library's own
    collection) are recognised by their name when they hold no ``nn.Linear``."""
    if isinstance(module, _table_types()):
        return True
    return "Embedding" in type(module).__name__ and not any(isinstance(m, nn.Linear) for m in module.modules())


def dense_modules(model: nn.Module, prefix: str = "") -> List[str]:
    """The largest submodules of ``model`` that hold parameters and no embedding tables, by name.

    A child without tables is taken whole; a child with tables inside (a wrapper of the whole
    model, an arch that embeds positions) is searched the same way, and so is a
    ``ModuleList``/``ModuleDict`` (never called itself). DHEN: ``over_arch``; TorchRec's DLRM (as
    the project wraps it): ``model.dense_arch`` and ``model.over_arch``.
    """
    names = []
    for name, child in model.named_children():
        if _is_table(child):
            continue
        if any(_is_table(m) for m in child.modules()) or isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            names += dense_modules(child, f"{prefix}{name}.")
        elif any(True for _ in child.parameters()):
            names.append(prefix + name)
    return names


def compile_dense(
    model: nn.Module, mode: str, *, modules: Sequence[str] = (), fullgraph: bool = True, dynamic: Optional[bool] = None
) -> List[str]:
    """Compile ``model``'s dense submodules in place (as ``nn.Module.compile``); returns their names.

    Call it on the unsharded model after :func:`loka_torchrec.apply` and before
    ``DistributedModelParallel``.

    Args:
        model: the model.
        mode: a ``torch.compile`` mode (``default``, ``reduce-overhead``,
            ``max-autotune-no-cudagraphs``).
        modules: submodule names (``model.get_submodule``); empty: :func:`dense_modules`.
        fullgraph: refuse graph breaks (LoKA's layers have none).
        dynamic: ``torch.compile``'s ``dynamic``; ``None`` compiles static shapes first and marks
            a dim dynamic once it changes (one recompile, then none for jagged row counts),
            unless the model says that its dense inputs come in a few fixed shapes (a true
            ``compile_static_shapes`` attribute, as a model that pads jagged tokens to buckets
            sets): then ``False``, each shape compiled once, statically, so that
            ``reduce-overhead`` records CUDA graphs for it.

    Dynamo's per-module recompile limit is raised to :data:`RECOMPILE_LIMIT` (a graph per kernel set
    the layers run, per shape, for training and for evaluation).

    Raises:
        ValueError: an unknown mode or submodule name.
    """
    if mode not in COMPILE_MODES[2:]:
        raise ValueError(f"compile_dense: mode must be one of {', '.join(COMPILE_MODES[2:])}, got {mode!r}")
    names = list(modules) or dense_modules(model)
    _raise_recompile_limit(RECOMPILE_LIMIT)
    if dynamic is None and wants_static_shapes(model):
        dynamic = False
    for name in names:
        try:
            module = model.get_submodule(name)
        except AttributeError as exc:
            raise ValueError(f"compile_dense: modules: no submodule {name!r} in the model ({exc})") from None
        compiled = torch.compile(_module_caller(), fullgraph=fullgraph, dynamic=dynamic, **_mode_or_options(mode))
        # The slot nn.Module.compile() fills: calls of the module go through it, with TorchRec's lazy
        # awaitables resolved first (a sharded module hands its output on as a LazyAwaitable whose
        # wait() is a collective, which must not be traced).
        module._compiled_call_impl = functools.partial(_call_resolved, compiled, module)
    logger.info(
        "compiled (torch.compile mode=%s%s): %s", mode, ", static shapes" if dynamic is False else "", ", ".join(names) or "nothing"
    )
    return names


def wants_static_shapes(model: nn.Module) -> bool:
    """Whether ``model`` says its dense inputs come in a few fixed shapes (a true
    ``compile_static_shapes`` attribute, as HSTU sets when it pads its tokens to buckets), so that
    :func:`compile_dense` compiles each shape statically."""
    return bool(getattr(model, "compile_static_shapes", False))


RECOMPILE_LIMIT = 64
"""Graphs Dynamo keeps per compiled module; past its limit it runs the module eagerly, much slower
than compiled, for every new set of guards. Each set of kernels LoKA's layers run is a graph of its
own, for training and for evaluation: the plan trials' candidates one after the other, each set the
safety valve's holds and readmissions leave, the step-time guard's bf16; static shapes add one per
token bucket. Dynamo's default (8) is reached by a run with a few of each."""


def _raise_recompile_limit(limit: int) -> None:
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    if getattr(config, name) < limit:
        logger.info("torch._dynamo.config.%s raised to %d (a graph per kernel set and shape)", name, limit)
        setattr(config, name, limit)


def _mode_or_options(mode: str) -> dict:
    """``torch.compile``'s ``mode``, except that ``reduce-overhead`` records CUDA graphs only for
    graphs of static shapes: a graph with a dynamic dim (an unpadded jagged token count) would be
    re-recorded for every new size, so Inductor runs it without one (its
    ``cudagraph_skip_dynamic_graphs``, which then looks at the graph's input shapes). Inductor's
    graph partitions stay off: with them that setting is applied per operation, by whether the
    operation's code uses any symbol, and in PyTorch 2.11 the loop indices of a fused kernel count,
    so a static graph ran almost without CUDA graphs."""
    if mode == "reduce-overhead":
        return {"options": {"triton.cudagraphs": True, "triton.cudagraph_skip_dynamic_graphs": True, "graph_partition": False}}
    return {"mode": mode}


def _call_module(module: nn.Module, *args, **kwargs):
    return module._call_impl(*args, **kwargs)


def _module_caller() -> Callable:
    """A function of its own (a fresh code object) that calls a module's forward with its hooks.

    Dynamo keeps compiled graphs, and counts recompiles against its limit, per code object: with one
    code object per compiled module, ten modules do not share one limit. Tracing starts in this
    file, so Dynamo also traces modules of ``torch.nn`` itself (which it skips as a first frame).
    """
    return types.FunctionType(_call_module.__code__.replace(), _call_module.__globals__, "call_module")


def compiled_call(module: nn.Module, **compile_kwargs) -> Callable:
    """``module``'s call compiled (``torch.compile(..., **compile_kwargs)``) on a code object of its
    own, so that its graphs count against no other module's recompile limit (every ``nn.Linear``
    shares ``nn.Linear.forward``); ``module`` itself is left as it is."""
    return functools.partial(torch.compile(_module_caller(), **compile_kwargs), module)


def _call_resolved(compiled, module: nn.Module, *args, **kwargs):
    return compiled(module, *resolve_awaitables(args), **kwargs)


def resolve_awaitables(args: Tuple) -> Tuple:
    """``args`` with TorchRec's ``LazyAwaitable``s waited for, once, as TorchRec resolves them (the
    result is kept on the awaitable, so a later use of the same object does not wait again)."""
    if LazyAwaitable is None:
        return args
    out = []
    for a in args:
        if isinstance(a, LazyAwaitable):
            if getattr(a, "_result", None) is None:
                a._result = a.wait()
            a = a._result
        out.append(a)
    return tuple(out)


def uses_cuda_graphs(mode: Optional[str]) -> bool:
    """Whether compiled modules of ``mode`` (a resolved mode, ``None``: eager) replay CUDA graphs."""
    return mode == "reduce-overhead"


def end_compiled_step() -> None:
    """Tell Inductor's CUDA graphs that a training step ended (call it after the optimizer step).

    Under ``reduce-overhead`` the compiled forward and backward replay CUDA graphs whose outputs
    and saved activations live in one memory pool, reused from the next training step on. Inductor
    guesses where a step ends (a forward once every backward ran); where the guess fails, for
    example when the backward of a compiled module does not replay a graph, every step records new
    graphs and keeps the previous step's memory, so the step slows down and memory grows until it
    runs out. ``torch.compiler.cudagraph_mark_step_begin`` says it instead; an output of an earlier
    step read afterwards raises an error rather than returning overwritten values.
    """
    torch.compiler.cudagraph_mark_step_begin()


def cuda_graph_stats(device: "torch.device | str") -> Optional[Dict[str, int]]:
    """What Inductor's CUDA graph trees did on ``device`` so far; ``None`` where none ran (eager,
    ``default`` mode, not CUDA).

    A training loop in steady state records each compiled graph once and then only replays, so
    ``graphs`` stays at a few per compiled module and ``new_paths`` and ``rerecords`` stop growing;
    ``skips`` counts graphs that run without a CUDA graph (each with a warning from the
    ``cudagraphs`` log, ``TORCH_LOGS=cudagraphs``).

    Returns: ``functions`` (compiled graphs handed to the trees, forward and backward),
    ``graphs`` (CUDA graphs recorded), ``new_paths`` (times the next call matched no recorded
    graph and a new one was recorded), ``rerecords`` (of those, the ones for a graph recorded
    before, e.g. its static inputs moved), ``skips`` (graphs Inductor runs without CUDA graphs).
    These are the trees' own bookkeeping (``torch._inductor.cudagraph_trees``), read defensively.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None
    from torch._dynamo.utils import counters

    try:
        from torch._inductor import cudagraph_trees

        manager = cudagraph_trees.get_manager(device.index or 0, create_if_none_exists=False)
    except (ImportError, AttributeError, KeyError):  # a PyTorch without the trees' layout
        manager = None
    skips = int(counters["inductor"].get("cudagraph_skips", 0))
    if manager is None:
        return {"functions": 0, "graphs": 0, "new_paths": 0, "rerecords": 0, "skips": skips} if skips else None
    nodes, graphs = [n for roots in manager.roots.values() for n in roots], 0
    while nodes:
        node = nodes.pop()
        graphs += 1
        nodes += [c for children in node.children.values() for c in children]
    return {
        "functions": len(getattr(manager, "ids_to_funcs", {})),
        "graphs": graphs,
        "new_paths": int(getattr(manager, "debug_fail_counter", 0)),
        "rerecords": sum(sum(per_function.values()) for per_function in getattr(manager, "num_rerecord", {}).values()),
        "skips": skips,
    }


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """Run compiled modules with their own eager forward inside this block (no tracing, no replay)."""
    with torch.compiler.set_stance("force_eager"):
        yield
