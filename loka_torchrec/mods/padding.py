"""Pad GEMM dimensions to multiples of 16 with zeros, so FP8 kernels (which need them) apply."""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from loka_torchrec.mods.config import ModResult
from loka_torchrec.mods.module_tree import check_unwrapped, named_modules_of_type, replace_module

__all__ = ["round_up", "PaddedLinear", "pad_to_16"]


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is ``>= n``.

    Example::

        >>> round_up(28, 16), round_up(32, 16), round_up(1, 16)
        (32, 32, 16)
    """
    return -(-n // multiple) * multiple


class PaddedLinear(nn.Module):
    """A linear layer ``(.., K) -> (.., N)`` computed as a zero-padded ``(.., K') -> (.., N')`` GEMM.

    Holds an ``nn.Linear`` ``linear`` with ``K' = round_up(K, multiple)`` inputs and
    ``N' = round_up(N, multiple)`` outputs whose weight is the original ``W`` in the top-left
    ``(N, K)`` corner and zeros elsewhere (bias: ``b`` then zeros). ``forward`` zero-pads the
    input to ``K'`` columns, runs the GEMM and keeps the first ``N`` output columns. The padded
    weight entries multiply zero inputs or feed discarded outputs, so their gradients are exactly
    zero and they stay zero under any optimizer whose update of a zero with zero gradient is zero
    (SGD, Adam(W), Adagrad). The inner ``linear`` is a real ``nn.Linear``, so Dispatch converts it
    like any other layer. A ``state_dict`` of the unpadded layer (``weight (N, K)``, ``bias``)
    loads into it (padded on load).

    Args:
        in_features: ``K``.
        out_features: ``N``.
        multiple: pad both to a multiple of this.
        bias: whether the layer has a bias.
        device, dtype: for the parameters.

    Example::

        >>> layer = PaddedLinear.from_linear(nn.Linear(28, 1))
        >>> layer.linear
        Linear(in_features=32, out_features=16, bias=True)
        >>> layer(torch.randn(5, 28)).shape
        torch.Size([5, 1])
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        multiple: int = 16,
        bias: bool = True,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
            raise ValueError(f"PaddedLinear multiple must be an int >= 1, got {multiple!r}")
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.multiple = multiple
        self.linear = nn.Linear(
            round_up(self.in_features, multiple),
            round_up(self.out_features, multiple),
            bias=bias,
            device=device,
            dtype=dtype,
        )
        with torch.no_grad():
            self.linear.weight[self.out_features :].zero_()
            self.linear.weight[:, self.in_features :].zero_()
            if self.linear.bias is not None:
                self.linear.bias[self.out_features :].zero_()

    @classmethod
    def from_linear(cls, linear: nn.Linear, multiple: int = 16) -> "PaddedLinear":
        """The padded equivalent of ``linear`` (its weight and bias copied into the corner)."""
        padded = cls(
            linear.in_features,
            linear.out_features,
            multiple=multiple,
            bias=linear.bias is not None,
            device=linear.weight.device,
            dtype=linear.weight.dtype,
        )
        with torch.no_grad():
            padded.linear.weight.zero_()
            padded.linear.weight[: linear.out_features, : linear.in_features].copy_(linear.weight)
            if linear.bias is not None:
                padded.linear.bias.zero_()
                padded.linear.bias[: linear.out_features].copy_(linear.bias)
        padded.linear.weight.requires_grad_(linear.weight.requires_grad)
        return padded

    @property
    def weight(self) -> torch.Tensor:
        """The unpadded ``(N, K)`` weight, a view of the padded one."""
        return self.linear.weight[: self.out_features, : self.in_features]

    @property
    def bias(self) -> Optional[torch.Tensor]:
        """The unpadded ``(N,)`` bias (a view), or ``None``."""
        return None if self.linear.bias is None else self.linear.bias[: self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., K)`` -> ``(..., N)``."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"PaddedLinear expects input with last dimension {self.in_features}, got {x.shape[-1]}")
        pad = self.linear.in_features - self.in_features
        y = self.linear(F.pad(x, (0, pad)) if pad else x)
        return y[..., : self.out_features] if self.linear.out_features != self.out_features else y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, multiple={self.multiple}"

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        # An unpadded nn.Linear's checkpoint ("weight", "bias" at this prefix): pad it on load.
        name = prefix[:-1] if prefix.endswith(".") else prefix
        for param in ("weight", "bias"):
            key = prefix + param
            if key not in state_dict:
                continue
            target = getattr(self.linear, param)
            if target is None:
                # A bias in the checkpoint, none here (no_bias removed it): an unexpected key, which
                # load_state_dict reports under strict=True and returns under strict=False.
                state_dict.pop(key)
                unexpected_keys.append(key)
                continue
            value = state_dict.pop(key)
            expected = (self.out_features, self.in_features) if param == "weight" else (self.out_features,)
            if tuple(value.shape) != expected:
                raise ValueError(
                    f"PaddedLinear {name!r}: checkpoint {key} has shape {tuple(value.shape)}, expected {expected}"
                )
            padded = torch.zeros(target.shape, dtype=value.dtype, device=value.device)
            padded[tuple(slice(0, n) for n in expected)] = value
            state_dict[prefix + "linear." + param] = padded
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )


