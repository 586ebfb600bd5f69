"""GEMMs on a module's own Parameters as Dispatch sites, whatever function multiplies by them.

``nn.Linear`` is not the only way a model multiplies by a weight. HSTU as its users write it calls
``F.linear(x, self._uvqk_weight)`` and ``x @ self._output_weight``; TorchRec's ``LowRankCrossNet``
calls ``F.linear`` on ``ParameterList`` entries; ``nn.MultiheadAttention`` passes
``in_proj_weight`` and ``out_proj.weight`` to ``F.multi_head_attention_forward``, which never
calls ``out_proj``; ``nn.TransformerEncoderLayer`` in eval takes a fused fast path that calls
none of its linears. This module reaches those GEMMs.

**The mechanism: a torch-function mode scoped to the owner's forward.** Every module that owns a
2-D Parameter used as a GEMM operand (and every module with a fused fast path that would bypass
its sites) is a *scope*: its ``forward`` runs under a :class:`SiteMode` that knows the scope's
sites. The mode reroutes ``F.linear``, ``matmul``/``@``/``mm``, ``addmm`` and two-operand
``einsum`` calls whose weight operand *is* one of those Parameters to the site, a
:class:`ParameterSite`, and decomposes ``F.multi_head_attention_forward`` into its two projection
sites around scaled-dot-product attention. Why this and not the alternatives:

* it sees the call whatever the user wrote (a method, ``functools.partial``, a helper function),
  where a module-adapter registry needs one hand-written adapter per model class;
* Dynamo traces a torch-function mode entered inside the compiled region, so the site is one
  ``LokaLinearFunction.apply`` in the same graph as under ``LokaLinear`` (``fullgraph=True``, no
  graph break, tested); an FX pass would need the user's model to trace symbolically (HSTU's
  jagged, data-dependent shapes do not) and a second representation of the model;
* it changes no Parameter and no ``state_dict`` key: a site holds a reference to its owner's
  Parameter (a view when transposed), is a child module with no parameters and one
  non-persistent buffer, and the scope's ``forward`` is an instance attribute;
* with a mode active ``torch.overrides.has_torch_function`` is true, which is exactly what
  PyTorch's MultiheadAttention/TransformerEncoderLayer fast paths refuse, so in eager mode (eval
  included) they run the decomposed path and reach their sites. Dynamo does not evaluate that
  check through a mode, so a ``TransformerEncoderLayer`` scope also gets a no-op forward pre-hook,
  which the layer's fast path refuses as well, and a ``TransformerEncoder`` scope's
  ``use_nested_tensor`` is set to ``False`` (the check its nested-tensor path makes first):
  compiled eval/no_grad runs the sites too.

A :class:`ParameterSite` is a :class:`~loka_torchrec.dispatch.gemm_site.GemmSite`, the base of
``LokaLinear``: the same three role kernels, plan, evidence, Probe hooks (the mode calls the site
as a module) and ``LokaLinearFunction``; there is no second GEMM path. ``nn.Linear`` layers stay
``LokaLinear`` modules (they are called as modules, the cheapest reach); the one ``nn.Linear``
PyTorch never calls, MultiheadAttention's ``out_proj``, is reached by the attention handler.

**Orientation.** A Parameter multiplied as ``F.linear(x, P)`` is ``(out, in)``; as ``x @ P`` it is
``(in, out)`` and the site's ``weight`` is the view ``P.t()``. The orientation is read from the
owner's code when the site is made (:mod:`loka_torchrec.dispatch.gemm_source`, which follows the
Parameter into the helper functions and child modules it is passed to), so that a compiled step
that never runs eagerly has it right. A Parameter passed to code whose GEMM the source does not show
is a site of the default orientation; its first eager call, before the site ever ran, sets the
orientation from the call itself (``addmm(b, x, P)`` is ``"matmul"``, square Parameters included). A
call in an orientation the site does not have after that runs in high precision and is recorded in
:attr:`ParameterSite.unreached_calls`.

Not reached (high precision, reported by :func:`~loka_torchrec.dispatch.convert.convert_linears` or
as "never ran" by the Dispatcher): batched GEMMs on 3-D Parameters (``bmm``/``baddbmm`` per-head
weights), a GEMM on a view or cast of a Parameter (``x @ P.t()``, ``F.linear(x, P.to(dtype))``),
``P @ x`` for a ``(in, out)`` Parameter, MultiheadAttention with separate q/k/v
weights, ``bias_k``/``bias_v`` or ``add_zero_attn``, cross-attention's sliced in-projection.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from loka_torchrec.dispatch.gemm_source import LINEAR, MATMUL, SiteLayout, einsum_layout
from loka_torchrec.dispatch.layer_kernels import LayerKernels
from loka_torchrec.dispatch.linear import LokaLinear
from loka_torchrec.dispatch.gemm_site import GemmSite, compiling
from loka_torchrec.fp8 import Fp8Format

__all__ = ["ParameterSite", "SiteMode", "scope_module", "FAST_PATH_MODULES"]

logger = logging.getLogger(__name__)

FAST_PATH_MODULES: Tuple[type, ...] = (nn.TransformerEncoderLayer, nn.TransformerEncoder, nn.MultiheadAttention)
"""Modules whose forward has a fused fast path that bypasses their GEMMs: always scopes."""


class ParameterSite(GemmSite):
    """A GEMM on a Parameter that a module owns, as a Dispatch site (``y = x W^T + b``).

    The Parameter stays where it is (same object, same ``state_dict`` key); the site only refers to
    it. The owner's :class:`SiteMode` calls the site in place of the function that multiplied by it.

    Args:
        holder: the module whose ``_parameters`` holds the Parameter (a ``ParameterList`` for list
            entries).
        param_name: its key in ``holder._parameters``.
        layout: ``"linear"`` (the Parameter is ``(out, in)``, as in ``F.linear``) or ``"matmul"``
            (``(in, out)``, as in ``x @ P``).
        kernels, grad_format, forward_scaling: as for ``LokaLinear``.

    Attributes:
        unreached_calls: eager calls on the Parameter that ran in high precision, with why.
        other_uses: functions that read the Parameter other than as a GEMM operand (eager).

    Example::

        >>> owner = nn.Module(); owner.w = nn.Parameter(torch.randn(4, 8))
        >>> site = ParameterSite(owner, "w", layout="matmul")
        >>> (site.in_features, site.out_features), site(torch.randn(3, 4)).shape
        ((4, 8), torch.Size([3, 8]))
    """

    bias = None  # a site's bias, if any, is the call's own argument

    def __init__(
        self,
        holder: nn.Module,
        param_name: str,
        *,
        layout: "SiteLayout | str" = LINEAR,
        kernels: LayerKernels = LayerKernels(),
        grad_format: Fp8Format = Fp8Format.E4M3,
        forward_scaling: str = "current",
    ) -> None:
        super().__init__()
        try:
            layout = SiteLayout(layout)
        except ValueError:
            raise ValueError(f"layout: expected 'linear' or 'matmul', got {layout!r}") from None
        param = holder._parameters.get(param_name)
        if param is None or param.dim() != 2:
            raise ValueError(f"param_name: {param_name!r} is not a 2-D Parameter of {type(holder).__name__}")
        # Not a submodule (object.__setattr__): the holder is the site's parent's, and recursing into
        # it would list the Parameter twice.
        object.__setattr__(self, "_holder", holder)
        self.param_name = param_name
        self.path = param_name  # relative to the scope ("W_kernels.0" for a ParameterList entry)
        self.layout = layout
        self.out_features, self.in_features = self._dims(param, layout)
        self.unreached_calls: Dict[str, str] = {}
        self.other_uses: Dict[str, int] = {}
        self._init_dispatch(kernels, grad_format, param.device, forward_scaling)

    @staticmethod
    def _dims(param: torch.Tensor, layout: SiteLayout) -> Tuple[int, int]:
        rows, cols = int(param.shape[0]), int(param.shape[1])
        return (rows, cols) if layout == LINEAR else (cols, rows)

    @property
    def operand(self) -> torch.Tensor:
        """The Parameter itself, as the model passes it to a GEMM."""
        return self._holder._parameters[self.param_name]

    @property
    def weight(self) -> torch.Tensor:
        """``(out_features, in_features)``: the Parameter, or its transposed view for ``"matmul"``."""
        param = self.operand
        return param if self.layout == LINEAR else param.t()

    def reorient(self, layout: SiteLayout) -> bool:
        """Take ``layout`` if the site never ran yet (eager only); whether it now has it."""
        if layout == self.layout:
            return True
        if compiling() or self.last_rows:
            return False
        logger.info("dispatch: site %s is multiplied as %s, not %s: reoriented", self.path, layout.value, self.layout.value)
        self.layout = layout
        self.out_features, self.in_features = self._dims(self.operand, layout)
        self.set_kernels(self.kernels)
        return True

    def forward(self, input: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``y = x W^T + b``.

        Args:
            input: ``(*, in_features)``.
            bias: ``(out_features,)`` or ``None``.

        Returns:
            ``(*, out_features)``.
        """
        return self._site_forward(input, self.weight, bias)

    def _shape_repr(self) -> str:
        return f"{self.path}, layout={self.layout.value}, in_features={self.in_features}, out_features={self.out_features}"


