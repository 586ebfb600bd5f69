"""TorchRec ``QuantizedCommCodec`` implementations: FP8 with per-block scales, bf16 and fp32.

How TorchRec calls a codec on the pooled all-to-all (``torchrec/distributed/comm_ops.py``),
which fixes the shape of everything here:

1. ``ctx = codec.create_context()``;
2. ``codec.padded_size(x, dim_sum_per_rank, my_rank, ctx)`` with ``x`` the ``(B_global,
   D_local_sum)`` embeddings; a nonzero padding makes TorchRec pad ``x`` to 2-D, otherwise it
   passes ``x.view(-1)``, and it strips the padding of ``ctx.padded_dim_sum_per_rank`` on receipt;
3. ``payload = codec.encode(x, ctx)``: one flat tensor of dtype ``quantized_dtype`` for *all*
   destinations: the codec never sees the split sizes;
4. the split sizes become ``codec.calc_quantized_size(n_values, ctx)`` per destination, in
   elements of ``quantized_dtype``; ``all_to_all_single`` moves the payload;
5. ``codec.decode(received, ctx)`` gets the concatenated payloads of all senders, flat.

The backward pass does the same with the ``backward`` codec and a fresh context, without
padding. TorchRec's *sync* path (``set_use_sync_collectives(True)``, and any pooled or sequence
all-to-all traced by Dynamo) never calls the ``backward`` codec: it runs steps 1-5 under autograd
and sends the gradient of the payload back through the same all-to-all, in the payload's dtype
and divided by the world size. FP8 bytes with per-block scales cannot carry a gradient, so there
:class:`Fp8CommCodec` carries the values as a float payload while gradients are needed (see
:meth:`Fp8CommCodec.create_context`). The sequence all-to-all skips ``padded_size``; the reduce-scatter calls ``encode`` and
``decode`` with no context and sums the payload on the wire. So FP8 payloads are a sequence of
self-contained records of ``block`` values plus their scale (see
:mod:`loka_torchrec.kernels.fp8_comm_codec`): any split at a multiple of ``block`` values is a
valid payload, and the scale bytes travel inside the same ``uint8`` tensor.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch.autograd.profiler import record_function

from loka_torchrec.comms.choice import CommsSelection
from loka_torchrec.comms.config import CommsConfig
from loka_torchrec.fp8 import Fp8Format
from loka_torchrec.kernels import fp8_comm_codec as wire

try:  # TorchRec's switch between its async collectives and the autograd-traced sync ones
    from torchrec.distributed.comm_ops import get_use_sync_collectives
except ImportError:  # an older TorchRec without the sync path
    def get_use_sync_collectives() -> bool:
        return False

logger = logging.getLogger(__name__)
_warned_sync = set()  # codec names whose sync-path step-down was logged (once per process)

__all__ = [
    "CommCodecContext",
    "NonFiniteCounters",
    "Fp8CommCodec",
    "Bf16CommCodec",
    "Fp32CommCodec",
    "AutoCommCodec",
]


@dataclasses.dataclass
class CommCodecContext:
    """State that TorchRec carries from ``encode`` to ``decode`` of one collective.

    Attributes:
        block: values per scale for this collective.
        dtype: dtype of the tensor given to ``encode``; ``decode`` returns this dtype.
        padded_dim_sum_per_rank: per-rank embedding widths after padding to a multiple of
            ``block`` (set by ``padded_size`` only when some rank needs padding; TorchRec reads it).
        row_dim: kept at 0. TorchRec's variable-batch path reads ``ctx.row_dim`` and applies
            FBGEMM-specific row padding when it is positive; this codec pads through
            ``padded_size`` instead.
        carrier: set by :meth:`Fp8CommCodec.create_context` on TorchRec's sync path while
            gradients are needed: the float dtype the values travel in instead of FP8 bytes.
    """

    block: int = 0
    dtype: Optional[torch.dtype] = None
    padded_dim_sum_per_rank: Optional[List[int]] = None
    row_dim: int = 0
    carrier: Optional[torch.dtype] = None


class NonFiniteCounters:
    """Counts of inf/NaN values that the codecs sent and received, without host synchronization.

    Each codec adds to ``"<comm op>/<direction>/sent"`` (non-finite values in what it encoded)
    and ``"<comm op>/<direction>/received"`` (non-finite values in what it decoded). Counts
    accumulate on the payload's device; reading them (``as_dict``) synchronizes.

    Example::

        >>> counters = NonFiniteCounters()
        >>> codec = Fp8CommCodec("e4m3", block=2, name="a2a/forward", counters=counters)
        >>> _ = codec.decode(codec.encode(torch.tensor([1.0, float("inf")])))
        >>> counters.as_dict()
        {'a2a/forward/sent': 1, 'a2a/forward/received': 1}
    """

    def __init__(self) -> None:
        self._slots: Dict[Tuple[str, torch.device], torch.Tensor] = {}
        self._lock = threading.Lock()  # the backward pass runs on autograd's own thread

    # A lock cannot be pickled or deep-copied; a copy (e.g. of a sharder holding these counters)
    # gets the counts so far and a lock of its own.
    def __getstate__(self) -> Dict[str, object]:
        with self._lock:
            return {"_slots": dict(self._slots)}

    def __setstate__(self, state: Dict[str, object]) -> None:
        self._slots = state["_slots"]
        self._lock = threading.Lock()

    def slot(self, key: str, device: torch.device) -> torch.Tensor:
        """The 1-element int64 tensor on ``device`` that counts ``key``."""
        device = torch.device(device)
        with self._lock:
            tensor = self._slots.get((key, device))
            if tensor is None:
                tensor = torch.zeros(1, dtype=torch.int64, device=device)
                self._slots[(key, device)] = tensor
            return tensor

    def as_dict(self) -> Dict[str, int]:
        """``{key: count}`` summed over devices (synchronizes with the devices)."""
        out: Dict[str, int] = {}
        with self._lock:
            items = list(self._slots.items())
        for (key, _), tensor in items:
            out[key] = out.get(key, 0) + int(tensor.item())
        return out

    def total(self) -> int:
        return sum(self.as_dict().values())

    def reset(self) -> None:
        with self._lock:
            for tensor in self._slots.values():
                tensor.zero_()


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1) if x.is_contiguous() else x.contiguous().reshape(-1)


class Fp8CommCodec:
    """FP8 payload with one scale per ``block`` values, in TorchRec's ``QuantizedCommCodec`` shape.

    Args:
        fmt: ``"e4m3"`` or ``"e5m2"``.
        block: values per scale (an embedding row, or a fixed block).
        scale_format: ``"fp32"`` or ``"e8m0"``.
        kernel: ``"auto"`` (Triton for CUDA tensors when importable, else torch ops), ``"torch"``
            or ``"triton"``.
        name: ``"<comm op>/<direction>"``, the prefix of this codec's counters.
        counters: where to count non-finite values; a private one when ``None``.
        block_source: how ``block`` was chosen (shown in ``repr``): ``"row"``, ``"fixed"`` or
            ``"default"``.
        sync_carrier: the float dtype the values travel in on TorchRec's sync path while
            gradients are needed (``torch.bfloat16`` or ``torch.float32``): the gradient comes
            back in it.

    Example::

        >>> codec = Fp8CommCodec("e4m3", block=4, kernel="torch")
        >>> x = torch.tensor([[0.5, -1.0, 2.0, 4.0], [0.0, 0.0, 0.0, 0.0]])
        >>> payload = codec.encode(x)
        >>> payload.dtype, codec.calc_quantized_size(x.numel())
        (torch.uint8, 16)
        >>> codec.decode(payload)
        tensor([ 0.5000, -1.0000,  2.0000,  4.0000,  0.0000,  0.0000,  0.0000,  0.0000])
    """

    def __init__(
        self,
        fmt="e4m3",
        *,
        block: int,
        scale_format: str = "fp32",
        kernel: str = "auto",
        name: str = "fp8",
        counters: Optional[NonFiniteCounters] = None,
        block_source: str = "fixed",
        sync_carrier: torch.dtype = torch.bfloat16,
    ) -> None:
        self.fmt = Fp8Format.parse(fmt, field="fmt")
        if self.fmt not in wire.SUPPORTED_FORMATS:
            raise ValueError(f"fmt: expected e4m3 or e5m2, got {self.fmt.value}")
        if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
            raise ValueError(f"block: expected a positive int, got {block!r}")
        if scale_format not in wire.SCALE_BYTES:
            raise ValueError(f"scale_format: expected one of {sorted(wire.SCALE_BYTES)}, got {scale_format!r}")
        if kernel not in ("auto", "torch", "triton"):
            raise ValueError(f"kernel: expected 'auto', 'torch' or 'triton', got {kernel!r}")
        if kernel == "triton" and not wire.HAS_TRITON:
            raise ValueError("kernel='triton' but triton is not importable; use kernel='auto' or 'torch'")
        if sync_carrier not in (torch.bfloat16, torch.float32):
            raise ValueError(f"sync_carrier: expected torch.bfloat16 or torch.float32, got {sync_carrier}")
        self.sync_carrier = sync_carrier
        self.block = block
        self.scale_format = scale_format
        self.kernel = kernel
        self.name = name
        self.counters = counters if counters is not None else NonFiniteCounters()
        self.block_source = block_source

    # --- TorchRec QuantizedCommCodec protocol ---------------------------------------------

    @property
    def quantized_dtype(self) -> torch.dtype:
        return torch.uint8

    def create_context(self) -> CommCodecContext:
        """A context for one collective; on TorchRec's sync path with autograd on, a float carrier.

        TorchRec's sync path sends the payload's gradient back through the same all-to-all, in
        the payload's dtype and divided by the world size, and never calls the ``backward``
        codec: FP8 bytes would cut the gradient (embeddings get none, or the backward raises
        "element 0 of tensors does not require grad"). There the values travel as
        ``sync_carrier`` (logged once per codec), and FP8 stays for the async path and for
        sync collectives under ``torch.no_grad()``.
        """
        ctx = CommCodecContext(block=self.block)
        if torch.is_grad_enabled() and get_use_sync_collectives():
            ctx.carrier = self.sync_carrier
            if self.name not in _warned_sync:
                _warned_sync.add(self.name)
                logger.warning(
                    "loka comms: %s runs on TorchRec's sync collectives, which send gradients back in the "
                    "payload's dtype; FP8 bytes cannot carry them, so it uses %s while gradients are needed",
                    self.name,
                    str(self.sync_carrier).replace("torch.", ""),
                )
        return ctx

    def encode(self, input_tensor: torch.Tensor, ctx: Optional[CommCodecContext] = None) -> torch.Tensor:
        """``(..., )`` float tensor -> 1-D ``uint8`` payload (records of ``block`` values + scale).

        With ``ctx.carrier`` set (sync path, see :meth:`create_context`): a differentiable cast
        to that dtype, shape kept.
        """
        if not input_tensor.is_floating_point():
            raise TypeError(f"{self.name}: encode expects a floating point tensor, got {input_tensor.dtype}")
        block = self._block(ctx)
        if ctx is not None:
            ctx.dtype = input_tensor.dtype
            if ctx.carrier is not None:
                with record_function(f"## loka {ctx.carrier} encode {self.name} ##"):
                    self.counters.slot(f"{self.name}/sent", input_tensor.device).add_((~torch.isfinite(input_tensor)).sum())
                    return input_tensor.to(ctx.carrier)
        with record_function(f"## loka fp8 encode {self.name} ##"):
            count = self.counters.slot(f"{self.name}/sent", input_tensor.device)
            return wire.encode(
                _flat(input_tensor), block=block, fmt=self.fmt, scale_format=self.scale_format,
                count=count, kernel=self._kernel_for(input_tensor),
            )  # fmt: skip

    def decode(self, input_grad: torch.Tensor, ctx: Optional[CommCodecContext] = None) -> torch.Tensor:
        """1-D ``uint8`` payload (any number of senders) -> 1-D tensor of ``ctx.dtype`` (else fp32)."""
        block = self._block(ctx)
        out_dtype = ctx.dtype if ctx is not None and ctx.dtype is not None else torch.float32
        if ctx is not None and ctx.carrier is not None:
            with record_function(f"## loka {ctx.carrier} decode {self.name} ##"):
                self.counters.slot(f"{self.name}/received", input_grad.device).add_((~torch.isfinite(input_grad)).sum())
                return input_grad.to(out_dtype)
        with record_function(f"## loka fp8 decode {self.name} ##"):
            count = self.counters.slot(f"{self.name}/received", input_grad.device)
            return wire.decode(
                _flat(input_grad), block=block, fmt=self.fmt, scale_format=self.scale_format,
                out_dtype=out_dtype, count=count, kernel=self._kernel_for(input_grad),
            )  # fmt: skip

    def calc_quantized_size(self, input_len: int, ctx: Optional[CommCodecContext] = None) -> int:
        """Payload length in bytes of ``input_len`` values (a multiple of the block); ``input_len`` with a carrier."""
        if ctx is not None and ctx.carrier is not None:
            return input_len
        block = self._block(ctx)
        if input_len % block:
            raise ValueError(
                f"{self.name}: a split of {input_len} values is not a multiple of the FP8 comm block "
                f"of {block} values ({self.block_source}); choose CommsConfig.block_size dividing every "
                "embedding dim, or build the codecs with loka_torchrec.comms.sharders() / "
                "registry(config, embedding_dims=...) so the block follows the embedding rows"
            )
        return wire.encoded_size(input_len, block, self.scale_format)

    def padded_size(
        self,
        input_tensor: torch.Tensor,
        dim_per_rank: List[int],
        my_rank: int,
        qcomm_ctx: Optional[CommCodecContext],
    ) -> Tuple[int, int]:
        """Pad each rank's embedding width to a multiple of the block: ``(padded width, padding)``."""
        if input_tensor.dim() == 1:
            return input_tensor.shape[0], 0
        if qcomm_ctx is not None and qcomm_ctx.carrier is not None:
            return input_tensor.shape[1], 0
        block = self._block(qcomm_ctx)
        padding = [(-dim_sum) % block for dim_sum in dim_per_rank]
        if not any(padding):
            return input_tensor.shape[1], 0
        if qcomm_ctx is not None:
            # Set whenever *any* rank pads: the receive side splits by every sender's padded width.
            qcomm_ctx.padded_dim_sum_per_rank = [d + p for d, p in zip(dim_per_rank, padding)]
        return dim_per_rank[my_rank] + padding[my_rank], padding[my_rank]

    # --- reporting ------------------------------------------------------------------------

    @property
    def bytes_per_value(self) -> float:
        """Bytes on the wire per embedding value, scales included."""
        return wire.record_bytes(self.block, self.scale_format) / self.block

    def kernel_description(self) -> str:
        if self.kernel == "torch" or not wire.HAS_TRITON:
            return "torch ops"
        if self.kernel == "triton":
            return "triton"
        return "triton on CUDA tensors, torch ops otherwise"

    def __repr__(self) -> str:
        return (
            f"Fp8CommCodec({self.name}: {self.fmt.value}, block={self.block} ({self.block_source}), "
            f"scale={self.scale_format}, {self.bytes_per_value:.4f} bytes/value, kernel={self.kernel_description()})"
        )

    def _block(self, ctx: Optional[CommCodecContext]) -> int:
        return ctx.block if ctx is not None and ctx.block > 0 else self.block

    def _kernel_for(self, t: torch.Tensor) -> str:
        if self.kernel == "auto":
            return "triton" if wire.triton_usable(t) else "torch"
        return self.kernel


