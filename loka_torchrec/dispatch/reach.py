"""Which managed sites run, and the share of the model's multiply-adds that Dispatch reaches.

A site that never runs in the first eager training step is left out of the plan's counts, with
why (:func:`never_ran_reason`); the plan's ``coverage`` gives the multiply-adds per forward row
of the sites that run against those of every GEMM found, the unreached ones included.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import torch

from loka_torchrec.dispatch.plan import DispatchPlan

__all__ = ["SiteReach", "never_ran_reason"]


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
        """After an eager step: note the sites that did not run in it, once; whether it did now.

        Only an eager step counts: compiled calls do not update ``last_rows``, so a site that ran
        compiled would look as if it never ran (a step where only the sites outside the compiled
        modules ran eagerly must not decide). A step in which no site ran at all decides nothing.
        """
        if self.ran_checked or not any(_rows(m) for m in self._layers.values()):
            return False
        self.ran_checked = True
        for name, module in self._layers.items():
            if not _rows(module):
                self.never_ran[name] = never_ran_reason(module)
        return True

    def restore(self, plan: DispatchPlan) -> None:
        """What a checkpoint's plan says of the sites' reach."""
        self.never_ran = dict(plan.never_ran)
        self.ran_checked = bool(plan.coverage.get("ran_checked", False))

    def annotated(self, plan: DispatchPlan) -> DispatchPlan:
        """``plan`` with this run's never-ran sites and coverage."""
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


def _rows(module: torch.nn.Module) -> int:
    return int(getattr(module, "last_rows", 0) or 0)


def never_ran_reason(module: torch.nn.Module) -> str:
    """Why a managed site has not run: what its scope saw of its Parameter, if anything."""
    other = dict(getattr(module, "other_uses", {}) or {})
    calls = dict(getattr(module, "unreached_calls", {}) or {})
    if calls:
        return "its GEMMs ran in high precision: " + "; ".join(f"{k}: {v}" for k, v in sorted(calls.items()))
    if other:
        return "not a GEMM operand: its Parameter is read by " + ", ".join(sorted(other))
    return "not called in a training step (its weight is read elsewhere, or a fused path bypasses it)"