# ------------------------------------------------------------------------------------- handlers
def _call_site(site: GemmSite, x: torch.Tensor, bias: Optional[torch.Tensor], *, plain: bool = False) -> Any:
    """``site(x) + bias`` through the site, or ``NotImplemented`` where the call does not fit it.

    ``plain`` (:func:`_traced_plain`): the model's own op runs instead (``NotImplemented``), and a
    call that fits the site marks it as run (``ran_compiled``: a store Dynamo replays after the
    graph, nothing in the graph), as the site's own compiled call would."""
    if not torch.is_tensor(x) or x.dim() == 0 or x.shape[-1] != site.in_features or not x.is_floating_point():
        return NotImplemented
    if isinstance(site, LokaLinear) and bias is not site.bias and site.bias is not None:
        return NotImplemented
    if plain:
        site._mark_ran_compiled()
        return NotImplemented
    if isinstance(site, LokaLinear):  # an nn.Linear whose weight its parent reads (MultiheadAttention.out_proj)
        if bias is site.bias:
            return site(x)
        return site(x) if bias is None else site(x) + bias
    if bias is None or (torch.is_tensor(bias) and bias.dim() == 1 and bias.shape[0] == site.out_features):
        return site(x, bias)
    return site(x) + bias


def _note(site: GemmSite, key: str, reason: str) -> None:
    if not compiling() and isinstance(site, ParameterSite) and key not in site.unreached_calls:
        site.unreached_calls[key] = reason
        logger.warning("dispatch: %s: %s runs in high precision: %s", site.path, key, reason)