class Bf16CommCodec:
    """bf16 payload (round to nearest even), shape preserved; non-finite values are counted.

    Example::

        >>> codec = Bf16CommCodec()
        >>> codec.decode(codec.encode(torch.tensor([1.0, 3.14159])))
        tensor([1.0000, 3.1406])
    """

    def __init__(self, *, name: str = "bf16", counters: Optional[NonFiniteCounters] = None) -> None:
        self.name = name
        self.counters = counters if counters is not None else NonFiniteCounters()

    @property
    def quantized_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def create_context(self) -> CommCodecContext:
        return CommCodecContext()

    def encode(self, input_tensor: torch.Tensor, ctx: Optional[CommCodecContext] = None) -> torch.Tensor:
        if ctx is not None:
            ctx.dtype = input_tensor.dtype
        with record_function(f"## loka bf16 encode {self.name} ##"):
            self.counters.slot(f"{self.name}/sent", input_tensor.device).add_((~torch.isfinite(input_tensor)).sum())
            return input_tensor.to(torch.bfloat16).contiguous()

    def decode(self, input_grad: torch.Tensor, ctx: Optional[CommCodecContext] = None) -> torch.Tensor:
        out_dtype = ctx.dtype if ctx is not None and ctx.dtype is not None else torch.float32
        with record_function(f"## loka bf16 decode {self.name} ##"):
            self.counters.slot(f"{self.name}/received", input_grad.device).add_((~torch.isfinite(input_grad)).sum())
            return input_grad.to(out_dtype)

    def calc_quantized_size(self, input_len: int, ctx: Optional[CommCodecContext] = None) -> int:
        return input_len

    def padded_size(self, input_tensor, dim_per_rank, my_rank, qcomm_ctx) -> Tuple[int, int]:
        return (input_tensor.shape[0] if input_tensor.dim() == 1 else input_tensor.shape[1]), 0

    @property
    def bytes_per_value(self) -> float:
        return 2.0

    def __repr__(self) -> str:
        return f"Bf16CommCodec({self.name})"


