"""Other libraries' FP8 training, on the same job, as baselines for LoKA: torchao and Transformer Engine.

:func:`apply_baseline` converts the dense ``nn.Linear`` layers of an unsharded model (before
``DistributedModelParallel`` wraps it) the way each library documents it:

* ``torchao``: ``torchao.float8.convert_to_float8_training`` with
  ``Float8LinearConfig.from_recipe_name(recipe)`` (``tensorwise``, ``rowwise``,
  ``rowwise_with_gw_hp``) and ``pad_inner_dim=True`` (so the grad-weight GEMM, whose reduction
  dim is the row count, also runs on jagged row counts); optionally torchao's own size filter
  (``torchao.float8._auto_filter_for_recipe``, its H100 thresholds). Compiled with the job's
  ``train.compile`` (torchao's casts then fuse, as torchao recommends); eager with ``none``.
* ``te``: each layer becomes a ``transformer_engine.pytorch.Linear`` with the same weights
  (wrapped so that any row count works: rows are zero-padded to a multiple of 16, which changes
  neither the result nor any amax), and the model's forward must run inside
  :meth:`BaselineReport.forward_context` (``te.autocast`` / ``te.fp8_autocast`` with the recipe:
  ``delayed`` = ``DelayedScaling``, ``tensorwise`` = ``Float8CurrentScaling``, ``blockwise`` =
  ``Float8BlockScaling``, ``mxfp8`` = ``MXFP8BlockScaling``). The training job's
  :class:`~loka_job.training.trainer.Trainer` does this for every forward. With
  ``cuda_graphs=true`` each dense module's training forward and backward are also captured as CUDA
  graphs by TE's own helper, ``transformer_engine.pytorch.make_graphed_callables``, on its first
  training call, and replayed for every later call with the same input shapes
  (:class:`TeGraphedCall`); other calls (evaluation, another shape) run eagerly. The training job
  refuses it (``check_baseline_in_job``: the capture fails on DDP-wrapped parameters); the dense
  part's benchmark (``benchmarks/dense_part_step.py``) uses it.

Both need FP8 GEMMs with ``K`` and ``N`` multiples of 16: layers whose ``in_features`` or
``out_features`` is not are left as they are and listed in the report with the reason (as are
the layers torchao's filter drops). Neither library is a dependency of this project; a missing
one raises an ``ImportError`` naming the pip package.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, ContextManager, Dict, List, Mapping, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["BaselineConfig", "BaselineReport", "TeGraphedCall", "apply_baseline"]

KINDS = ("none", "torchao", "te")
TORCHAO_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
TE_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
_TE_RECIPE_CLASSES = {
    "delayed": "DelayedScaling",
    "tensorwise": "Float8CurrentScaling",
    "blockwise": "Float8BlockScaling",
    "mxfp8": "MXFP8BlockScaling",
}
ALIGN = 16  # K and N of an FP8 GEMM (torch._scaled_mm, cuBLASLt) must be multiples of this
TORCHAO_PIP = "pip install torchao"
TE_PIP = "pip install transformer-engine[pytorch]"


@dataclasses.dataclass(frozen=True)
class BaselineConfig:
    """Which library's FP8 training converts the dense layers (``baseline.*`` in the recipes).

    Attributes:
        kind: ``none`` (nothing changes), ``torchao`` or ``te`` (Transformer Engine).
        recipe: for ``torchao`` one of ``tensorwise``, ``rowwise``, ``rowwise_with_gw_hp``;
            for ``te`` one of ``delayed``, ``tensorwise``, ``blockwise``, ``mxfp8``.
        auto_filter: ``torchao`` only (recipes ``tensorwise`` and ``rowwise``): also leave the
            layers torchao's own filter finds too small to gain from FP8 in high precision.
        cuda_graphs: ``te`` only: replay each dense module's training step as CUDA graphs captured
            with TE's ``make_graphed_callables`` (TE's way of cutting the host's launches; its
            modules do not trace whole under ``torch.compile``). Not in the training job.
    """

    kind: str = "none"
    recipe: str = "tensorwise"
    auto_filter: bool = False
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"baseline.kind: expected one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.auto_filter, bool):
            raise ValueError(f"baseline.auto_filter: expected true or false, got {self.auto_filter!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"baseline.cuda_graphs: expected true or false, got {self.cuda_graphs!r}")
        if self.cuda_graphs and self.kind != "te":
            raise ValueError("baseline.cuda_graphs: only for baseline.kind=te (torchao runs under train.compile)")
        if self.kind == "none":
            return
        recipes = TORCHAO_RECIPES if self.kind == "torchao" else TE_RECIPES
        if self.recipe not in recipes:
            raise ValueError(
                f"baseline.recipe: {self.recipe!r} is not a {self.kind} recipe; expected one of {', '.join(recipes)}"
            )
        if self.auto_filter and self.kind != "torchao":
            raise ValueError("baseline.auto_filter: only for baseline.kind=torchao")
        if self.auto_filter and self.recipe == "rowwise_with_gw_hp":
            raise ValueError("baseline.auto_filter: torchao has no auto filter for recipe rowwise_with_gw_hp")

    @classmethod
    def from_dict(cls, values: Optional[Mapping[str, Any]]) -> "BaselineConfig":
        """From the recipe's ``baseline`` section; unknown keys raise an error naming them."""
        from loka_torchrec.config import from_mapping

        return from_mapping(cls, dict(values or {}), field="baseline")