def _oriented(site: GemmSite, layout: SiteLayout, key: str) -> bool:
    ok = site.layout == layout if isinstance(site, ParameterSite) and compiling() else (
        site.reorient(layout) if isinstance(site, ParameterSite) else layout == LINEAR
    )
    if not ok:
        _note(site, key, f"multiplied as {layout.value} but the site is {getattr(site, 'layout', LINEAR).value}")
    return ok


def _linear(mode: "SiteMode", input, weight, bias=None):
    site = mode.site_of(weight)
    if site is None or not _oriented(site, LINEAR, "F.linear"):
        return NotImplemented
    return _call_site(site, input, bias, plain=_traced_plain(site))


def _matmul(mode: "SiteMode", a, b):
    site = mode.site_of(b)
    if site is not None:
        if not _oriented(site, MATMUL, "x @ P"):
            return NotImplemented
        if torch.is_tensor(a) and a.dim() == 1:
            out = _call_site(site, a.unsqueeze(0), None, plain=_traced_plain(site))
            return out if out is NotImplemented else out.squeeze(0)
        return _call_site(site, a, None, plain=_traced_plain(site))
    site = mode.site_of(a)
    if site is not None:  # P @ x = (x^T P^T)^T for an (out, in) Parameter; x (in,), (in, n) or (..., in, n)
        if not torch.is_tensor(b) or not _oriented(site, LINEAR, "P @ x"):
            return NotImplemented
        if b.dim() == 1:
            out = _call_site(site, b.unsqueeze(0), None, plain=_traced_plain(site))
            return out if out is NotImplemented else out.squeeze(0)
        out = _call_site(site, b.transpose(-1, -2), None, plain=_traced_plain(site))
        return out if out is NotImplemented else out.transpose(-1, -2)
    return NotImplemented


