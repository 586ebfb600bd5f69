"""The ranks that must run one plan: rank 0 decides and broadcasts, every rank proves what it runs.

Every collective here is a no-op without an initialized process group or with one rank. The rank
is read at each call: a Dispatcher may be made before the process group exists.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from loka_torchrec.dispatch.plan import DispatchPlan
from loka_torchrec.dispatch.step_guard import GuardVerdict

__all__ = ["PlanMismatchError", "PlanRanks"]


class PlanMismatchError(RuntimeError):
    """Ranks ended up running different kernels."""


class PlanRanks:
    """The process group (``None``: the default group, if any) whose ranks run one plan."""

    def __init__(self, process_group=None) -> None:
        self.process_group = process_group

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def rank(self) -> int:
        return dist.get_rank(self.process_group) if self.distributed else 0

    def _alone(self) -> bool:
        return not self.distributed or dist.get_world_size(self.process_group) == 1

    def _from_rank0(self, payload: list) -> list:
        src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        dist.broadcast_object_list(payload, src=src, group=self.process_group)
        return payload

    def broadcast_plans(self, plans: Optional[List[DispatchPlan]]) -> List[DispatchPlan]:
        """Rank 0's list of plans, on every rank."""
        if self._alone():
            return list(plans)
        payload = self._from_rank0([[p.to_dict() for p in plans] if plans is not None else None])
        return [DispatchPlan.from_dict(p) for p in payload[0]]

    def broadcast_labelled(self, labelled: Optional[List[Tuple[str, DispatchPlan]]]) -> List[Tuple[str, DispatchPlan]]:
        """Rank 0's list of ``(label, plan)`` pairs, on every rank."""
        if self._alone():
            return list(labelled)
        payload = self._from_rank0([[(label, p.to_dict()) for label, p in labelled] if labelled is not None else None])
        return [(str(label), DispatchPlan.from_dict(p)) for label, p in payload[0]]

    def broadcast(self, plan: Optional[DispatchPlan]) -> DispatchPlan:
        """Rank 0's plan, on every rank."""
        if self._alone():
            return plan
        payload = self._from_rank0([plan.to_dict() if plan is not None else None])
        return DispatchPlan.from_dict(payload[0])

    def verify_identical(self, digest: str) -> None:
        """Gather every rank's ``digest`` of what it runs.

        Raises:
            PlanMismatchError: the digests differ (each rank's is named).
        """
        if self._alone():
            return
        gathered: List[Optional[str]] = [None] * dist.get_world_size(self.process_group)
        dist.all_gather_object(gathered, digest, group=self.process_group)
        if len(set(gathered)) != 1:
            detail = ", ".join(f"rank {r}: {d[:12]}" for r, d in enumerate(gathered))
            raise PlanMismatchError(f"ranks run different dispatch plans ({detail})")

    def agree(self, verdict: GuardVerdict, device: torch.device, tolerance: float) -> GuardVerdict:
        """The step-time guard's verdict every rank takes: medians all-reduced with max (the slowest
        rank counts), judged with ``tolerance``; ``device``: where the layers are."""
        if self._alone():
            return verdict
        if dist.get_backend(self.process_group) == "nccl" and device.type != "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        medians = torch.tensor([verdict.bf16_ms, verdict.fp8_ms], dtype=torch.float64, device=device)
        dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=self.process_group)
        bf16_ms, fp8_ms = medians.tolist()
        return GuardVerdict(verdict.step, bf16_ms, fp8_ms, keep_fp8=fp8_ms <= bf16_ms * (1.0 + tolerance))