@dataclasses.dataclass
class BaselineReport:
    """What :func:`apply_baseline` changed.

    Attributes:
        config: the configuration applied.
        converted: ``(fqn, in_features, out_features)`` of each layer now in the library's FP8.
        skipped: ``(fqn, reason)`` of each ``nn.Linear`` left as it was.
        versions: the library's version, e.g. ``{"torchao": "0.16.0"}``.
        graphed: ``te`` with ``cuda_graphs``: name -> :class:`TeGraphedCall` of each dense module.
        fp8_recipe: ``te``: the Transformer Engine recipe object the autocast and the graphs use.
    """

    config: BaselineConfig
    converted: List[Tuple[str, int, int]] = dataclasses.field(default_factory=list)
    skipped: List[Tuple[str, str]] = dataclasses.field(default_factory=list)
    versions: Dict[str, str] = dataclasses.field(default_factory=dict)
    graphed: Dict[str, "TeGraphedCall"] = dataclasses.field(default_factory=dict)
    fp8_recipe: Any = dataclasses.field(default=None, repr=False)
    _context: Optional[Callable[[], ContextManager]] = dataclasses.field(default=None, repr=False)

    def forward_context(self) -> ContextManager:
        """The context every forward of the converted model must run in (a fresh one per call).

        ``te``: Transformer Engine's FP8 autocast with the configured recipe (without it the TE
        layers compute in high precision); otherwise a no-op context.
        """
        return self._context() if self._context is not None else contextlib.nullcontext()

    def summary(self) -> Dict[str, Any]:
        """A JSON-able summary (kind, recipe, counts, skipped layers with reasons, versions; with
        ``cuda_graphs``, each graphed module's training calls replayed and run eagerly)."""
        return {
            "kind": self.config.kind,
            "recipe": self.config.recipe,
            "auto_filter": self.config.auto_filter,
            "cuda_graphs": self.config.cuda_graphs,
            "graphed_modules": {name: {"graphed_calls": c.graphed_calls, "eager_calls": c.eager_calls}
                                for name, c in self.graphed.items()},  # fmt: skip
            "converted_layers": len(self.converted),
            "skipped_layers": len(self.skipped),
            "skipped": [list(s) for s in self.skipped],
            "versions": dict(self.versions),
        }

    def __str__(self) -> str:
        c = self.config
        lines = [f"baseline {c.kind}:{c.recipe}: converted {len(self.converted)} linear layer(s):"]
        lines += [f"  {name}: {fan_in} -> {fan_out}" for name, fan_in, fan_out in self.converted]
        if self.graphed:
            lines.append(f"training steps of {', '.join(self.graphed)} replayed as CUDA graphs (TE's make_graphed_callables)")
        if self.skipped:
            lines.append(f"left in high precision ({len(self.skipped)}):")
            lines += [f"  {name}: {reason}" for name, reason in self.skipped]
        return "\n".join(lines)


def apply_baseline(model: nn.Module, config: BaselineConfig) -> BaselineReport:
    """Convert ``model``'s dense ``nn.Linear`` layers to the configured library's FP8, in place.

    Call it on the unsharded model, before ``DistributedModelParallel``; run every forward inside
    ``report.forward_context()`` (needed for ``te``). Only layers of type exactly ``nn.Linear``
    with real (not ``meta``) weights and ``in_features``, ``out_features`` multiples of 16 are
    converted; every other ``nn.Linear`` is listed in ``report.skipped`` with the reason.

    Args:
        model: the model (embedding tables may be on ``meta``; they are not touched).
        config: which library and recipe; ``kind="none"`` changes nothing.

    Returns:
        the :class:`BaselineReport`.

    Raises:
        ImportError: the library is not installed (the message names the pip package).
        RuntimeError: ``te`` with layers that are not on a CUDA device.
    """
    if not isinstance(config, BaselineConfig):
        raise TypeError(f"config: expected a BaselineConfig, got {type(config).__name__}")
    report = BaselineReport(config)
    if config.kind == "none":
        return report
    selected = _select(model, report)
    if config.kind == "torchao":
        _apply_torchao(model, config, selected, report)
    else:
        _apply_te(model, config, selected, report)
        if config.cuda_graphs:
            from loka_torchrec.compile import dense_modules

            for name in dense_modules(model):
                report.graphed[name] = TeGraphedCall.install(model.get_submodule(name), report)
    return report