def _rmatmul(mode: "SiteMode", p, other):
    return _matmul(mode, other, p)


def _addmm(mode: "SiteMode", input, mat1, mat2, *, beta=1, alpha=1):
    site = mode.site_of(mat2)
    if site is None or not _oriented(site, MATMUL, "addmm"):
        return NotImplemented
    if alpha == 1 and beta == 1:
        return _call_site(site, mat1, input, plain=_traced_plain(site))
    y = _call_site(site, mat1, None, plain=_traced_plain(site))
    return y if y is NotImplemented else alpha * y + beta * input


def _einsum(mode: "SiteMode", equation, *operands):
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if len(operands) != 2 or not isinstance(equation, str):
        return NotImplemented
    site = mode.site_of(operands[1])
    if site is None:
        return NotImplemented
    layout = einsum_layout(equation)
    if layout is None:
        _note(site, f"einsum {equation!r}", "not a projection of the last dim")
        return NotImplemented
    if not _oriented(site, layout, f"einsum {equation!r}"):
        return NotImplemented
    return _call_site(site, operands[0], None, plain=_traced_plain(site))


def _attention_mask(attn_mask, key_padding_mask, batch: int, heads: int, q_len: int, k_len: int, dtype):
    """One additive float mask ``(batch * heads, q_len, k_len)`` (or broadcastable), or ``None``."""

    def additive(m):
        if m.dtype == torch.bool:
            return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(m, float("-inf"))
        return m.to(dtype)

    mask = None
    if attn_mask is not None:
        mask = additive(attn_mask)
        if mask.dim() == 2:
            mask = mask.unsqueeze(0)
    if key_padding_mask is not None:
        pad = additive(key_padding_mask).view(batch, 1, 1, k_len).expand(-1, heads, -1, -1).reshape(batch * heads, 1, k_len)
        mask = pad if mask is None else mask + pad
    return mask


