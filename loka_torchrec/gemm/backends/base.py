"""The interface every GEMM backend implements, and the registry that names them."""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar, Dict, List, Optional, Tuple, Type

import torch

from loka_torchrec.gemm.recipes import GemmRecipe, OperandSpec, split_fast_accum
from loka_torchrec.evidence import GemmShape

__all__ = [
    "Availability",
    "GemmBackend",
    "BackendUnavailableError",
    "register_backend",
    "get_backend",
    "backend_names",
]


class BackendUnavailableError(RuntimeError):
    """A backend was asked for on a machine where it cannot run."""


@dataclasses.dataclass(frozen=True)
class Availability:
    """Whether a backend can run on a device, and why not when it cannot."""

    ok: bool
    reason: str = ""


class GemmBackend(abc.ABC):
    """One way to compute ``C (M, N) = A (M, K) @ B (N, K)^T`` with quantized operands.

    A backend quantizes operands (:meth:`quantize`, returning whatever operand type its GEMM
    wants) and multiplies them (:meth:`mm`). The two are separate so that a caller can quantize
    a weight once per step and reuse it, and keep a saved activation in the backend's format.
    Optional abilities are methods here whose default says "not supported"
    (:meth:`quantize_with_transpose`, with :attr:`quantizes_with_transpose`).

    Class attributes a backend declares:
        name: registry name, e.g. ``"scaled_mm"``.
        recipes: recipe names it implements (see :mod:`loka_torchrec.gemm.recipes`).
        devices: device types it can run on (``"cpu"``, ``"cuda"``).
        fused_quantize: whether its quantization is a single fused kernel.
        in_auto: whether ``candidates: [auto]`` includes it (a backend that is never the fastest
            can opt out; it stays selectable by name).
        compile_recipes: the recipes whose quantization and GEMM ``torch.compile`` traces
            (``fullgraph=True``: aten or ``torch.library`` operators with fake implementations);
            Dispatch offers only these when the layers run compiled (``dispatch.compiled``).
    """

    name: ClassVar[str]
    recipes: ClassVar[Tuple[str, ...]]
    devices: ClassVar[Tuple[str, ...]]
    fused_quantize: ClassVar[bool] = False
    in_auto: ClassVar[bool] = True
    compile_recipes: ClassVar[Tuple[str, ...]] = ()

    def __init__(self) -> None:
        self._availability: Dict[str, Availability] = {}

    # ----------------------------------------------------------------------------- capability
    def availability(self, device: "torch.device | str") -> Availability:
        """Cheap, cached check that this backend runs on ``device``, with the reason if not."""
        device = torch.device(device)
        key = str(device)
        if key not in self._availability:
            if device.type not in self.devices:
                result = Availability(False, f"{self.name} runs on {'/'.join(self.devices)}, not {device.type}")
            else:
                try:
                    result = self._probe(device)
                except Exception as exc:  # a failing probe is an unavailable backend, with its reason
                    result = Availability(False, f"{type(exc).__name__}: {exc}")
            self._availability[key] = result
        return self._availability[key]

    def _probe(self, device: torch.device) -> Availability:
        """Backend-specific availability check; the default says yes."""
        return Availability(True)

    def auto_recipes(self, device: "torch.device | str") -> Tuple[str, ...]:
        """The recipes ``candidates: [auto]`` offers on ``device``.

        All of :attr:`recipes`, except the ``_fast_accum`` twins off CUDA: fast accumulation is a
        tensor-core mode, and elsewhere the twin runs the same kernel as its base recipe, so
        measuring it would only double the planning work.
        """
        if torch.device(device).type == "cuda":
            return self.recipes
        return tuple(r for r in self.recipes if not split_fast_accum(r)[1])

    def alignment(self, device: "torch.device | str", recipe: Optional[GemmRecipe] = None) -> int:
        """Required multiple for ``K`` and ``N`` on ``device`` (1 = no constraint); a recipe with
        coarser tiles (``recipe``) may need more, also of the rows that ``LokaLinear`` pads."""
        return 1

    def check(self, recipe: GemmRecipe, shape: GemmShape, device: "torch.device | str") -> Optional[str]:
        """``None`` if this backend can run ``recipe`` at ``shape`` on ``device``, else the reason."""
        available = self.availability(device)
        if not available.ok:
            return available.reason
        if recipe.name not in self.recipes:
            return f"{self.name} has no recipe {recipe.name!r} (has: {', '.join(self.recipes)})"
        align = self.alignment(device, recipe)
        if align > 1 and (shape.k % align or shape.n % align):
            return f"{self.name} needs K and N to be multiples of {align} on {torch.device(device).type}; got K={shape.k}, N={shape.n}"
        return None

    def padded_shape(
        self, shape: GemmShape, device: "torch.device | str", recipe: Optional[GemmRecipe] = None
    ) -> GemmShape:
        """``shape`` with every dim rounded up to :meth:`alignment` (for ``recipe``): what
        ``LokaLinear`` runs (it zero-pads the operands, which changes neither the product nor any amax)."""
        align = self.alignment(device, recipe)
        return GemmShape(*(-(-d // align) * align for d in (shape.m, shape.k, shape.n)))

    def check_padded(self, recipe: GemmRecipe, shape: GemmShape, device: "torch.device | str") -> Optional[str]:
        """:meth:`check` at :meth:`padded_shape`: ``None`` if a ``LokaLinear`` GEMM of ``shape`` can
        run here on this backend, else the reason."""
        return self.check(recipe, self.padded_shape(shape, device, recipe), device)

    def compile_reason(self, recipe: str) -> Optional[str]:
        """``None`` if ``recipe`` runs under ``torch.compile``, else why not."""
        if recipe in self.compile_recipes:
            return None
        return f"{self.name}:{recipe} does not trace under torch.compile (its kernels have no fake implementation)"

    # ----------------------------------------------------------------------------- compute
    @abc.abstractmethod
    def quantize(self, t: torch.Tensor, spec: OperandSpec, *, name: str = "operand") -> Any:
        """Quantize a ``(rows, K)`` operand (any strides) into this backend's operand type."""

    @abc.abstractmethod
    def mm(self, a: Any, b: Any, recipe: GemmRecipe, out_dtype: torch.dtype) -> torch.Tensor:
        """``A @ B^T`` of two operands from :meth:`quantize`; returns ``(M, N)`` in ``out_dtype``."""

    # ----------------------------------------------------------------------------- optional
    @property
    def quantizes_with_transpose(self) -> bool:
        """Whether this backend implements :meth:`quantize_with_transpose` (it overrides it)."""
        return type(self).quantize_with_transpose is not GemmBackend.quantize_with_transpose

    def quantize_with_transpose(self, t: torch.Tensor, spec: OperandSpec, *, name: str = "operand") -> Tuple[Any, Any]:
        """``t`` (rows, K) and ``t^T`` (K, rows) as two operands of ``spec`` (tensorwise or rowwise),
        from one read of ``t``.

        Optional: ``LokaLinear`` calls it eagerly, where one backend quantizes ``x`` for the forward
        GEMM and ``x^T`` for grad-weight (or ``dy`` and ``dy^T``) with the same spec, and only where
        :attr:`quantizes_with_transpose` says so; otherwise it quantizes the two separately.

        Raises:
            NotImplementedError: this backend does not support it (the default).
        """
        raise NotImplementedError(f"{self.name}: quantize_with_transpose is not supported; quantize t and t.t() separately")

    def gemm(self, a: torch.Tensor, b: torch.Tensor, recipe: GemmRecipe, out_dtype: torch.dtype) -> torch.Tensor:
        """Quantize both high-precision operands and multiply: ``A (M, K) @ B (N, K)^T``."""
        return self.mm(self.quantize(a, recipe.a, name="A"), self.quantize(b, recipe.b, name="B"), recipe, out_dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, recipes={self.recipes})"


_REGISTRY: Dict[str, GemmBackend] = {}


def register_backend(cls: Type[GemmBackend]) -> Type[GemmBackend]:
    """Class decorator: register a backend under ``cls.name`` (a duplicate name is refused)."""
    if cls.name in _REGISTRY:
        raise ValueError(f"a GEMM backend named {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls()
    return cls


def backend_names() -> List[str]:
    return sorted(_REGISTRY)


def get_backend(name: str) -> GemmBackend:
    """The registered backend ``name``; a clear error lists the known names."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"backend: unknown GEMM backend {name!r}; expected one of {', '.join(backend_names())}") from None