# --------------------------------------------------------------------------------------- selection
def _select(model: nn.Module, report: BaselineReport) -> Dict[str, nn.Linear]:
    """The layers both libraries can take, by FQN; the others go to ``report.skipped``."""
    selected: Dict[str, nn.Linear] = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if not name:
            report.skipped.append((name, "the root module (convert a model that contains it)"))
        elif type(module) is not nn.Linear:
            report.skipped.append((name, f"a subclass of nn.Linear ({type(module).__name__}), left as it is"))
        elif module.weight.is_meta:
            report.skipped.append((name, "weight on the meta device"))
        elif module.in_features % ALIGN or module.out_features % ALIGN:
            report.skipped.append(
                (
                    name,
                    f"in_features={module.in_features}, out_features={module.out_features}: "
                    f"FP8 GEMMs need both to be multiples of {ALIGN}",
                )
            )
        else:
            selected[name] = module
    return selected


# --------------------------------------------------------------------------------------- torchao
def _import_torchao():
    try:
        import torchao
        from torchao import float8
    except ImportError as exc:
        raise ImportError(
            f"baseline.kind=torchao needs torchao (its float8 training): {TORCHAO_PIP} ({type(exc).__name__}: {exc})"
        ) from exc
    return torchao, float8


def _apply_torchao(model: nn.Module, config: BaselineConfig, selected: Dict[str, nn.Linear], report) -> None:
    torchao, float8 = _import_torchao()
    report.versions["torchao"] = str(getattr(torchao, "__version__", "unknown"))
    if config.auto_filter:
        keep = float8._auto_filter_for_recipe(config.recipe, filter_fqns=[])
        for name in list(selected):
            if not keep(selected[name], name):
                del selected[name]
                report.skipped.append((name, f"torchao's auto filter ({config.recipe}): too small to gain from FP8"))
    # pad_inner_dim: zero-pads a GEMM's reduction dim to a multiple of 16 where it is not (only
    # the grad-weight GEMM's, the row count, can be: in and out features are multiples of 16).
    float8_config = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name(config.recipe), pad_inner_dim=True)
    names = set(selected)
    float8.convert_to_float8_training(model, module_filter_fn=lambda module, fqn: fqn in names, config=float8_config)
    modules = dict(model.named_modules())
    for name, old in selected.items():
        new = modules.get(name)
        if new is old or not isinstance(new, nn.Linear):
            raise RuntimeError(f"torchao did not convert layer {name!r} (still {type(new).__name__})")
        report.converted.append((name, old.in_features, old.out_features))


# --------------------------------------------------------------------------------------- Transformer Engine
def _import_te():
    try:
        import transformer_engine
        import transformer_engine.pytorch as te
        from transformer_engine.common import recipe as te_recipe
    except (ImportError, OSError) as exc:  # OSError: TE's own shared libraries do not load
        raise ImportError(
            f"baseline.kind=te needs Transformer Engine: {TE_PIP} ({type(exc).__name__}: {exc})"
        ) from exc
    return transformer_engine, te, te_recipe


class TePaddedLinear(nn.Module):
    """A Transformer Engine ``Linear`` that takes any input shape ``(*, in_features)``.

    TE's FP8 GEMMs need the row count (product of the leading dims) to be a multiple of 8/16;
    jagged inputs (HSTU's tokens) are not. Rows are zero-padded up to a multiple of
    :data:`ALIGN` and the extra output rows dropped: zero rows add nothing to the grad-weight
    GEMM and change no amax, so the result equals the unpadded one.

    Args:
        linear: the ``transformer_engine.pytorch.Linear``.
    """

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        lead = input.shape[:-1]
        x = input.reshape(-1, input.shape[-1])
        rows = x.shape[0]
        pad = -rows % ALIGN
        if pad:
            x = F.pad(x, (0, 0, 0, pad))
        y = self.linear(x)
        if pad:
            y = y[:rows]
        return y.reshape(*lead, y.shape[-1])