def _multi_head_attention(mode: "SiteMode", query, key, value, embed_dim_to_check, num_heads, in_proj_weight,
                          in_proj_bias, bias_k, bias_v, add_zero_attn, dropout_p, out_proj_weight, out_proj_bias,
                          training=True, key_padding_mask=None, need_weights=True, attn_mask=None,
                          use_separate_proj_weight=False, q_proj_weight=None, k_proj_weight=None, v_proj_weight=None,
                          static_k=None, static_v=None, average_attn_weights=True, is_causal=False):  # fmt: skip
    """``F.multi_head_attention_forward`` with its two projections on sites (self-attention only)."""
    in_site, out_site = mode.site_of(in_proj_weight), mode.site_of(out_proj_weight)
    if in_site is None or out_site is None:
        return NotImplemented
    unsupported = (
        "cross-attention (query is not key and value)" if not (query is key and key is value) else
        "separate q/k/v weights" if use_separate_proj_weight else
        "bias_k/bias_v or add_zero_attn" if bias_k is not None or bias_v is not None or add_zero_attn else
        "static_k/static_v" if static_k is not None or static_v is not None else None
    )  # fmt: skip
    if unsupported is not None:
        _note(in_site, "multi_head_attention_forward", unsupported)
        return NotImplemented
    if _traced_plain(in_site, out_site):  # both projections take the embedding-wide query's rows
        _call_site(in_site, query, in_proj_bias, plain=True)
        _call_site(out_site, query, out_proj_bias, plain=True)
        return NotImplemented
    batched = query.dim() == 3
    x = query if batched else query.unsqueeze(1)  # (L, N, E): PyTorch's sequence-first layout
    if not batched and key_padding_mask is not None:
        key_padding_mask = key_padding_mask.unsqueeze(0)
    seq, batch, embed = x.shape
    head_dim = embed // num_heads
    qkv = _call_site(in_site, x, in_proj_bias)
    if qkv is NotImplemented:
        return NotImplemented
    q, k, v = (t.reshape(seq, batch * num_heads, head_dim).transpose(0, 1) for t in qkv.chunk(3, dim=-1))
    mask = _attention_mask(attn_mask, key_padding_mask, batch, num_heads, seq, seq, q.dtype)
    causal = is_causal and mask is None
    drop = dropout_p if training else 0.0
    weights = None
    if need_weights:
        scores = torch.baddbmm(mask, q * head_dim ** -0.5, k.transpose(1, 2)) if mask is not None else (
            torch.bmm(q * head_dim ** -0.5, k.transpose(1, 2)))  # fmt: skip
        if causal:
            scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        weights = probs.view(batch, num_heads, seq, seq)
        weights = weights.mean(dim=1) if average_attn_weights else weights
        attended = torch.bmm(F.dropout(probs, p=drop) if drop > 0 else probs, v)
        if not batched:
            weights = weights.squeeze(0)
    else:
        sdpa_mask = None if mask is None else mask.view(batch, num_heads, -1, seq) if mask.shape[0] != 1 else mask
        attended = F.scaled_dot_product_attention(
            q.view(batch, num_heads, seq, head_dim), k.view(batch, num_heads, seq, head_dim),
            v.view(batch, num_heads, seq, head_dim), attn_mask=sdpa_mask, dropout_p=drop, is_causal=causal,
        ).view(batch * num_heads, seq, head_dim)  # fmt: skip
    out = attended.transpose(0, 1).reshape(seq * batch, embed)
    out = _call_site(out_site, out, out_proj_bias)
    if out is NotImplemented:
        return NotImplemented
    out = out.view(seq, batch, embed)
    return (out if batched else out.squeeze(1)), weights


_HANDLERS: Dict[Callable, Callable] = {
    F.linear: _linear,
    torch.matmul: _matmul,
    torch.Tensor.matmul: _matmul,
    torch.Tensor.__matmul__: _matmul,
    torch.Tensor.__rmatmul__: _rmatmul,
    torch.mm: _matmul,
    torch.Tensor.mm: _matmul,
    torch.addmm: _addmm,
    torch.Tensor.addmm: _addmm,
    torch.einsum: _einsum,
    F.multi_head_attention_forward: _multi_head_attention,
}


def _traced_plain(*sites: Optional[GemmSite]) -> bool:
    """Whether the call is being traced with every site in high precision: then the model's own op
    runs, so that a plan without FP8 compiles to the plain model's code (eager calls still go through
    the site: its row count, the Probe's hooks and the amax history see them); :func:`_call_site`
    then marks the sites the call fits as run."""
    return compiling() and all(site is not None and site.plan.all_high_precision for site in sites)