def pad_to_16(
    model: nn.Module,
    *,
    multiple: int = 16,
    module_filter: Optional[Callable[[nn.Module, str], bool]] = None,
) -> ModResult:
    """Replace every ``nn.Linear`` whose ``K`` or ``N`` is not a multiple of 16 by a :class:`PaddedLinear`.

    Numerically: the layer's GEMM becomes ``[x, 0] [[W, 0], [0, 0]]^T + [b, 0]`` on zero-padded
    dimensions, and the extra output columns are dropped. Every kept output element is the same
    sum plus exact zeros, so outputs and gradients equal the unpadded model's in exact arithmetic
    and, in fp32, up to the GEMM library's summation order for the padded shape (within the fp32
    GEMM error bound; bitwise equal for most shapes on CPU, not e.g. for ``N = 1``, which runs as
    a matrix-vector product unpadded). The padded weight entries get exactly zero gradients. The
    batch dimension ``M`` is not padded (kernels handle any ``M``). Costs: the
    input is copied into a padded buffer each call, and padded parameters take memory. The
    parameter FQNs gain ``.linear`` (``fc.weight`` becomes ``fc.linear.weight``, of padded
    shape); unpadded checkpoints still load (see :class:`PaddedLinear`).

    Args:
        model: the unsharded model.
        multiple: the required multiple (16 for FP8 tensor cores).
        module_filter: ``(module, fqn) -> bool``; only linears for which it returns ``True`` are
            padded (default: all).

    Returns:
        A :class:`ModResult` listing the padded layers.

    Example::

        >>> model = nn.Sequential(nn.Linear(28, 64), nn.SiLU(), nn.Linear(64, 1))
        >>> pad_to_16(model).modules
        ('0', '2')
    """
    check_unwrapped(model, mod="pad_to_16")
    changed: List[str] = []
    skipped: List[Tuple[str, str]] = []
    for name, linear in named_modules_of_type(model, nn.Linear):
        if isinstance(model.get_submodule(name.rpartition(".")[0]), PaddedLinear):
            continue  # the inner GEMM of an already padded layer
        if module_filter is not None and not module_filter(linear, name):
            continue
        if linear.in_features % multiple == 0 and linear.out_features % multiple == 0:
            continue
        if type(linear) is not nn.Linear:
            skipped.append((name, f"{type(linear).__name__} is not a plain nn.Linear"))
            continue
        padded = PaddedLinear.from_linear(linear, multiple)
        for attr, value in vars(linear).items():  # keep markers such as the prediction-layer flag
            if attr.startswith("loka_"):
                setattr(padded.linear, attr, value)
        replace_module(model, name, padded)
        changed.append(name)
    return ModResult("pad_to_16", tuple(changed), tuple(skipped))