def _apply_te(model: nn.Module, config: BaselineConfig, selected: Dict[str, nn.Linear], report) -> None:
    transformer_engine, te, te_recipe = _import_te()
    report.versions["transformer_engine"] = str(getattr(transformer_engine, "__version__", "unknown"))
    not_cuda = sorted(name for name, m in selected.items() if m.weight.device.type != "cuda")
    if not_cuda:
        raise RuntimeError(
            f"baseline.kind=te: Transformer Engine runs on CUDA only; layer(s) {not_cuda[:3]} are on "
            f"{selected[not_cuda[0]].weight.device}"
        )
    class_name = _TE_RECIPE_CLASSES[config.recipe]
    recipe_class = getattr(te_recipe, class_name, None)
    if recipe_class is None:
        raise RuntimeError(
            f"baseline.recipe={config.recipe}: this Transformer Engine "
            f"({report.versions['transformer_engine']}) has no transformer_engine.common.recipe.{class_name}"
        )
    fp8_recipe = recipe_class()
    report.fp8_recipe = fp8_recipe
    autocast = getattr(te, "autocast", None)  # the newer name; fp8_autocast is deprecated there
    if autocast is not None:
        report._context = lambda: autocast(enabled=True, recipe=fp8_recipe)
    else:
        report._context = lambda: te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe)
    for name, old in selected.items():
        new = te.Linear(
            old.in_features,
            old.out_features,
            bias=old.bias is not None,
            params_dtype=old.weight.dtype,
            device=old.weight.device,
        )
        with torch.no_grad():
            new.weight.copy_(old.weight)
            if old.bias is not None:
                new.bias.copy_(old.bias)
        new.train(old.training)
        wrapped = TePaddedLinear(new)
        wrapped.train(old.training)
        _set_submodule(model, name, wrapped)
        report.converted.append((name, old.in_features, old.out_features))


class TeGraphedCall:
    """Calls of one dense module, its training steps replayed as CUDA graphs captured by TE.

    Installed in the module's ``_compiled_call_impl`` slot (the one ``torch.compile`` fills), so
    that names and ``state_dict`` keys stay as they were. The first call in training mode with
    gradients on captures the module's forward and backward with
    ``transformer_engine.pytorch.make_graphed_callables`` (FP8 on, the report's recipe), using
    detached copies of that call's tensors as the graph's static inputs; every later training call
    whose inputs have the same structure, shapes, dtypes and ``requires_grad`` copies its tensors
    in and replays the graphs. Any other call (evaluation, ``no_grad``, another shape) runs the
    module eagerly; ``eager_calls`` counts those made in training mode.

    Inputs are flattened with ``torch.utils._pytree`` (TorchRec registers ``KeyedTensor``); a
    TorchRec ``LazyAwaitable`` argument is waited for first, as a compiled module's is.
    """

    def __init__(self, module: nn.Module, report: BaselineReport, capture: Optional[Callable] = None) -> None:
        self.module = module
        self.report = report
        self._capture = capture or _te_capture
        self.flat: Optional[_FlatCall] = None
        self.signature = None
        self.graphed_calls = 0
        self.eager_calls = 0

    @classmethod
    def install(cls, module: nn.Module, report: BaselineReport, capture: Optional[Callable] = None) -> "TeGraphedCall":
        call = cls(module, report, capture)
        module._compiled_call_impl = call
        return call

    def __call__(self, *args, **kwargs):
        from loka_torchrec.compile import resolve_awaitables

        args = resolve_awaitables(args)
        if not (self.module.training and torch.is_grad_enabled()):
            return self.module._call_impl(*args, **kwargs)
        leaves, spec = tree_flatten(args)
        if kwargs or not all(isinstance(t, torch.Tensor) for t in leaves):
            self.eager_calls += 1
            return self.module._call_impl(*args, **kwargs)
        signature = (spec, tuple((t.shape, t.dtype, t.requires_grad) for t in leaves))
        if self.flat is None:
            self.flat = _FlatCall(self.module, spec)
            samples = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in leaves)
            self._capture(self.flat, samples, self.report)
            self.signature = signature
        if signature != self.signature:
            self.eager_calls += 1
            return self.module._call_impl(*args)
        self.graphed_calls += 1
        return self.flat(*leaves)


class _FlatCall(nn.Module):
    """``module`` called with its arguments' tensors flattened (``make_graphed_callables`` takes
    tensors only); not registered in the model, so the model's names are unchanged."""

    def __init__(self, module: nn.Module, spec) -> None:
        super().__init__()
        self.inner = module
        self.spec = spec

    def forward(self, *leaves):
        return self.inner._call_impl(*tree_unflatten(list(leaves), self.spec))


def _te_capture(flat: nn.Module, samples: Tuple[torch.Tensor, ...], report: BaselineReport) -> None:
    """Capture ``flat``'s forward and backward with TE's graph helper, in place (TE replaces its
    ``forward`` by the graphed one in training mode)."""
    _, te, _ = _import_te()
    kwargs = dict(num_warmup_iters=3, allow_unused_input=True, enabled=True, recipe=report.fp8_recipe)
    with contextlib.ExitStack() as stack:
        if torch.is_autocast_enabled("cuda"):  # TE, like torch, refuses to capture with autocast's cache on
            stack.enter_context(torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False))
        te.make_graphed_callables(flat, samples, **kwargs)


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)
