"""Where a module's code multiplies by one of its Parameters, and in which orientation.

A Parameter site needs its orientation when it is made: under ``torch.compile`` a step may never run
the site eagerly, so nothing corrects a wrong one later (and a square Parameter's shape says
nothing). This module reads the owner's source (its class and base classes) with :mod:`ast` and
follows the Parameter wherever the code takes it:

* a GEMM on it: ``x @ P``, ``torch.matmul(x, P)``, ``mm``, ``addmm(b, x, P)`` (``"matmul"``: ``P`` is
  ``(in, out)``); ``F.linear(x, P)``, ``P @ x``, ``P.matmul(x)`` (``"linear"``: ``(out, in)``); a
  two-operand ``einsum`` by its equation;
* an argument, positional or keyword, of a call into Python code: the callee is resolved (a name
  in the caller's module, ``package.function``, ``self.<method>``, a child module, whose
  ``forward`` runs), the argument is mapped to the callee's parameter with
  :func:`inspect.signature`, and the callee's source is read for that name, up to
  :data:`MAX_CALL_DEPTH` calls deep. Production HSTU passes ``uvqk_weight=self._uvqk_weight`` to a
  function of another Python module that calls ``torch.addmm(bias, normed_x, uvqk_weight)``;
* a local alias (``w = self.P``) is followed as the Parameter.

The answer, a :class:`ParameterUse`, lists the orientations of the GEMMs found, the calls whose GEMM
could not be found (the callee cannot be resolved statically, has no source, or is too deep), and
the GEMMs on a view or cast of the Parameter (``x @ P.t()``, ``F.linear(x, P.to(dtype))``), which
no site reaches because the GEMM's operand is not the Parameter. A call into torch (a non-GEMM
function such as ``F.embedding`` or ``torch.split``) and indexing are not GEMMs.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import enum
import functools
import inspect
import re
import sys
import textwrap
import types
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LINEAR", "MATMUL", "MAX_CALL_DEPTH", "ParameterUse", "SiteLayout", "einsum_layout", "parameter_use"]


class SiteLayout(str, enum.Enum):
    """How a GEMM reads its weight operand ``P``."""

    LINEAR = "linear"  # (out, in), as in F.linear(x, P)
    MATMUL = "matmul"  # (in, out), as in x @ P


LINEAR, MATMUL = SiteLayout.LINEAR, SiteLayout.MATMUL
MAX_CALL_DEPTH = 4
"""How many calls deep a Parameter passed as an argument is followed."""

_MISSING = object()
_VIEWS = frozenset({
    "t", "T", "mT", "H", "transpose", "permute", "view", "reshape", "contiguous", "flatten", "squeeze",
    "unsqueeze", "to", "float", "half", "bfloat16", "double", "type", "type_as", "detach", "clone",
})  # fmt: skip
_EINSUM = re.compile(r"^\s*([a-zA-Z.]+)\s*,\s*([a-zA-Z]{2})\s*->\s*([a-zA-Z.]+)\s*$")


def einsum_layout(equation: str) -> Optional[SiteLayout]:
    """The weight's orientation in a two-operand ``einsum`` that projects the last dim of its first
    operand by a 2-D second operand (``"...k,kn->...n"``: ``"matmul"``; ``"...k,nk->...n"``:
    ``"linear"``), or ``None`` for any other equation.

    Example::

        >>> einsum_layout("bsk,kn->bsn"), einsum_layout("bk,nk->bn"), einsum_layout("ij,jk->ki")
        (<SiteLayout.MATMUL: 'matmul'>, <SiteLayout.LINEAR: 'linear'>, None)
    """
    match = _EINSUM.match(equation)
    if match is None:
        return None
    lhs, pw, out = match.groups()
    if len(set(pw)) != 2 or lhs[-1] not in pw or out[:-1] != lhs[:-1] or out[-1] not in pw or out[-1] == lhs[-1]:
        return None
    return MATMUL if pw[0] == lhs[-1] else LINEAR


@dataclasses.dataclass(frozen=True)
class ParameterUse:
    """What a module's code does with one of its Parameters.

    Attributes:
        layouts: the orientation of each GEMM found on it (:class:`SiteLayout`).
        unresolved: the calls it is passed to whose GEMM, if any, could not be found statically.
        transformed: the GEMMs on a view or cast of it (``P.t()``, ``P.to(dtype)``).
        readable: whether the owner's source could be read at all.
    """

    layouts: Tuple[SiteLayout, ...] = ()
    unresolved: Tuple[str, ...] = ()
    transformed: Tuple[str, ...] = ()
    readable: bool = True

    @property
    def layout(self) -> Optional[SiteLayout]:
        """The orientation most GEMMs on it have (``"linear"`` on a tie), ``None`` if none was found."""
        if not self.layouts:
            return None
        return MATMUL if self.layouts.count(MATMUL) > self.layouts.count(LINEAR) else LINEAR

    @property
    def reaches_code(self) -> bool:
        """Whether anything was found beyond non-GEMM uses."""
        return bool(self.layouts or self.unresolved or self.transformed)

    def __add__(self, other: "ParameterUse") -> "ParameterUse":
        return ParameterUse(
            self.layouts + other.layouts, self.unresolved + other.unresolved,
            self.transformed + other.transformed, self.readable and other.readable,
        )  # fmt: skip


def parameter_use(owner: nn.Module, attr: str, *, entry: bool = False) -> ParameterUse:
    """How ``owner``'s code multiplies by ``self.<attr>`` (``entry``: by ``self.<attr>[i]``, an
    entry of a ``ParameterList``/``ParameterDict``), following it into the functions and child
    modules it is passed to.

    Example::

        >>> from torchrec.modules.crossnet import LowRankCrossNet  # F.linear(x_l, self.V_kernels[layer])
        >>> net = LowRankCrossNet(in_features=8, num_layers=1, low_rank=2)
        >>> parameter_use(net, "V_kernels", entry=True).layout, parameter_use(net, "bias", entry=True).layout
        (<SiteLayout.LINEAR: 'linear'>, None)
    """
    use, readable, defined = ParameterUse(), False, set()
    for cls in type(owner).__mro__:
        if cls in (nn.Module, object):
            continue
        tree = _parse(cls)
        overridden, defined = set(defined), defined | set(vars(cls))
        if tree is None or not tree.body or not isinstance(tree.body[0], ast.ClassDef):
            continue
        readable = True
        methods = [m for m in tree.body[0].body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
        refs = [n for m in methods if m.name not in overridden for n in ast.walk(m) if _is_self_attr(n, attr)]
        reader = _Reader(_module_globals(cls), owner, depth=0)
        use = use + reader.uses(tree, refs, entry, where=cls.__qualname__)
    return dataclasses.replace(use, readable=readable)


# ------------------------------------------------------------------------------------- internals
@functools.lru_cache(maxsize=256)
def _parse(obj: Any) -> Optional[ast.AST]:
    """The parsed source of a class or function (read-only: the tree is shared)."""
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(obj)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None


def _module_globals(obj: Any) -> Dict[str, Any]:
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    return vars(module) if module is not None else {}


def _is_self_attr(node: ast.AST, attr: str) -> bool:
    return (
        isinstance(node, ast.Attribute) and node.attr == attr and isinstance(node.value, ast.Name)
        and node.value.id == "self" and isinstance(node.ctx, ast.Load)
    )  # fmt: skip


def _is_torch(obj: Any) -> bool:
    """Whether ``obj`` is torch's or Python's own (a function that is no user code to follow)."""
    module = getattr(obj, "__module__", None) or ""
    return module in ("torch", "builtins") or module.startswith("torch.") or inspect.isbuiltin(obj)


def _parents(tree: ast.AST) -> Dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


# The GEMM functions: the argument position and keyword of the weight operand in each orientation.
_GEMM_ARGS: Dict[Callable, Tuple[Tuple[int, str, str], ...]] = {
    F.linear: ((1, "weight", LINEAR),),
    torch.matmul: ((1, "other", MATMUL), (0, "input", LINEAR)),
    torch.mm: ((1, "mat2", MATMUL), (0, "input", LINEAR)),
    torch.addmm: ((2, "mat2", MATMUL),),
}
# The same as Tensor methods (``x.matmul(P)``): the receiver is the first operand.
_GEMM_METHOD_ARGS: Dict[str, Tuple[Tuple[int, str, str], ...]] = {
    "matmul": ((0, "other", MATMUL),), "mm": ((0, "mat2", MATMUL),), "__matmul__": ((0, "other", MATMUL),),
    "addmm": ((1, "mat2", MATMUL),), "__rmatmul__": ((0, "other", LINEAR),),
}  # fmt: skip
_METHODS_ON_P = {"matmul": LINEAR, "mm": LINEAR, "__matmul__": LINEAR, "__rmatmul__": MATMUL}
_NOT_A_SITE, _UNKNOWN = "not a site", "unknown"  # what _gemm_layout says besides an orientation


@dataclasses.dataclass(frozen=True)
class _Source:
    """One parsed piece of source: its nodes' parents, the references already classified (an alias
    loop ends there), and its name for reports."""

    parents: Dict[ast.AST, ast.AST]
    seen: set
    where: str


@dataclasses.dataclass(frozen=True)
class _Reader:
    """Classifies references to a Parameter in source, following the calls it is passed to."""

    globals: Dict[str, Any]
    owner: Optional[nn.Module]  # what ``self`` is in this source (None in a free function)
    depth: int

    def uses(self, tree: ast.AST, refs: List[ast.AST], entry: bool, where: str) -> ParameterUse:
        source = _Source(_parents(tree), set(), where)
        use = ParameterUse()
        for ref in refs:
            parent = source.parents.get(ref)
            if entry:  # a ParameterList/ParameterDict: the GEMM operand is the indexed entry
                if isinstance(parent, ast.Subscript) and parent.value is ref:
                    use = use + self._classify(parent, source, entry=False)
                elif isinstance(parent, (ast.Call, ast.keyword, ast.Assign, ast.For)):
                    use = use + self._classify(ref, source, entry=True)  # the container, iterated or passed on
                continue
            use = use + self._classify(ref, source, entry=False)
        return use

    def _classify(self, ref: ast.AST, source: _Source, entry: bool) -> ParameterUse:
        if ref in source.seen:
            return ParameterUse()
        source.seen.add(ref)
        parent = source.parents.get(ref)
        loop_variable = self._loop_variable(ref, source) if entry else None
        if loop_variable is not None:
            return self._reads(*loop_variable, source, entry=False)
        if isinstance(parent, ast.BinOp) and isinstance(parent.op, ast.MatMult) and not entry:
            return ParameterUse(layouts=(MATMUL if parent.right is ref else LINEAR,))
        if isinstance(parent, ast.Call) and ref is not parent.func:
            return self._call(parent, ref, None, source.where, entry)
        if isinstance(parent, ast.keyword) and isinstance(source.parents.get(parent), ast.Call):
            return self._call(source.parents[parent], ref, parent.arg, source.where, entry)
        if isinstance(parent, ast.Attribute) and parent.value is ref and not entry:
            return self._method_of_parameter(parent, source)
        if isinstance(parent, ast.Assign) and parent.value is ref and len(parent.targets) == 1:
            return self._alias(parent, source, entry)
        return ParameterUse()  # indexing, arithmetic, a comparison: not a GEMM

    def _method_of_parameter(self, attribute: ast.Attribute, source: _Source) -> ParameterUse:
        """``P.matmul(x)`` is a GEMM; ``P.t()``, ``P.to(dtype)`` are views or casts, a GEMM on which
        no site reaches; other methods are not GEMMs."""
        call = source.parents.get(attribute)
        called = isinstance(call, ast.Call) and call.func is attribute
        if called and attribute.attr in _METHODS_ON_P:
            return ParameterUse(layouts=(_METHODS_ON_P[attribute.attr],))
        if attribute.attr not in _VIEWS:
            return ParameterUse()
        expr = call if called else attribute
        if self._classify(expr, source, entry=False).reaches_code:
            return ParameterUse(transformed=(f"{source.where}: {ast.unparse(expr)}",))
        return ParameterUse()

    def _alias(self, assign: ast.Assign, source: _Source, entry: bool) -> ParameterUse:
        """``w = self.P``: the reads of ``w`` in the same function."""
        target = assign.targets[0]
        if not isinstance(target, ast.Name):
            return ParameterUse()
        scope: ast.AST = assign
        while scope in source.parents and not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
            scope = source.parents[scope]
        return self._reads(scope, target.id, source, entry)

    @staticmethod
    def _loop_variable(ref: ast.AST, source: _Source) -> Optional[Tuple[ast.For, str]]:
        """The loop and the name its entries take where ``ref``, a container, is iterated:
        ``for w in self.ws``, ``for w, b in zip(self.ws, self.bs)``, ``for i, w in enumerate(self.ws)``."""
        parent = source.parents.get(ref)
        loop, index = parent, None
        if isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name) and parent.func.id in ("zip", "enumerate"):
            loop = source.parents.get(parent)
            if ref not in parent.args or not (isinstance(loop, ast.For) and loop.iter is parent):
                return None
            index = parent.args.index(ref) + (parent.func.id == "enumerate")
        elif not (isinstance(loop, ast.For) and loop.iter is ref):
            return None
        target = loop.target
        if index is not None:
            target = target.elts[index] if isinstance(target, ast.Tuple) and index < len(target.elts) else None
        return (loop, target.id) if isinstance(target, ast.Name) else None

    def _reads(self, scope: ast.AST, name: str, source: _Source, entry: bool) -> ParameterUse:
        """The uses of every read of ``name`` in ``scope`` (an entry container's: its indexed reads)."""
        use = ParameterUse()
        for read in ast.walk(scope):
            if not (isinstance(read, ast.Name) and read.id == name and isinstance(read.ctx, ast.Load)):
                continue
            parent = source.parents.get(read)
            if entry and isinstance(parent, ast.Subscript) and parent.value is read:
                use = use + self._classify(parent, source, entry=False)
            else:
                use = use + self._classify(read, source, entry=entry)
        return use

    # --------------------------------------------------------------------------------- calls
    def _call(self, call: ast.Call, ref: ast.AST, keyword: Optional[str], where: str, entry: bool) -> ParameterUse:
        position = None if keyword is not None else call.args.index(ref)
        text = f"{where}: {ast.unparse(call.func)}(...)"
        if keyword is None and any(isinstance(a, ast.Starred) for a in call.args[:position]):
            return ParameterUse(unresolved=(f"{text} (after a *args)",))
        if keyword is None and isinstance(ref, ast.Starred):
            return ParameterUse(unresolved=(text,))
        target = self._resolve(call.func)
        if not entry:
            layout = self._gemm_layout(call, target, position, keyword)
            if layout == _UNKNOWN:
                return ParameterUse(unresolved=(f"{text} (an equation computed at run time)",))
            if layout is not None:
                return ParameterUse(layouts=(layout,)) if isinstance(layout, SiteLayout) else ParameterUse()
        if target is _MISSING:
            return ParameterUse(unresolved=(f"{text} (not resolvable from the source)",))
        if _is_torch(target) and not isinstance(target, nn.Module):
            return ParameterUse()  # a torch function that is not a GEMM
        return self._follow(target, position, keyword, text, entry)

    def _gemm_layout(
        self, call: ast.Call, target: Any, position: Optional[int], keyword: Optional[str]
    ) -> "SiteLayout | str | None":
        """The orientation if ``call`` is a GEMM with the Parameter as its weight operand;
        ``_NOT_A_SITE`` if it is a GEMM or a Tensor method with the Parameter elsewhere;
        ``_UNKNOWN`` for an ``einsum`` whose equation is not in the source; else ``None``."""
        if target is torch.einsum:
            equation = call.args[0] if call.args else None
            if position != 2:
                return _NOT_A_SITE
            if isinstance(equation, ast.Constant) and isinstance(equation.value, str):
                return einsum_layout(equation.value) or _NOT_A_SITE
            return _UNKNOWN
        table = next((args for function, args in _GEMM_ARGS.items() if function is target), None)
        if table is None and target is _MISSING and isinstance(call.func, ast.Attribute):
            name = call.func.attr
            table = _GEMM_METHOD_ARGS.get(name)
            if table is None:  # x.add(P), x.index_select(0, P): a Tensor method, no GEMM
                return _NOT_A_SITE if hasattr(torch.Tensor, name) else None
        if table is None:
            return None
        for index, name, layout in table:
            if position == index or keyword == name:
                return layout
        return _NOT_A_SITE

    def _resolve(self, expr: ast.AST) -> Any:
        """The object a call's function expression names, or ``_MISSING`` (a local, an expression)."""
        if isinstance(expr, ast.Name):
            if expr.id == "self":
                return self.owner if self.owner is not None else _MISSING
            if expr.id in self.globals:
                return self.globals[expr.id]
            return getattr(builtins, expr.id, _MISSING)
        if isinstance(expr, ast.Attribute):
            base = self._resolve(expr.value)
            if base is _MISSING:
                return _MISSING
            if isinstance(base, nn.Module):
                return _module_member(base, expr.attr)
            if isinstance(base, (types.ModuleType, type)):
                return getattr(base, expr.attr, _MISSING)
        return _MISSING

    def _follow(self, target: Any, position: Optional[int], keyword: Optional[str], text: str, entry: bool) -> ParameterUse:
        """The uses of the argument inside ``target``'s source."""
        if isinstance(target, nn.Module):
            owner, function = target, type(target).forward.__get__(target)
        elif isinstance(target, types.MethodType) and isinstance(target.__self__, nn.Module):
            owner, function = target.__self__, target
        elif inspect.isfunction(target):
            owner, function = None, target
        else:  # a class, a functools.partial, a callable object: its code is not read
            return ParameterUse(unresolved=(f"{text} (a {type(target).__name__}, not a function)",))
        if self.depth + 1 > MAX_CALL_DEPTH:
            return ParameterUse(unresolved=(f"{text} (more than {MAX_CALL_DEPTH} calls deep)",))
        name = _argument_name(function, position, keyword)
        if name is None:
            return ParameterUse(unresolved=(f"{text} (argument not mapped to a parameter)",))
        raw = inspect.unwrap(getattr(function, "__func__", function))
        tree = _parse(raw)
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))] if tree else []
        if not functions:
            return ParameterUse(unresolved=(f"{text} (no source)",))
        refs = [n for n in ast.walk(functions[0]) if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)]
        reader = _Reader(getattr(raw, "__globals__", {}), owner, self.depth + 1)
        return reader.uses(tree, refs, entry, where=f"{text.split(':')[0]} -> {raw.__qualname__}")


def _module_member(module: nn.Module, name: str) -> Any:
    """``module.<name>`` as code would get it, without running a property: a child module, a method
    (bound), or an instance attribute."""
    if name in module._modules:
        return module._modules[name]
    if name in module.__dict__:
        return module.__dict__[name]
    try:
        member = inspect.getattr_static(type(module), name)
    except AttributeError:
        return _MISSING
    if isinstance(member, staticmethod):
        return member.__func__
    if isinstance(member, classmethod):
        return types.MethodType(member.__func__, type(module))
    if inspect.isfunction(member):
        return types.MethodType(member, module)
    return _MISSING


def _argument_name(function: Callable, position: Optional[int], keyword: Optional[str]) -> Optional[str]:
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return None
    if keyword is not None:
        parameter = parameters.get(keyword)
        ok = parameter is not None and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
        return keyword if ok else None
    positional = [p.name for p in parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return positional[position] if position is not None and position < len(positional) else None

