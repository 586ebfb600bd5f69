"""Sibling linear layers (several GEMMs reading one input), and the mod that fuses them into one GEMM."""

from __future__ import annotations

from typing import List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from loka_torchrec.mods.config import ModResult
from loka_torchrec.mods.module_tree import check_unwrapped, named_modules_of_type

__all__ = ["SiblingLinears", "fuse_siblings"]

Members = Union[Mapping[str, int], Sequence[Tuple[str, int]]]


class SiblingLinears(nn.Module):
    """Linear layers that all read the same input: ``x -> (x W_1^T + b_1, ..., x W_n^T + b_n)``.

    A model groups its sibling GEMMs in one of these to say "these may run as one GEMM" (HSTU's u,
    v, q, k projections; the DHEN ensemble members that read the flattened feature stack; the
    q, k, v of self-attention). Unfused, it holds one ``nn.Linear`` per member under
    ``members.<name>``. After :meth:`fuse` it holds one ``nn.Linear`` ``fused`` of width
    ``sum(widths)`` whose rows are the members' rows stacked in member order, and splits its
    output. Both forms return the same tuple of ``(..., width_i)`` tensors, and each loads the
    other's ``state_dict`` (the keys are converted on load).

    Args:
        in_features: ``K``, the width of the shared input.
        members: ``name -> out_features`` (ordered), or a sequence of ``(name, out_features)``.
        bias: whether the members have biases.
        device, dtype: for the parameters.

    Example::

        >>> group = SiblingLinears(8, [("q", 4), ("k", 4), ("v", 6)])
        >>> x = torch.randn(3, 8)
        >>> q, k, v = group(x)
        >>> group.fuse() is None, type(group.fused).__name__, group.fused.out_features
        (True, 'Linear', 14)
        >>> q2, k2, v2 = group(x)
        >>> bool(torch.allclose(v, v2))
        True
    """

    def __init__(
        self,
        in_features: int,
        members: Members,
        *,
        bias: bool = True,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        items = list(members.items()) if isinstance(members, Mapping) else [tuple(m) for m in members]
        if not items:
            raise ValueError("SiblingLinears needs at least one member")
        names = [str(n) for n, _ in items]
        if len(set(names)) != len(names):
            raise ValueError(f"SiblingLinears member names must be unique, got {names}")
        for name, width in items:
            if isinstance(width, bool) or not isinstance(width, int) or width < 1:
                raise ValueError(f"SiblingLinears member {name!r}: out_features must be an int >= 1, got {width!r}")
        self.in_features = int(in_features)
        self.names: Tuple[str, ...] = tuple(names)
        self.widths: Tuple[int, ...] = tuple(int(w) for _, w in items)
        self.members: Optional[nn.ModuleDict] = nn.ModuleDict(
            {n: nn.Linear(in_features, w, bias=bias, device=device, dtype=dtype) for n, w in items}
        )
        self.register_module("fused", None)

    @property
    def is_fused(self) -> bool:
        return self.fused is not None

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """``(..., in_features)`` -> a tuple of ``(..., width_i)``, one per member, in member order."""
        if self.fused is not None:
            # Column slices of one GEMM output: views, no copy.
            return tuple(torch.split(self.fused(x), list(self.widths), dim=-1))
        return tuple(self.members[name](x) for name in self.names)

    def fuse(self) -> Optional[str]:
        """Replace the members by one ``nn.Linear``; returns ``None``, or why it did not fuse.

        Fuses only plain ``nn.Linear`` members (not subclasses or wrappers, e.g. padded ones) that
        agree on having a bias, dtype, device and ``requires_grad``. Already fused: no-op.
        """
        if self.fused is not None:
            return None
        linears = [self.members[name] for name in self.names]
        kinds = {type(m).__name__ for m in linears if type(m) is not nn.Linear}
        if kinds:
            return f"members are not plain nn.Linear ({', '.join(sorted(kinds))})"
        if len({m.bias is None for m in linears}) != 1:
            return "some members have a bias and some do not"
        if len({(m.weight.dtype, m.weight.device, m.weight.requires_grad) for m in linears}) != 1:
            return "members differ in dtype, device or requires_grad"
        first = linears[0]
        has_bias = first.bias is not None
        fused = nn.Linear(
            self.in_features, sum(self.widths), bias=has_bias, device=first.weight.device, dtype=first.weight.dtype
        )
        with torch.no_grad():
            fused.weight.copy_(torch.cat([m.weight for m in linears], dim=0))
            if has_bias:
                fused.bias.copy_(torch.cat([m.bias for m in linears], dim=0))
        fused.weight.requires_grad_(first.weight.requires_grad)
        if has_bias:
            fused.bias.requires_grad_(first.bias.requires_grad)
        self.fused = fused
        self.members = None
        return None

    def extra_repr(self) -> str:
        members = ", ".join(f"{n}={w}" for n, w in zip(self.names, self.widths))
        return f"in_features={self.in_features}, {members}, fused={self.is_fused}"

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        # Convert between the two layouts, so a checkpoint of either form loads into either form.
        member_keys = [f"{prefix}members.{n}.weight" for n in self.names]
        if self.fused is not None and all(k in state_dict for k in member_keys):
            for param in ("weight", "bias"):
                keys = [f"{prefix}members.{n}.{param}" for n in self.names]
                if all(k in state_dict for k in keys):
                    state_dict[f"{prefix}fused.{param}"] = torch.cat([state_dict.pop(k) for k in keys], dim=0)
        elif self.fused is None and f"{prefix}fused.weight" in state_dict:
            for param in ("weight", "bias"):
                key = f"{prefix}fused.{param}"
                if key in state_dict:
                    fused_value = state_dict.pop(key)
                    if fused_value.shape[0] != sum(self.widths):
                        raise ValueError(
                            f"SiblingLinears {prefix!r}: checkpoint {key} has {fused_value.shape[0]} rows, "
                            f"expected {sum(self.widths)} (members {dict(zip(self.names, self.widths))})"
                        )
                    for name, part in zip(self.names, torch.split(fused_value, list(self.widths), dim=0)):
                        state_dict[f"{prefix}members.{name}.{param}"] = part
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )


