"""Which managed sites run, and the share of the model's multiply-adds that Dispatch reaches.

A site that did not run in the first training step in which any site ran is left out of the plan's
counts, with why (:func:`never_ran_reason`); the plan's ``coverage`` gives the multiply-adds per forward row
of the sites that run against those of every GEMM found, the unreached ones included.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import torch

from loka_torchrec.dispatch.plan import DispatchPlan

__all__ = ["SiteReach", "never_ran_reason"]

NOT_CALLED = "not called in a training step (its weight is read elsewhere, or a fused path bypasses it)"
"""The reason of a site no call reached at all (no scope saw its Parameter either)."""


class SiteReach:
    """The reach of Dispatch over ``layers`` (FQN -> site).

    Args:
        layers: the managed sites.
        unreached: GEMM -> multiply-adds per forward row of each GEMM left in high precision.
    """

    def __init__(self, layers: Dict[str, torch.nn.Module], unreached: Optional[Dict[str, int]] = None) -> None:
        self._layers = layers
        self._unreached = dict(unreached or {})
        self.never_ran: Dict[str, str] = {}
        self.ran_checked = False

    def check_ran(self) -> bool:
        """After a training step: note the sites that have not run, once; whether it did now.

        An eager call leaves its rows (``last_rows``), a compiled one ``ran_compiled``, so a step
        that ran some sites eagerly and the others compiled decides as an eager one does. A step
        in which no site ran at all decides nothing.
        """
        if self.ran_checked or not any(_ran(m) for m in self._layers.values()):
            return False
        self.ran_checked = True
        for name, module in self._layers.items():
            if not _ran(module):
                self.never_ran[name] = never_ran_reason(module)
        return True

    def restore(self, plan: DispatchPlan) -> None:
        """What a checkpoint's plan says of the sites' reach."""
        self.never_ran = dict(plan.never_ran)
        self.ran_checked = bool(plan.coverage.get("ran_checked", False))

    def annotated(self, plan: DispatchPlan) -> DispatchPlan:
        """``plan`` with this run's never-ran sites and coverage."""
        self._refresh_reasons()
        managed = sum(m.in_features * m.out_features for n, m in self._layers.items() if n not in self.never_ran)
        unreached = dict(self._unreached)
        for name, reason in self.never_ran.items():
            if not reason.startswith("not a GEMM operand"):
                module = self._layers[name]
                unreached[name] = module.in_features * module.out_features
        total = managed + sum(unreached.values())
        coverage = {
            "managed_macs_per_row": managed,
            "total_macs_per_row": total,
            "share": round(managed / total, 4) if total else 1.0,
            "ran_checked": self.ran_checked,
            "unreached": dict(sorted(unreached.items())),
        }
        return dataclasses.replace(plan, never_ran=dict(self.never_ran), coverage=coverage)

    def _refresh_reasons(self) -> None:
        """A never-ran site's reason from what eager calls have seen of its Parameter since it was
        found: a compiled first step decides which sites run, and the Probe's eager steps after it
        say why one did not (a call its scope could not route, another use of the Parameter)."""
        for name in self.never_ran:
            reason = never_ran_reason(self._layers[name])
            if reason != NOT_CALLED:
                self.never_ran[name] = reason


def _ran(module: torch.nn.Module) -> bool:
    return bool(getattr(module, "last_rows", 0) or getattr(module, "ran_compiled", False))


def never_ran_reason(module: torch.nn.Module) -> str:
    """Why a managed site has not run: what its scope saw of its Parameter, if anything."""
    other = dict(getattr(module, "other_uses", {}) or {})
    calls = dict(getattr(module, "unreached_calls", {}) or {})
    if calls:
        return "its GEMMs ran in high precision: " + "; ".join(f"{k}: {v}" for k, v in sorted(calls.items()))
    if other:
        return "not a GEMM operand: its Parameter is read by " + ", ".join(sorted(other))
    return NOT_CALLED
