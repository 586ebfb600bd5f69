"""The safety valve: has a layer's distribution moved too far from the one its kernels were chosen on?

The comparison is between two statistics digests (:meth:`TensorStatistics.summary`), the
reference (what the plan was made from) and the latest probe step's, both merged over ranks, so
every rank reaches the same verdict. A layer trips on any of:

* ``nonfinite``: the probe step saw an inf or NaN in the tensor;
* ``amax_jump``: ``amax > amax_jump_ratio * reference amax``;
* ``kurtosis_spike``: ``kurtosis > kurtosis_spike_ratio * reference kurtosis``, unless the layers
  that run bf16 show it too (a batch event: :mod:`loka_torchrec.probe.valve_actions`);
* ``underflow_rise``: an underflow fraction (any format, any granularity) rose by more than
  ``underflow_rise``;
* ``below_floor``: the fraction of elements in groups whose amax is below the FP8 scaling floor
  (1e-12, where FP8 loses them and ``nn.Linear`` keeps them) rose by more than ``underflow_rise``.

The delayed-scaling saturation fraction of the statistics is not a trigger: every recipe scales
an operand by its own amax at the time of the GEMM, which cannot saturate (it would matter to a
scale taken from earlier steps' amax). It stays in the logs, for ``loka-inspect``.

A fraction measured on few elements is noisy (2 of 64 elements is already 3%), so a rise must
also exceed ``NOISE_Z`` binomial standard errors of the probe step's fraction,
``sqrt(p (1 - p) / numel)``: on the millions of elements of an LRM layer this changes nothing,
on a toy layer it keeps the valve from firing on sampling noise.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Mapping, Optional

from loka_torchrec.evidence import GemmRole
from loka_torchrec.fp8 import Granularity
from loka_torchrec.gemm.recipes import RECIPE_GRANULARITY
from loka_torchrec.probe.config import ProbeConfig

__all__ = ["Trigger", "check_shift", "describe", "nonfinite_spread", "NOISE_Z"]

NOISE_Z = 4.0


@dataclasses.dataclass(frozen=True)
class Trigger:
    """One reason to send a layer back to bf16, with the numbers that fired it."""

    tensor: str  # "act", "grad" or "weight"
    signal: str  # "nonfinite", "amax_jump", "kurtosis_spike", "underflow_rise", "below_floor"
    value: float
    reference: float
    bound: float
    detail: str = ""
    spread: str = ""  # nonfinite: how the layer's FP8 recipes spread it (see nonfinite_spread)
    batch_event: str = ""  # a shift of the batch, not FP8's (see SafetyValve): who else showed it; trips nothing

    @property
    def trips(self) -> bool:
        """Whether this trigger sends a layer to bf16 (a batch event is only logged)."""
        return not self.batch_event

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        text = self._text()
        return f"{text} (batch event: {self.batch_event})" if self.batch_event else text

    def _text(self) -> str:
        where = f"{self.tensor}{'.' + self.detail if self.detail else ''}"
        if self.signal == "nonfinite":
            return f"{where} nonfinite: {self.value:.0f} inf/NaN element(s)" + (f" ({self.spread})" if self.spread else "")
        if self.signal == "below_floor":
            return (
                f"{where} below_floor: {self.value:.4g} of the elements are in groups whose amax is below the FP8 "
                f"scaling floor 1e-12, where FP8 flushes or coarsens them (reference {self.reference:.4g}, bound {self.bound:.4g})"
            )
        return f"{where} {self.signal}: {self.value:.4g} (reference {self.reference:.4g}, bound {self.bound:.4g})"


def _num(d: Mapping[str, Any], key: str) -> float:
    try:
        return float(d.get(key, math.nan))
    except (TypeError, ValueError):
        return math.nan


def check_shift(tensor: str, reference: Optional[Mapping[str, Any]], window: Mapping[str, Any], config: ProbeConfig) -> List[Trigger]:
    """The triggers that ``window`` fires against ``reference`` (digests of one tensor).

    Args:
        tensor: ``"act"``, ``"grad"`` or ``"weight"`` (for the messages).
        reference: digest the plan was made from (``None``: only non-finite values can trip).
        window: digest of the latest probe step.
        config: the bounds.

    Example::

        >>> cfg = ProbeConfig(amax_jump_ratio=4.0)
        >>> [t.signal for t in check_shift("act", {"amax": 1.0, "rows": 8}, {"amax": 5.0, "rows": 8}, cfg)]
        ['amax_jump']
    """
    triggers: List[Trigger] = []
    nonfinite = _num(window, "nonfinite")
    if nonfinite > 0:
        triggers.append(Trigger(tensor, "nonfinite", nonfinite, 0.0, 0.0))
    if reference is None or not window.get("rows", 1):
        return triggers
    amax, ref_amax = _num(window, "amax"), _num(reference, "amax")
    if ref_amax > 0 and amax > config.amax_jump_ratio * ref_amax:
        triggers.append(Trigger(tensor, "amax_jump", amax, ref_amax, config.amax_jump_ratio * ref_amax))
    kurt, ref_kurt = _num(window, "kurtosis"), _num(reference, "kurtosis")
    if ref_kurt > 0 and kurt > config.kurtosis_spike_ratio * ref_kurt:
        triggers.append(Trigger(tensor, "kurtosis_spike", kurt, ref_kurt, config.kurtosis_spike_ratio * ref_kurt))
    numel = _num(window, "numel")

    def rose(value: float, ref_value: float, bound: float) -> bool:
        noise = NOISE_Z * math.sqrt(max(value * (1.0 - value), 0.0) / numel) if numel > 0 else math.inf
        return math.isfinite(ref_value) and value - ref_value > max(bound, noise)

    under, ref_under = window.get("underflow") or {}, reference.get("underflow") or {}
    for fmt, by_gran in sorted(under.items()):
        for gran, value in sorted(by_gran.items()):
            ref_value = float((ref_under.get(fmt) or {}).get(gran, math.nan))
            value = float(value)
            if rose(value, ref_value, config.underflow_rise):
                triggers.append(Trigger(tensor, "underflow_rise", value, ref_value, ref_value + config.underflow_rise, f"{fmt}.{gran}"))
    floor, ref_floor = window.get("below_floor") or {}, reference.get("below_floor") or {}
    for gran, value in sorted(floor.items()):
        ref_value = float(ref_floor.get(gran, 0.0))  # references saved before the floor was counted: none
        ref_value = ref_value if math.isfinite(ref_value) else 0.0
        value = float(value)
        if rose(value, ref_value, config.underflow_rise):
            triggers.append(Trigger(tensor, "below_floor", value, ref_value, ref_value + config.underflow_rise, gran))
    return triggers


# Which GEMMs read each tensor, and what each GEMM produces.
_READERS = {"act": ("fwd", "wgrad"), "grad": ("dgrad", "wgrad"), "weight": ("fwd", "dgrad")}
_PRODUCT = {"fwd": "output", "dgrad": "input gradient", "wgrad": "weight gradient"}


def nonfinite_spread(tensor: str, kernels: Any) -> str:
    """How the kernels a layer ran spread an inf/NaN of ``tensor`` (``"act"``, ``"grad"``, ``"weight"``).

    A scaled FP8 GEMM gives an inf/NaN scaling group a NaN scale (see
    :mod:`loka_torchrec.fp8.scaling`): with one scale per operand (``tensorwise``) a single NaN
    makes the GEMM's whole product NaN; finer recipes keep it within the group's rows or blocks;
    bf16 spreads it only as far as the arithmetic does.

    Args:
        tensor: the tensor that held the inf/NaN.
        kernels: the layer's kernels: anything with ``for_role(role)`` returning a
            ``KernelChoice`` (Dispatch's ``LayerKernels``); ``None`` gives ``""``.

    Example::

        >>> from loka_torchrec.evidence import BF16, KernelChoice
        >>> class Kernels:
        ...     def for_role(self, role):
        ...         return KernelChoice("scaled_mm", "tensorwise") if role.value == "fwd" else BF16
        >>> nonfinite_spread("act", Kernels())
        'fwd scaled_mm:tensorwise: one scale for the whole operand, so the whole output turns NaN; wgrad bf16:hp: not FP8-scaled'
    """
    if kernels is None or not hasattr(kernels, "for_role") or tensor not in _READERS:
        return ""
    parts = []
    for role in _READERS[tensor]:
        choice = kernels.for_role(GemmRole(role))
        if choice.is_high_precision:
            parts.append(f"{role} {choice}: not FP8-scaled")
        elif RECIPE_GRANULARITY.get(choice.recipe) == Granularity.TENSORWISE:
            parts.append(f"{role} {choice}: one scale for the whole operand, so the whole {_PRODUCT[role]} turns NaN")
        else:
            parts.append(f"{role} {choice}: {choice.recipe} scales, so NaN stays within the {_PRODUCT[role]} entries its scaling group feeds")
    return "; ".join(parts)


def describe(triggers: List[Trigger]) -> str:
    """One line naming every trigger and its numbers."""
    return "; ".join(str(t) for t in triggers)