def fuse_siblings(model: nn.Module) -> ModResult:
    """Fuse every :class:`SiblingLinears` group of ``model`` into one GEMM, in place.

    Numerically: the group's ``n`` GEMMs ``x W_i^T + b_i`` become one GEMM ``x [W_1; ...; W_n]^T
    + [b_1; ...; b_n]`` whose output columns are split back into the members' outputs. Every
    output element is the same dot product over the same ``K`` inputs, so the result equals the
    unfused one in exact arithmetic; in fp32 the two differ at most by the GEMM library's choice
    of summation order for a different ``N`` (within the fp32 GEMM error bound, and bitwise equal
    for most shapes on CPU). Weight gradients likewise; the input gradient sums the members'
    contributions in one GEMM instead of one per member, so it differs by rounding. The parameters
    change shape (``members.<name>.weight`` becomes ``fused.weight``; checkpoints of either
    layout still load, see :class:`SiblingLinears`); the model function does not change.

    Args:
        model: the unsharded model.

    Returns:
        A :class:`ModResult` listing the fused groups, and the groups left unfused with the reason.

    Example::

        >>> model = nn.ModuleDict({"uvqk": SiblingLinears(8, {"u": 4, "v": 4})})
        >>> fuse_siblings(model).modules
        ('uvqk',)
    """
    check_unwrapped(model, mod="fuse_siblings")
    changed: List[str] = []
    skipped: List[Tuple[str, str]] = []
    for name, group in named_modules_of_type(model, SiblingLinears):
        if group.is_fused:
            skipped.append((name, "already fused"))
            continue
        reason = group.fuse()
        if reason is None:
            changed.append(name)
        else:
            skipped.append((name, reason))
    return ModResult("fuse_siblings", tuple(changed), tuple(skipped))