class SiteMode(TorchFunctionMode):
    """Routes GEMMs on the scope's Parameters to their sites (active only inside the scope's forward).

    Everything else the scope's code calls runs as called. ``x.unflatten(...)`` reaches the mode as
    the plain function ``Tensor.unflatten``, which ends in ``super().unflatten(...)``: Dynamo refuses
    that ``super()`` when the function is called as ``Tensor.unflatten(x, ...)`` (torch 2.11 and
    2.13), so the mode calls it as a method of its tensor again, which Dynamo traces; a user's
    ``x.unflatten(...)`` inside a scope compiles. (It is the one ``torch.Tensor`` method written in
    Python that ends in ``super()`` outside the named-tensor API.)

    Args:
        sites: the scope's sites (``ParameterSite`` modules, and ``LokaLinear`` layers whose weight
            the scope passes to a function instead of calling them).
    """

    def __init__(self, sites: Sequence[GemmSite]) -> None:
        super().__init__()
        self.sites = tuple(sites)

    def site_of(self, t: Any) -> Optional[GemmSite]:
        for site in self.sites:
            operand = site.operand if isinstance(site, ParameterSite) else site.weight
            if t is operand:
                return site
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            out = handler(self, *args, **kwargs)
            if out is not NotImplemented:
                return out
        elif self.sites and not compiling():
            self._note_other_use(func, args)
        if func is torch.Tensor.unflatten and args and isinstance(args[0], torch.Tensor):
            return args[0].unflatten(*args[1:], **kwargs)  # an identity test: a dict keyed by it missed it under Dynamo
        return func(*args, **kwargs)

    def _note_other_use(self, func, args) -> None:
        """Count reads of a site's Parameter by a non-GEMM function (indexing, a norm): eager only."""
        for arg in args:
            site = self.site_of(arg) if torch.is_tensor(arg) else None
            if isinstance(site, ParameterSite):
                name = getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))
                site.other_uses[name] = site.other_uses.get(name, 0) + 1


def _scoped_forward(module: nn.Module, mode: SiteMode, inner: Optional[Callable], *args: Any, **kwargs: Any) -> Any:
    with mode:
        if inner is not None:
            return inner(*args, **kwargs)
        return type(module).forward(module, *args, **kwargs)


def scope_module(module: nn.Module, sites: Sequence[GemmSite]) -> None:
    """Make ``module``'s forward run under a :class:`SiteMode` for ``sites`` (idempotent: replaces
    an earlier scope). The sites that are ``ParameterSite`` modules become its children in
    ``_loka_sites`` (no parameters, nothing persistent: ``state_dict`` keys are unchanged).

    A forward the module already had as an instance attribute (a function-level mod's scope,
    :mod:`loka_torchrec.mods.functional`) runs inside the mode, so both apply."""
    own = [s for s in sites if isinstance(s, ParameterSite)]
    if own:
        module._loka_sites = nn.ModuleDict({s.path.replace(".", "_"): s for s in own})
    inner = module.__dict__.get("forward")
    if is_scoped(module):
        inner = inner.args[2]
    module.forward = functools.partial(_scoped_forward, module, SiteMode(sites), inner)
    if isinstance(module, nn.TransformerEncoderLayer) and not getattr(module, "_loka_fast_path_refused", False):
        # The layer's fast path refuses modules with forward hooks, a check Dynamo evaluates as
        # written; its has_torch_function check does not see a mode while compiling.
        module.register_forward_pre_hook(_refuse_fast_path)
        module._loka_fast_path_refused = True
    if isinstance(module, nn.TransformerEncoder):
        # Eagerly the mode already refuses the nested-tensor path (has_torch_function); compiled,
        # only this flag does, so compiled and eager compute the same.
        module.use_nested_tensor = False


def _refuse_fast_path(module: nn.Module, args: Any) -> None:
    """A forward pre-hook that does nothing: its presence makes ``TransformerEncoderLayer`` run the
    decomposed path (and so its sites) in eval and under ``torch.compile`` too."""
    return None


def is_scoped(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is _scoped_forward


def scoped_sites(module: nn.Module) -> Tuple[GemmSite, ...]:
    """The sites of a scoped module's mode (empty if not scoped)."""
    return module.__dict__["forward"].args[1].sites if is_scoped(module) else ()
