"""``LokaLinear``: a drop-in ``nn.Linear`` whose three GEMMs each run on their own kernel.

A linear layer computes three GEMMs per training step (operand layouts as in
:mod:`loka_torchrec.evidence`, ``C = A @ B^T``):

=========  ========================  ===================  ===================
role       GEMM                      A                    B
=========  ========================  ===================  ===================
``fwd``    ``y  = x @ W^T``          ``x`` (rows, in)     ``W`` (out, in)
``dgrad``  ``dx = dy @ W``           ``dy`` (rows, out)   ``W^T`` (in, out)
``wgrad``  ``dW = dy^T @ x``         ``dy^T`` (out, rows) ``x^T`` (in, rows)
=========  ========================  ===================  ===================

:class:`LokaLinear` routes each one to the backend and recipe its
:class:`~loka_torchrec.dispatch.layer_kernels.LayerKernels` names, through a stateless
``autograd.Function`` whose configuration is a frozen
:class:`~loka_torchrec.dispatch.role_kernels.SitePlan`.

**Under ``torch.compile``** (the way LoKA runs on a GPU) the layer traces into one graph with
its neighbours (``fullgraph=True``):

* the plan is static module state, fixed when the kernels are set; a new plan is a new constant,
  so a re-plan recompiles once and nothing else does;
* operands are quantized with plain torch ops (amax, scale, saturating cast;
  :func:`loka_torchrec.fp8.quantize`), which Inductor fuses into the op that produced the
  operand (a norm, an activation, the previous GEMM's epilogue) and into the zero padding;
* the GEMM is ``torch._scaled_mm`` or another backend's operator with a fake implementation
  (a backend declares which recipes trace: ``GemmBackend.compile_recipes``);
* the row count never specializes the graph: padding of the rows (grad-weight's reduction dim)
  is symbolic, so a varying batch (HSTU's jagged tokens) compiles once with a dynamic dim;
* where grad-input reads the weight with the forward's tensorwise spec, the forward's FP8 weight
  is transposed and kept for the backward (1 byte per weight element), so the backward reads the
  high-precision weight neither for an amax nor for a second cast;
* nothing Python-side changes per call: no weight cache, no counters on the host.

**Eagerly** (probe steps, CPUs, debugging) the layer keeps what saves work between calls:

* the quantized weight, cached per ``(weight._version, data_ptr)``, the process's count of
  optimizer steps and the operand spec, so forward, grad-input and micro-batches between two
  optimizer steps quantize it once (PyTorch's fused optimizers update a weight in place without
  bumping ``_version``, hence the step count; for tensorwise the
  grad-input ``W^T`` is the forward's FP8 bytes transposed; rowwise needs a second quantization
  along the other axis);
* the operand quantization on CUDA is the project's fused Triton kernel (one pass);
* :attr:`LokaLinear.last_rows` and the input dtypes, read by the Probe and Dispatch.

In both modes the saved activation for an FP8 grad-weight is its FP8 operand (1 byte per element),
never a second high-precision copy.

**Non-finite values.** Operands are quantized with ``nonfinite="propagate"``: a group holding inf
or NaN gets a NaN scale, so every output reading it is NaN, never silently finite; each such
scaling group adds one to ``nonfinite_events``. Eagerly, every FP8 operand is counted (in batches
of up to 64, one reduction on the device, no sync); compiled, the forward's operands are counted
inside the graph (a non-finite gradient still shows as NaN weight gradients, and the Probe's eager
steps count it).

**Shapes a backend cannot take.** Checked once per plan (``GemmBackend.check``). Where the
backend needs dims that are multiples of an alignment (``GemmBackend.alignment``: 16 for
``torch._scaled_mm`` on CUDA, 128 for Transformer Engine's blockwise tiles), the operands are
zero-padded: zeros add nothing to a dot product and change no amax, so the result is exact. A
kernel that cannot run even padded runs that GEMM in high precision, with the reason in
:attr:`LokaLinear.fallback_reasons`.

When every GEMM runs in high precision and the input has the high-precision dtype (fp32 on the
CPU, bf16 on CUDA) the layer calls ``torch.nn.functional.linear``: it is then ``nn.Linear``.

Where each part lives:

* :mod:`~loka_torchrec.dispatch.gemm_site`: :class:`~loka_torchrec.dispatch.gemm_site.GemmSite`, the
  base of every site (kernels, plan, counters, delayed scaling), which :class:`LokaLinear` extends;
* :mod:`~loka_torchrec.dispatch.role_kernels`: the per-device plan of the three GEMMs;
* :mod:`~loka_torchrec.dispatch.gemm_function`: the autograd function and its GEMM helpers;
* :mod:`~loka_torchrec.dispatch.quantizer`: operand quantization and the non-finite count;
* :mod:`~loka_torchrec.dispatch.operands`: padding, transposes and packing of operands;
* :mod:`~loka_torchrec.dispatch.eager_cache`: the weight cache of eager calls.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from loka_torchrec.dispatch.layer_kernels import LayerKernels
from loka_torchrec.dispatch.gemm_site import AMAX_HISTORY, GemmSite, compiled_scaling, compiling
from loka_torchrec.fp8 import Fp8Format

__all__ = ["AMAX_HISTORY", "GemmSite", "LokaLinear", "compiled_scaling", "compiling"]


class LokaLinear(GemmSite, nn.Linear):
    """``nn.Linear`` with a separately chosen kernel for each of its three GEMMs.

    Same parameters and ``state_dict`` keys as ``nn.Linear`` (``weight``, ``bias``), so checkpoints
    move both ways. Compiles with ``torch.compile(fullgraph=True)``; see the module docstring for
    what differs between compiled and eager calls.

    Args:
        in_features, out_features, bias, device, dtype: as for ``nn.Linear``.
        kernels: backend and recipe per GEMM role; default all high precision.
        grad_format: FP8 format of the gradient operand (``A`` of ``dgrad`` and ``wgrad``).
        forward_scaling: ``"current"`` (default) or ``"delayed"`` (compiled): what scales the
            forward's FP8 operands, see :class:`GemmSite`.

    Attributes:
        last_rows: rows (product of the leading dims) of the last eager forward input; a Python int.
        last_input_dtype, last_autocast_dtype: dtype of the last eager forward input, and the
            autocast dtype it ran under (``None``: autocast off); the layer check times the layer so.
        nonfinite_events: int64 scalar tensor on the layer's device (a non-persistent buffer, not
            in ``state_dict``): scaling groups of FP8-quantized operands whose amax was inf or
            NaN. Per rank (TorchRec's DDP wrapper does not broadcast buffers); reading it on the
            host syncs.
        fallback_reasons: role -> why the planned kernel cannot run on this layer's device (that
            GEMM runs in high precision instead). Reset by :meth:`set_kernels`.

    Example::

        >>> from loka_torchrec.evidence import KernelChoice
        >>> layer = LokaLinear(64, 32, kernels=LayerKernels(fwd=KernelChoice("emulated", "rowwise")))
        >>> y = layer(torch.randn(2, 3, 64))
        >>> y.sum().backward()
        >>> tuple(y.shape), layer.last_rows, layer.weight.grad.shape
        ((2, 3, 32), 6, torch.Size([32, 64]))
        >>> layer
        LokaLinear(in_features=64, out_features=32, bias=True, fwd=emulated:rowwise, dgrad=bf16:hp, wgrad=bf16:hp, grad_format=e4m3)
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
        *,
        kernels: LayerKernels = LayerKernels(),
        grad_format: Fp8Format = Fp8Format.E4M3,
        forward_scaling: str = "current",
    ) -> None:
        nn.Linear.__init__(self, in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_dispatch(kernels, grad_format, self.weight.device, forward_scaling)

    # ----------------------------------------------------------------------------- conversion
    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        kernels: LayerKernels = LayerKernels(),
        grad_format: Fp8Format = Fp8Format.E4M3,
        forward_scaling: str = "current",
    ) -> "LokaLinear":
        """A ``LokaLinear`` that shares ``linear``'s ``Parameter`` objects (no copy).

        Optimizers and wrappers built afterwards, or already holding those parameters, see the
        same tensors. The training/eval mode is kept.

        Args:
            linear: the layer to wrap (any ``nn.Linear``, on any device).
            kernels, grad_format, forward_scaling: as for the constructor.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear: expected an nn.Linear, got {type(linear).__name__}")
        if isinstance(linear.weight, nn.parameter.UninitializedParameter):
            raise ValueError("linear: its weight is uninitialized (LazyLinear); run one forward first")
        weight = linear.weight
        # Built on 'meta' so nothing is allocated, then given linear's own parameters.
        new = cls(
            linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta", dtype=weight.dtype,
            kernels=kernels, grad_format=grad_format, forward_scaling=forward_scaling,
        )  # fmt: skip
        new.weight = weight
        new.bias = linear.bias
        new._runtime_buffers(weight.device)
        new.set_kernels(kernels)  # planned for the real device now that the weight is there
        new.train(linear.training)
        return new

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` sharing this layer's ``Parameter`` objects, in the same mode."""
        linear = nn.Linear(
            self.in_features, self.out_features, bias=self.bias is not None, device="meta", dtype=self.weight.dtype
        )
        linear.weight = self.weight
        linear.bias = self.bias
        linear.train(self.training)
        return linear

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``y = x W^T + b`` with each GEMM on its planned kernel (see :meth:`GemmSite._site_forward`).

        Args:
            input: ``(*, in_features)`` floating point tensor.

        Returns:
            ``(*, out_features)`` tensor, as ``nn.Linear`` returns it.
        """
        return self._site_forward(input, self.weight, self.bias)

    def _shape_repr(self) -> str:
        return nn.Linear.extra_repr(self)
