"""FP8 error of each candidate kernel on draws from a layer's learned distributions.

For a linear layer with input statistics ``act`` (over ``in_features``), output-gradient
statistics ``grad`` (over ``out_features``) and weight ``W`` ``(out, in)``, one draw of each GEMM
(operand layout as in :mod:`loka_torchrec.evidence`) is:

=========  ==================  ==================
role       A                   B
=========  ==================  ==================
``fwd``    ``x (r, in)``       ``W (out, in)``
``dgrad``  ``dy (r, out)``     ``W^T (in, out)``
``wgrad``  ``dy^T (out, r)``   ``x^T (in, r)``
=========  ==================  ==================

with ``x ~ N(mu_x, Sigma_x)`` and ``dy ~ N(mu_dy, Sigma_dy)`` drawn independently (the model
keeps no cross-covariance between a layer's inputs and its output gradients) and ``r`` rows (the
rows the layer saw per call, capped). Three measurements are taken for every candidate:

* ``gaussian``: K draws of the operands, the *actual* weight: the number Dispatch sees by default;
* ``weight_model``: the same with ``W`` drawn from the Kronecker weight model as well (``fwd``
  and ``dgrad``, the same ``max(2, K // 4)`` weight draws for both: a draw costs
  ``out * in * (out + in)`` flops, more than the GEMM), which shows how much the weight's
  structure matters;
* ``captured``: the real rows of the reservoir (real ``(x, dy)`` pairs), in chunks of rows,
  each chunk from one batch as in training (the reservoir holds rows of several steps, whose
  magnitudes differ), which shows how far the Gaussian model is from the data (heavy tails,
  outlier features).

For ``wgrad`` on captured rows one more number is kept: the FP8 error's power over the sampling
noise of the same gradient, from the rows of the chunk's batch (:func:`sampling_noise_power`). A
weight gradient is a sum over the batch's rows, and a different batch gives a different sum; when the FP8 error is small next to
that difference, FP8 adds noise of the kind SGD already sees (a ratio ``q`` is about the noise of a
batch ``1 + q`` times smaller). A grad-weight GEMM whose output cancels (a small sum of large
terms) can have a low SQNR against its own reference and still a small ratio.

Where training scales the layer's input by earlier calls' amax (``forward_scaling="delayed"``, a
compiled ``LokaLinear``), so are the draws: the input's operand of each draw by the largest amax
of the draws before it in the same measurement (captured chunks oldest batch first), so that an
input larger than all before it saturates here as in training
(:class:`~loka_torchrec.gemm.measure.DelayedOperandAmax`).

Each draw's output is compared with a high-precision reference of the same operands (float64
on the CPU, float32 with TF32 off on CUDA) by MERE and SQNR; the draws' mean comes with a
Student-t 95% interval (:func:`~loka_torchrec.gemm.intervals.t_interval`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import zlib
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from loka_torchrec.gemm.measure import DelayedOperandAmax, role_operands
from loka_torchrec.evidence import GemmRole, GemmShape, Interval, KernelChoice
from loka_torchrec.fp8 import Fp8Format
from loka_torchrec.fp8.error_metrics import mere_tensor, noise_and_signal, sqnr_from_sums
from loka_torchrec.gemm.candidates import CandidateRun, resolve_candidate
from loka_torchrec.gemm.intervals import t_interval
from loka_torchrec.probe.reservoir import RowReservoir
from loka_torchrec.probe.sampling import GaussianModel, make_generator
from loka_torchrec.probe.statistics import TensorStatistics
from loka_torchrec.probe.weight_statistics import WeightStatistics

__all__ = ["CandidateError", "LayerSnapshot", "quantify_errors", "reference_gemm", "draw_rows", "sampling_noise_power"]


@dataclasses.dataclass(frozen=True)
class CandidateError:
    """The error measurements of one candidate for one GEMM of one layer.

    Attributes:
        gaussian, gaussian_sqnr: MERE and SQNR (dB) on Gaussian draws with the actual weight.
        weight_model: MERE with the weight drawn from the weight model too (``None`` for wgrad
            or when there is no weight model).
        captured, captured_sqnr: MERE and SQNR on the reservoir's real rows (``None`` when the
            reservoir holds fewer than two rows for the role).
        captured_noise_ratio: ``wgrad`` only, on the reservoir's rows: the FP8 error's power over
            the sampling noise power of the same rows' weight gradient (see the module docstring).
        note: why a measurement is missing, or ``"unavailable: ..."`` when the candidate cannot run.
    """

    gaussian: Interval
    gaussian_sqnr: Interval
    weight_model: Optional[Interval] = None
    captured: Optional[Interval] = None
    captured_sqnr: Optional[Interval] = None
    captured_noise_ratio: Optional[Interval] = None
    note: str = ""

    @property
    def available(self) -> bool:
        return not self.note.startswith("unavailable")

    @classmethod
    def unavailable(cls, reason: str) -> "CandidateError":
        inf = Interval(float("inf"), float("inf"), float("inf"), 0, "none")
        return cls(gaussian=inf, gaussian_sqnr=Interval(float("-inf"), float("-inf"), float("-inf"), 0, "none"), note=f"unavailable: {reason}")

    def to_dict(self) -> Dict[str, object]:
        out: Dict[str, object] = {"gaussian": self.gaussian.to_dict(), "gaussian_sqnr_db": self.gaussian_sqnr.to_dict()}
        for name in ("weight_model", "captured", "captured_sqnr", "captured_noise_ratio"):
            value = getattr(self, name)
            out[name if name != "captured_sqnr" else "captured_sqnr_db"] = value.to_dict() if value else None
        out["note"] = self.note
        return out


@dataclasses.dataclass
class LayerSnapshot:
    """What error quantification needs to know about one layer.

    Attributes:
        name: the layer's FQN.
        weight: the actual weight ``(out_features, in_features)``.
        act: statistics of the layer's input rows.
        grad: statistics of its output-gradient rows (``None`` or empty: no backward seen).
        weight_stats: the weight model, if any.
        reservoir: captured real rows, if any.
        rows: rows per call (the GEMM's ``M`` in the forward pass).
    """

    name: str
    weight: torch.Tensor
    act: TensorStatistics
    grad: Optional[TensorStatistics]
    weight_stats: Optional[WeightStatistics]
    reservoir: Optional[RowReservoir]
    rows: int

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def has_grad(self) -> bool:
        return self.grad is not None and not self.grad.is_empty


@contextlib.contextmanager
def _no_tf32() -> Iterator[None]:
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def reference_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """High-precision ``A (M, K) @ B (N, K)^T``: float64 on the CPU, float32 without TF32 on CUDA."""
    if a.is_cuda:
        with _no_tf32():
            return a.float() @ b.float().t()
    return a.double() @ b.double().t()


def draw_rows(rows: int, cap: Optional[int]) -> int:
    """Rows per draw: the layer's rows per call, capped, kept a multiple of 16 when above 16."""
    r = rows if cap is None else min(rows, cap)
    return r - r % 16 if r > 16 else max(r, 1)


_SAMPLE_DTYPE = torch.float32  # draws are rounded to the model's dtype anyway; float32 halves their cost


def _seed(name: str, role: GemmRole, seed: int, kind: str) -> int:
    return zlib.crc32(f"{name}|{role.value}|{kind}".encode()) + 1_000_003 * seed


def _weight_draws(snap: LayerSnapshot, count: int, seed: int, device: torch.device) -> List[torch.Tensor]:
    factor_device = snap.weight_stats.row_factor.device
    gen = make_generator(factor_device, zlib.crc32(f"{snap.name}|weights".encode()) + 1_000_003 * seed)
    return [snap.weight_stats.sample(gen, dtype=_SAMPLE_DTYPE).to(device) for _ in range(count)]


class _Models:
    """The layer's Gaussian models, fitted (one Cholesky factorization each) on first use."""

    def __init__(self, snap: LayerSnapshot) -> None:
        self._snap = snap
        self._x: Optional[GaussianModel] = None
        self._dy: Optional[GaussianModel] = None

    @property
    def x(self) -> GaussianModel:
        if self._x is None:
            self._x = GaussianModel.from_statistics(self._snap.act, dtype=_SAMPLE_DTYPE)
        return self._x

    @property
    def dy(self) -> GaussianModel:
        if self._dy is None:
            self._dy = GaussianModel.from_statistics(self._snap.grad, dtype=_SAMPLE_DTYPE)
        return self._dy


def _gaussian_operands(
    snap: LayerSnapshot, models: _Models, role: GemmRole, rows: int, samples: int, seed: int, weights: Optional[List[torch.Tensor]] = None
) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Draws of ``(A, B)`` for ``role``; with ``weights``, one draw per given weight instead of the actual one."""
    x_model = models.x
    dy_model = models.dy if role != GemmRole.FORWARD else None
    gen = make_generator(x_model.mean.device, _seed(snap.name, role, seed, "wm" if weights else "g"))
    w = snap.weight.detach()
    for i in range(len(weights) if weights else samples):
        if weights:
            w = weights[i]
        dy = dy_model.sample(rows, gen) if dy_model is not None else None
        x = x_model.sample(rows, gen) if role != GemmRole.GRAD_INPUT else None
        yield role_operands(role, x, w, dy)


@dataclasses.dataclass
class _CapturedDraws:
    """Chunks of the reservoir's rows, each from one batch, as GEMM operands for one role."""

    operands: List[Tuple[torch.Tensor, torch.Tensor]]
    batch: List[int]  # the group (index into ``groups``) of each chunk
    groups: List[Tuple[torch.Tensor, Optional[torch.Tensor]]]  # the rows of each batch, on the weight's device
    chunk: int


def _captured_draws(snap: LayerSnapshot, role: GemmRole, rows: int, samples: int) -> _CapturedDraws:
    """Up to ``samples`` chunks of captured rows for ``role``, every chunk inside one batch (the
    latest batches first), ``rows`` rows at most and at least four chunks where the reservoir allows."""
    empty = _CapturedDraws([], [], [], 0)
    if snap.reservoir is None:
        return empty
    device = snap.weight.device
    groups = [
        (x.to(device), None if dy is None else dy.to(device))
        for x, dy in snap.reservoir.by_batch(with_grads=role != GemmRole.FORWARD)
    ]
    sizes = [x.shape[0] for x, _ in groups]
    if sum(sizes) < 2:
        return empty
    chunk = max(1, min(rows, sum(sizes) // 4, max(sizes)))
    while chunk > 1 and sum(n // chunk for n in sizes) < min(4, samples):
        chunk //= 2
    w = snap.weight.detach()
    draws = _CapturedDraws([], [], groups, chunk)
    for g, (x, dy) in enumerate(groups):
        for i in range(x.shape[0] // chunk):
            if len(draws.operands) == samples:
                return draws
            part = slice(i * chunk, (i + 1) * chunk)
            draws.operands.append(role_operands(role, x[part], w, dy[part] if dy is not None else None))
            draws.batch.append(g)
    return draws


def sampling_noise_power(x: torch.Tensor, dy: torch.Tensor, rows: int) -> float:
    """Expected ``|G - E[G]|_F^2`` of a weight gradient ``G = sum dy_i x_i^T`` over ``rows`` rows
    drawn independently from the given ``(x, dy)`` pairs.

    One row contributes ``P_i = dy_i x_i^T``; over the ``n`` given rows its variance (summed over
    the gradient's elements, unbiased) is ``n / (n - 1) * (mean_i |dy_i|^2 |x_i|^2 - |mean_i P_i|_F^2)``
    (``|P_i|_F = |dy_i| |x_i|``), and a sum of ``rows`` independent rows has ``rows`` times that.
    """
    n = x.shape[0]
    if n < 2:
        raise ValueError(f"x: expected at least 2 rows to estimate a variance, got {n}")
    if dy.shape[0] != n:
        raise ValueError(f"dy: expected {n} rows (one per row of x), got {dy.shape[0]}")
    per_row = (x.double().square().sum(1) * dy.double().square().sum(1)).mean()
    mean_outer = reference_gemm(dy.t(), x.t()).double() / n
    variance = n / (n - 1) * (per_row - mean_outer.square().sum())
    return rows * max(float(variance), 0.0)


def _measure(
    operands: Iterator[Tuple[torch.Tensor, torch.Tensor]], runs: Sequence[CandidateRun], dtype: torch.dtype, amaxes: DelayedOperandAmax
) -> Tuple[Dict[KernelChoice, List[float]], Dict[KernelChoice, List[float]], Dict[KernelChoice, List[float]], Dict[KernelChoice, str]]:
    """Per candidate and draw: MERE, SQNR (dB) and the error's power ``|out - ref|_F^2``; and the
    failures. ``amaxes`` gives each draw's scaling amaxes (a fresh one per measurement)."""
    # Metrics stay on the device until the end: one host synchronization per call, not per draw.
    pending: Dict[KernelChoice, List[torch.Tensor]] = {r.choice: [] for r in runs}
    failures: Dict[KernelChoice, str] = {}
    for a, b in operands:
        # The candidate sees the operands in the model's dtype, as in training; the reference
        # multiplies the same rounded values, so only the GEMM's own error is measured.
        a_in = a.to(dtype).contiguous()
        b_in = b.to(dtype).contiguous()
        ref = reference_gemm(a_in, b_in)
        amax = amaxes(a_in, b_in)
        for run in runs:
            c = run.choice
            if c in failures:
                continue
            try:
                out = run.gemm(a_in, b_in, dtype, amax)
            except Exception as exc:  # a kernel that fails at this shape is an unavailable candidate, with its reason
                failures[c] = f"{type(exc).__name__}: {exc}"
                continue
            pending[c].append(torch.cat([mere_tensor(out, ref).reshape(1), noise_and_signal(out, ref)]))
    meres: Dict[KernelChoice, List[float]] = {}
    sqnrs: Dict[KernelChoice, List[float]] = {}
    noises: Dict[KernelChoice, List[float]] = {}
    for c, values in pending.items():
        rows = torch.stack(values).tolist() if values else []
        meres[c] = [row[0] for row in rows]
        sqnrs[c] = [sqnr_from_sums(row[1], row[2]) for row in rows]
        noises[c] = [row[1] for row in rows]
    return meres, sqnrs, noises, failures


def _noise_ratio(noises: List[float], floors: List[float]) -> Optional[Interval]:
    """The interval of each chunk's error power over its batch's sampling noise (``None``: none measurable)."""
    ratios = [noise / floor for noise, floor in zip(noises, floors) if floor > 0]
    return _nonnegative(t_interval(ratios)) if ratios else None


def _nonnegative(iv: Interval) -> Interval:
    """A MERE interval clipped at zero (the mean of nonnegative values cannot be negative)."""
    return dataclasses.replace(iv, low=max(iv.low, 0.0)) if iv.low < 0 else iv


def nonfinite_statistics(snap: LayerSnapshot) -> Optional[str]:
    """What in ``snap`` is not finite (the weight, or the input/gradient statistics), else ``None``."""
    if not bool(torch.isfinite(snap.weight).all()):
        return f"{snap.name}: the weight holds inf/NaN"
    for what, stats in (("input", snap.act), ("output-gradient", snap.grad)):
        if stats is None or stats.is_empty:
            continue
        values = [getattr(stats, name, None) for name in ("mean", "m2_diag", "amax", "sum_sq")]
        if any(v is not None and not bool(torch.isfinite(v).all()) for v in values) or float(getattr(stats, "nonfinite", 0) or 0) > 0:
            return f"{snap.name}: the {what} statistics saw inf/NaN"
    return None


def quantify_errors(
    snap: LayerSnapshot,
    candidates: Dict[GemmRole, Sequence[KernelChoice]],
    *,
    samples: int,
    max_rows: Optional[int] = None,
    seed: int = 0,
    dtype: Optional[torch.dtype] = None,
    grad_format: "Fp8Format | str" = Fp8Format.E4M3,
    forward_scaling: str = "current",
    grad_scaling: str = "current",
) -> Dict[Tuple[GemmRole, KernelChoice], CandidateError]:
    """MERE and SQNR of every candidate for every role of one layer (see the module docstring).

    Args:
        snap: the layer's statistics, weight and reservoir.
        candidates: the kernels to evaluate per role.
        samples: K, Gaussian draws per role.
        max_rows: cap on the rows per draw.
        seed: base seed of the draws (the same seed gives the same draws).
        dtype: the dtype the candidates receive their operands in (default: the weight's).
        grad_format: FP8 format of the gradient operands (as Dispatch's ``grad_format``).
        forward_scaling: ``"current"``, or ``"delayed"``: the input's operand scaled by earlier
            draws' amax (module docstring).
        grad_scaling: the same for the output gradient's operand (``dy``, ``dy^T``).

    Returns:
        ``{(role, candidate): CandidateError}``; roles without gradient statistics get an
        unavailable entry that says so.
    """
    if samples < 2:
        raise ValueError(f"samples: expected at least 2 draws, got {samples}")
    if snap.act.is_empty:
        raise ValueError(f"{snap.name}: no input rows were seen; cannot quantify errors")
    problem = nonfinite_statistics(snap)
    if problem is not None:  # statistics with inf/NaN measure nothing: every candidate unavailable, named
        return {
            (GemmRole(role), c): CandidateError.unavailable(f"non-finite statistics: {problem}")
            for role, choices in candidates.items()
            for c in dict.fromkeys(choices)
        }
    device = snap.weight.device
    dtype = dtype or snap.weight.dtype
    rows = draw_rows(snap.rows, max_rows)
    results: Dict[Tuple[GemmRole, KernelChoice], CandidateError] = {}
    weight_draws: Optional[List[torch.Tensor]] = None
    models = _Models(snap)
    for role, choices in candidates.items():
        role = GemmRole(role)
        choices = list(dict.fromkeys(choices))
        if role != GemmRole.FORWARD and not snap.has_grad:
            for c in choices:
                results[(role, c)] = CandidateError.unavailable("no output gradients were seen (no backward pass at probe steps)")
            continue
        shape = GemmShape.for_role(role, rows, snap.in_features, snap.out_features)
        runnable: List[CandidateRun] = []
        for c in choices:
            run = resolve_candidate(c, role, shape, device, grad_format=grad_format)
            if isinstance(run, str):
                results[(role, c)] = CandidateError.unavailable(run)
            else:
                runnable.append(run)
        if not runnable:
            continue
        def scales() -> DelayedOperandAmax:
            return DelayedOperandAmax(role, forward_scaling, grad_scaling)

        g_mere, g_sqnr, _, failures = _measure(_gaussian_operands(snap, models, role, rows, samples, seed), runnable, dtype, scales())
        wm_mere: Dict[KernelChoice, List[float]] = {}
        if role != GemmRole.GRAD_WEIGHT and snap.weight_stats is not None and snap.weight_stats.updates:
            if weight_draws is None:
                weight_draws = _weight_draws(snap, max(2, samples // 4), seed, device)
            wm_mere, _, _, _ = _measure(_gaussian_operands(snap, models, role, rows, samples, seed, weight_draws), runnable, dtype, scales())
        draws = _captured_draws(snap, role, rows, samples)
        if scales().delayed:  # in training order: each chunk scaled by the batches before it
            draws.operands.reverse()
            draws.batch.reverse()
        c_mere, c_sqnr, c_noise, _ = _measure(iter(draws.operands), runnable, dtype, scales())
        noise_floors: List[float] = []  # per captured chunk: its batch's sampling noise
        if role == GemmRole.GRAD_WEIGHT and draws.operands:
            # The candidates saw the rows rounded to the model's dtype: so does the sampling noise.
            per_batch = {
                g: sampling_noise_power(x.to(dtype), dy.to(dtype), draws.chunk)
                for g, (x, dy) in enumerate(draws.groups)
                if x.shape[0] >= 2 and g in draws.batch
            }
            noise_floors = [per_batch.get(g, 0.0) for g in draws.batch]
        for run in runnable:
            c = run.choice
            if c in failures:
                results[(role, c)] = CandidateError.unavailable(failures[c])
                continue
            notes = [f"K and N zero-padded to multiples of {run.align}"] if run.align > 1 else []
            captured = _nonnegative(t_interval(c_mere[c])) if c_mere.get(c) else None
            if captured is None:
                notes.append("captured: too few reservoir rows")
            results[(role, c)] = CandidateError(
                gaussian=_nonnegative(t_interval(g_mere[c])),
                gaussian_sqnr=t_interval(g_sqnr[c]),
                weight_model=_nonnegative(t_interval(wm_mere[c])) if wm_mere.get(c) else None,
                captured=captured,
                captured_sqnr=t_interval(c_sqnr[c]) if c_sqnr.get(c) else None,
                captured_noise_ratio=_noise_ratio(c_noise.get(c, []), noise_floors),
                note="; ".join(notes),
            )
    return results
