"""What the embedding all-to-all sends: the precision of each direction and the FP8 wire format."""

from __future__ import annotations

import dataclasses

from loka_torchrec.config_fields import check_field_types
from loka_torchrec.fp8 import Fp8Format

__all__ = ["CommsConfig", "PRECISIONS", "FIXED_PRECISIONS", "SCALE_FORMATS", "KERNELS", "DEFAULT_BLOCK"]

FIXED_PRECISIONS = ("fp32", "bf16", "fp8")
PRECISIONS = ("auto",) + FIXED_PRECISIONS
SCALE_FORMATS = ("fp32", "e8m0")
KERNELS = ("auto", "torch", "triton")
_FP8_FORMATS = (Fp8Format.E4M3.value, Fp8Format.E5M2.value)

DEFAULT_BLOCK = 32
"""Values per scale when ``block_size=0`` but the embedding dims are not known (see ``registry``)."""


@dataclasses.dataclass(frozen=True)
class CommsConfig:
    """Precision of the embedding all-to-all, per direction.

    Attributes:
        forward: ``"auto"`` (default: fp8 or fp32, whichever a short timing of the run's
            all-to-all on its own process group finds faster, taken once before the first
            training step and kept on resume; fp32 on one rank, where the all-to-all crosses no
            link; see :mod:`loka_torchrec.comms.auto`), ``"fp32"`` (no compression), ``"bf16"``
            or ``"fp8"``: the pooled and sequence embeddings sent in the forward pass. A fixed
            precision is used as given.
        backward: the same choice for their gradients in the backward pass.
        forward_format: FP8 format of the forward payload, ``"e4m3"`` (default) or ``"e5m2"``.
        backward_format: FP8 format of the gradients, ``"e5m2"`` (default) or ``"e4m3"``.
        block_size: values per scale. ``0`` (default) gives one scale per embedding row: the
            block is the gcd of the embedding dims (per shard) of the module, so a table of dim
            ``D`` gets ``D / block`` scales per sample, and all-equal dims give exactly one. A
            positive value fixes the block; it must divide every embedding dim sent.
        scale_format: ``"fp32"`` (4 bytes per block) or ``"e8m0"`` (one exponent byte per block,
            a power-of-two scale: cheaper, up to one bit less precise for the block's largest
            values).
        kernel: ``"auto"`` (Triton on CUDA tensors when importable, else torch ops), ``"torch"``
            or ``"triton"``.
        step_check_steps: when ``"auto"`` chose a compressed precision, check it in the training
            step: blocks of this many step times with the choice and with fp32, alternating, once
            Dispatch has made and judged its plan; the choice stays only if the step is faster
            with it (:mod:`loka_torchrec.comms.step_check`). ``0``: keep the timing's choice
            unchecked.

    Example::

        >>> CommsConfig().forward
        'auto'
        >>> CommsConfig(forward="fp8", backward="bf16").backward_format
        'e5m2'
        >>> CommsConfig(forward="int8")
        Traceback (most recent call last):
        ...
        ValueError: CommsConfig.forward: expected one of auto, fp32, bf16, fp8, got 'int8'
    """

    forward: str = "auto"
    backward: str = "auto"
    forward_format: str = "e4m3"
    backward_format: str = "e5m2"
    block_size: int = 0
    scale_format: str = "fp32"
    kernel: str = "auto"
    step_check_steps: int = 10

    def __post_init__(self) -> None:
        check_field_types(self, "CommsConfig")  # types first: a range check of a str fails deep inside
        for name, choices in (
            ("forward", PRECISIONS),
            ("backward", PRECISIONS),
            ("forward_format", _FP8_FORMATS),
            ("backward_format", _FP8_FORMATS),
            ("scale_format", SCALE_FORMATS),
            ("kernel", KERNELS),
        ):
            value = getattr(self, name)
            if value.lower() not in choices:
                raise ValueError(f"CommsConfig.{name}: expected one of {', '.join(choices)}, got {value!r}")
            object.__setattr__(self, name, value.lower())
        if self.step_check_steps < 0:
            raise ValueError(f"CommsConfig.step_check_steps: expected 0 (no check) or a number of steps >= 1, got {self.step_check_steps}")
        if self.block_size < 0:
            raise ValueError(f"CommsConfig.block_size: expected 0 (one scale per embedding row) or a positive block, got {self.block_size}")

    @property
    def enabled(self) -> bool:
        """True when either direction is compressed or decided per run (``"auto"``): codecs are installed."""
        return self.forward != "fp32" or self.backward != "fp32"

    @property
    def auto(self) -> bool:
        """True when either direction is ``"auto"`` (decided per run from a measurement)."""
        return "auto" in (self.forward, self.backward)

    def resolved(self, forward: str, backward: str) -> "CommsConfig":
        """This config with its ``"auto"`` directions set to ``forward`` / ``backward`` (fixed ones kept)."""
        return dataclasses.replace(
            self,
            forward=forward if self.forward == "auto" else self.forward,
            backward=backward if self.backward == "auto" else self.backward,
        )