class Fp32CommCodec:
    """No compression: the payload is the input itself (the direction stays in full precision)."""

    def __init__(self, *, name: str = "fp32") -> None:
        self.name = name

    @property
    def quantized_dtype(self) -> torch.dtype:
        return torch.float32

    def create_context(self) -> CommCodecContext:
        return CommCodecContext()

    def encode(self, input_tensor: torch.Tensor, ctx: Optional[CommCodecContext] = None) -> torch.Tensor:
        return input_tensor

    def decode(self, input_grad: torch.Tensor, ctx: Optional[CommCodecContext] = None) -> torch.Tensor:
        return input_grad

    def calc_quantized_size(self, input_len: int, ctx: Optional[CommCodecContext] = None) -> int:
        return input_len

    def padded_size(self, input_tensor, dim_per_rank, my_rank, qcomm_ctx) -> Tuple[int, int]:
        return (input_tensor.shape[0] if input_tensor.dim() == 1 else input_tensor.shape[1]), 0

    @property
    def bytes_per_value(self) -> float:
        return 4.0

    def __repr__(self) -> str:
        return f"Fp32CommCodec({self.name})"


class AutoCommCodec:
    """A codec whose precision is the run's :class:`~loka_torchrec.comms.choice.CommsSelection`.

    TorchRec keeps the codec objects a sharder hands it (in each sharded module's all-to-all)
    and calls ``create_context``, ``padded_size``, ``encode``, ``calc_quantized_size`` and
    ``decode`` on them at every collective; only the planner reads ``quantized_dtype``, once,
    before ``DistributedModelParallel`` exists. So this codec reads the selection at every call
    and hands the call to the concrete codec of the precision in force (built on first use by
    ``build`` from ``config`` with its ``"auto"`` directions resolved): the precision can be set
    after DMP, without re-sharding. Before a choice is set it is the fp32 codec (the payload
    passes unchanged), which is also what the planner sees. The choice must not change between
    a collective's ``create_context`` and its ``decode``: set it between training steps.

    Args:
        name: ``"<comm op>/<direction>"``.
        config: the comm config (its ``"auto"`` directions follow ``selection``).
        selection: the run's selection, shared by all of its ``"auto"`` codecs.
        build: ``build(resolved_config) -> codec`` for this op and direction (picklable, e.g. a
            ``functools.partial`` of a module-level function).
    """

    def __init__(
        self, *, name: str, config: CommsConfig, selection: CommsSelection, build: Callable[[CommsConfig], object]
    ) -> None:
        self.name = name
        self.config = config
        self.selection = selection
        self._build = build
        self._codecs: Dict[Tuple[str, str], object] = {}

    @property
    def active(self):
        """The concrete codec of the precisions in force now."""
        key = self.selection.precisions()
        codec = self._codecs.get(key)
        if codec is None:
            codec = self._codecs.setdefault(key, self._build(self.config.resolved(*key)))
        return codec

    @property
    def quantized_dtype(self) -> torch.dtype:
        return self.active.quantized_dtype

    def create_context(self) -> CommCodecContext:
        return self.active.create_context()

    def encode(self, input_tensor: torch.Tensor, ctx: Optional[CommCodecContext] = None) -> torch.Tensor:
        return self.active.encode(input_tensor, ctx)

    def decode(self, input_grad: torch.Tensor, ctx: Optional[CommCodecContext] = None) -> torch.Tensor:
        return self.active.decode(input_grad, ctx)

    def calc_quantized_size(self, input_len: int, ctx: Optional[CommCodecContext] = None) -> int:
        return self.active.calc_quantized_size(input_len, ctx)

    def padded_size(self, input_tensor, dim_per_rank, my_rank, qcomm_ctx) -> Tuple[int, int]:
        return self.active.padded_size(input_tensor, dim_per_rank, my_rank, qcomm_ctx)

    @property
    def bytes_per_value(self) -> float:
        return self.active.bytes_per_value

    @property
    def counters(self) -> Optional[NonFiniteCounters]:
        """The non-finite counters of the codec in force (``None`` for fp32, which counts nothing)."""
        return getattr(self.active, "counters", None)

    def __repr__(self) -> str:
        state = "undecided" if self.selection.choice is None else "decided"
        return f"AutoCommCodec({self.name}, {state}: {self.active!r})"
