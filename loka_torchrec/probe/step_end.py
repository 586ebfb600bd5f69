"""The end of a probe step: this step's statistics merged over the ranks and folded into each layer.

Every rank all-reduces the step's sufficient statistics
(:func:`~loka_torchrec.probe.merge.all_reduce_statistics`), so every rank holds the same merged
view; each layer keeps the digests of that view (:class:`~loka_torchrec.probe.layer_state.StepDigest`),
its largest row count, its amax history and a bounded history for ``summary.json``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence

from loka_torchrec.probe.layer_state import LayerState, StepDigest
from loka_torchrec.probe.merge import all_reduce_statistics, rank_deviation
from loka_torchrec.probe.statistics import HOST, TensorStatistics

__all__ = ["HISTORY_LIMIT", "MergedStep", "merge_step", "merged_into"]

HISTORY_LIMIT = 1000  # probe steps of amax/kurtosis history kept per layer in summary.json


@dataclasses.dataclass
class MergedStep:
    """One probe step merged over the ranks: per layer (in the order given to :func:`merge_step`)
    the input and output-gradient statistics, and by layer name the step's digests."""

    act: List[TensorStatistics]
    grad: List[TensorStatistics]
    digests: Dict[str, StepDigest]


def merge_step(states: Sequence[LayerState], group: Optional[Any], step: int) -> MergedStep:
    """Merge this step's windows of ``states`` over ``group`` (a collective: call on every rank)
    and fold the merged statistics into each layer (latest digests, rows, amax, history)."""
    for state in states:
        state.weight.update(state.module.weight, factors=state.collect_moments)
    windows = [s.window_act for s in states] + [s.window_grad for s in states]
    merged = all_reduce_statistics(windows, group)
    merged_act, merged_grad = merged[: len(states)], merged[len(states) :]
    digests: Dict[str, StepDigest] = {}
    for state, m_act, m_grad in zip(states, merged_act, merged_grad):
        digest = StepDigest(
            local_act=state.window_act.summary(),
            local_grad=state.window_grad.summary(),
            merged_act=m_act.summary(),
            merged_grad=m_grad.summary(),
            deviation_act=rank_deviation(state.window_act, m_act),
            deviation_grad=rank_deviation(state.window_grad, m_grad),
            weight=state.weight.summary(),
        )
        digests[state.name] = digest
        state.latest_stats = {"act": digest.merged_act, "grad": digest.merged_grad}
        state.rows = max(state.rows, m_act.max_rows)
        if m_act.rows:
            state.act_amax.append(float(m_act.amax))
        if m_grad.rows:
            state.grad_amax.append(float(m_grad.amax))
        state.history.append(
            {
                "step": step,
                "act_amax": digest.merged_act["amax"],
                "act_kurtosis": digest.merged_act["kurtosis"],
                "grad_amax": digest.merged_grad["amax"],
                "grad_kurtosis": digest.merged_grad["kurtosis"],
                "weight_amax": digest.weight["amax"],
            }
        )
        del state.history[:-HISTORY_LIMIT]
    return MergedStep(merged_act, merged_grad, digests)


def merged_into(acc: Optional[TensorStatistics], new: TensorStatistics) -> TensorStatistics:
    """``acc`` with ``new`` merged in (a copy of ``new`` where there is no ``acc`` yet), on the :data:`HOST`."""
    if acc is None:
        return new.clone(HOST)
    if acc.device != HOST:  # restored onto an accelerator (a checkpoint loaded there)
        acc = acc.to(HOST)
    return acc.merge(new)
