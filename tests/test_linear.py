"""LokaLinear: per-role kernels vs a float64 reference, caching, saved activations, edge cases.

Error bounds (used by every numerics test below), for ``C = A B^T`` with both operands rounded
to FP8 with ``m`` mantissa bits (unit roundoff ``u = 2**-(m+1)``, 2**-4 for E4M3):

* Round to nearest leaves an error uniform on ``[-ulp/2, ulp/2]``, mean square ``ulp**2 / 12``.
  A normal value ``x`` in ``[2**e, 2**(e+1))`` has ``ulp = 2**(e-m)``, so its relative mean-square
  error lies between ``u**2 / 12`` (``|x|`` at the top of the binade) and ``u**2 / 3`` (at the
  bottom). Below the smallest normal the spacing is the subnormal step times the group's
  dequantization scale ``amax / fp8_max``: add ``(step * amax / fp8_max)**2 / 12`` to the upper
  estimate (flushes to zero are covered by the lower estimate too, since their error is ``|x|``).
* Rounding errors of different elements are independent and zero-mean, so
  ``E |dC|_F^2 = sum_ijk (ms(A)_ik B_jk^2 + A_ik^2 ms(B)_jk + ms(A)_ik ms(B)_jk)``: no ``sqrt(K)``
  growth, unlike the worst-case bound ``2u |A||B|^T``.
* The measured relative Frobenius error must lie in ``[0.8 * lo, 1.25 * hi]``: a Frobenius norm
  over thousands of independent errors concentrates to within a few percent of its expectation,
  so the factors only absorb sampling noise. The lower end proves FP8 really ran.

A high-precision (fp32) GEMM is held to the classic worst case ``K * 2**-24 * |(|A||B|^T)|_F``.
"""

from __future__ import annotations

import copy
import doctest
import math

import pytest
import torch
from torch import nn

from loka_torchrec.dispatch import linear as linear_module
from loka_torchrec.gemm.backends import base as backend_base
from loka_torchrec.gemm.backends import get_backend
from loka_torchrec.gemm.backends.emulated import EmulatedBackend
from loka_torchrec.dispatch.layer_kernels import LayerKernels
from loka_torchrec.dispatch.linear import LokaLinear
from loka_torchrec.dispatch.operands import transpose_fp8
from loka_torchrec.evidence import BF16, GemmRole, KernelChoice
from loka_torchrec.fp8 import Fp8Format, quantize
from loka_torchrec.gemm.recipes import recipe_for

FP8_CHOICES = [
    "emulated:tensorwise",
    "emulated:rowwise",
    "emulated:blockwise",
    "scaled_mm:tensorwise",
    "scaled_mm:rowwise",
    "scaled_mm:rowwise_fast_accum",
]
ROWS_SHAPE, IN, OUT = (4, 24), 160, 80  # rows = 96; 160 and 80 leave partial 128-blocks
E4M3 = Fp8Format.E4M3

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# --------------------------------------------------------------------------------------- bounds
def _mean_square_error(t: torch.Tensor, fmt: Fp8Format, group_amax: torch.Tensor, *, upper: bool) -> torch.Tensor:
    """Per-element mean-square rounding error of ``t`` (float64) in ``fmt`` (see module docstring)."""
    u = fmt.unit_roundoff
    if not upper:
        return (u**2 / 12) * t**2
    step = fmt.smallest_subnormal * group_amax / fmt.max
    return (u**2 / 3) * t**2 + step**2 / 12


def fp8_gemm_error_range(a, b, fmt_a, fmt_b, *, amax_a=None, amax_b=None, out_roundoff=0.0):
    """``(lo, hi)`` expected relative Frobenius error of ``fp8(A) fp8(B)^T`` against ``A B^T``.

    ``amax_a``/``amax_b``: each element's scaling-group amax (default: the tensor's, the coarsest).
    ``out_roundoff``: unit roundoff of the GEMM's output dtype when it is coarser than fp32.
    """
    a, b = a.double(), b.double()
    amax_a = a.abs().max() if amax_a is None else amax_a.double()
    amax_b = b.abs().max() if amax_b is None else amax_b.double()
    ref_sq = float(((a @ b.t()) ** 2).sum())
    out = []
    for upper in (False, True):
        ms_a = _mean_square_error(a, fmt_a, amax_a, upper=upper)
        ms_b = _mean_square_error(b, fmt_b, amax_b, upper=upper)
        noise = float((ms_a @ (b**2).t() + (a**2) @ ms_b.t() + ms_a @ ms_b.t()).sum())
        if upper:
            noise += out_roundoff**2 / 3 * ref_sq
        out.append(math.sqrt(noise / ref_sq))
    return tuple(out)


def fp32_gemm_error_bound(a, b) -> float:
    """Worst-case relative error of an fp32 GEMM (fp32 inputs exact): ``K 2**-24 |(|A||B|^T)| / |AB^T|``."""
    a, b = a.double(), b.double()
    return a.shape[1] * 2.0**-24 * float((a.abs() @ b.abs().t()).norm()) / float((a @ b.t()).norm()) + 2.0**-23


def rel_err(out: torch.Tensor, ref: torch.Tensor, base: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / base.norm())


# --------------------------------------------------------------------------------------- helpers
def kernels_for(choice: str, role: str) -> LayerKernels:
    kc = KernelChoice.parse(choice)
    return LayerKernels.uniform(kc) if role == "all" else LayerKernels().replace(GemmRole(role), kc)


def make_inputs(seed: int = 0, rows_shape=ROWS_SHAPE, in_features=IN, out_features=OUT):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*rows_shape, in_features, generator=g)
    dy = torch.randn(*rows_shape, out_features, generator=g)
    return x, dy


def run_layer(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor):
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(dy)
    return y.detach(), x.grad, layer.weight.grad, None if layer.bias is None else layer.bias.grad


def reference(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor):
    """float64 autograd of F.linear with the layer's parameters."""
    w = layer.weight.detach().double().requires_grad_()
    b = None if layer.bias is None else layer.bias.detach().double().requires_grad_()
    x64 = x.double().requires_grad_()
    y = nn.functional.linear(x64, w, b)
    y.backward(dy.double())
    return y.detach(), x64.grad, w.grad, None if b is None else b.grad


@pytest.fixture
def quantize_calls(monkeypatch):
    """Names of the operands every backend quantizes (``"weight"``, ``"input^T"``, ...)."""
    calls = []
    for name in ("emulated", "scaled_mm"):
        backend = get_backend(name)
        original = backend.quantize

        def spy(t, spec, *, name="operand", _original=original):
            calls.append(name)
            return _original(t, spec, name=name)

        monkeypatch.setattr(backend, "quantize", spy)
        if backend.quantizes_with_transpose:

            def spy_pair(t, spec, *, name="operand", _original=backend.quantize_with_transpose):
                calls.append(f"{name}+T")  # the operand and its transpose from one call
                return _original(t, spec, name=name)

            monkeypatch.setattr(backend, "quantize_with_transpose", spy_pair)
    return calls


# --------------------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("role", ["fwd", "dgrad", "wgrad", "all"])
@pytest.mark.parametrize("choice", FP8_CHOICES)
def test_each_role_against_float64(choice, role):
    torch.manual_seed(0)
    layer = LokaLinear(IN, OUT, kernels=kernels_for(choice, role))
    x, dy = make_inputs()
    y, dx, dw, db = run_layer(layer, x, dy)
    y_ref, dx_ref, dw_ref, db_ref = reference(layer, x, dy)

    x2, dy2, w = x.reshape(-1, IN).double(), dy.reshape(-1, OUT).double(), layer.weight.detach().double()
    gemms = {  # role: (result, reference, A, B, format of A)
        "fwd": (y, y_ref, x2, w, E4M3),
        "dgrad": (dx, dx_ref, dy2, w.t(), E4M3),
        "wgrad": (dw, dw_ref, dy2.t(), x2.t(), E4M3),
    }
    for r, (out, ref, a, b, fmt_a) in gemms.items():
        base = a @ b.t()
        err = rel_err(out.reshape(ref.shape), ref, base)
        if role in (r, "all"):
            lo, hi = fp8_gemm_error_range(a, b, fmt_a, E4M3)
            assert 0.8 * lo <= err <= 1.25 * hi, f"{choice} {r}: error {err:.4f} outside [{0.8 * lo:.4f}, {1.25 * hi:.4f}]"
        else:
            assert err <= fp32_gemm_error_bound(a, b), f"{choice} {r} (high precision): error {err:.2e}"
    # The bias gradient is a plain sum in high precision whatever the kernels.
    assert rel_err(db, db_ref, db_ref) <= x2.shape[0] * 2.0**-24
    assert int(layer.nonfinite_events) == 0


@pytest.mark.parametrize("choice", ["emulated:rowwise", "scaled_mm:tensorwise"])
def test_e5m2_gradients_follow_their_wider_bound(choice):
    torch.manual_seed(1)
    layer = LokaLinear(IN, OUT, kernels=kernels_for(choice, "all"), grad_format=Fp8Format.E5M2)
    assert layer.grad_format == Fp8Format.E5M2
    x, dy = make_inputs(1)
    _, dx, dw, _ = run_layer(layer, x, dy)
    _, dx_ref, dw_ref, _ = reference(layer, x, dy)
    x2, dy2, w = x.reshape(-1, IN).double(), dy.reshape(-1, OUT).double(), layer.weight.detach().double()
    for out, ref, a, b in ((dx, dx_ref, dy2, w.t()), (dw, dw_ref, dy2.t(), x2.t())):
        lo, hi = fp8_gemm_error_range(a, b, Fp8Format.E5M2, E4M3)
        err = rel_err(out, ref, a @ b.t())
        assert 0.8 * lo <= err <= 1.25 * hi


def test_rowwise_beats_tensorwise_on_outlier_rows():
    """One row 2**16 larger pushes every other row into tensorwise FP8's subnormals."""
    torch.manual_seed(2)
    rows, in_f, out_f, outlier = 64, 128, 64, 5
    x = torch.randn(rows, in_f)
    x[outlier] *= 2.0**16
    w = torch.randn(out_f, in_f) / math.sqrt(in_f)
    ref = x.double() @ w.double().t()
    y = {}
    for recipe in ("tensorwise", "rowwise"):
        layer = LokaLinear(in_f, out_f, bias=False, kernels=LayerKernels(fwd=KernelChoice("emulated", recipe)))
        with torch.no_grad():
            layer.weight.copy_(w)
            y[recipe] = layer(x).double()
    # Rowwise: every row, outlier included, meets the normal-range bound of its own.
    for i in range(rows):
        _, hi = fp8_gemm_error_range(x[i : i + 1], w, E4M3, E4M3)
        assert rel_err(y["rowwise"][i], ref[i], ref[i]) <= 1.25 * hi, f"row {i}"
    # Tensorwise: on the ordinary rows the error is set by the subnormal step that the outlier's
    # amax imposes (the bound with amax_a = the whole tensor's predicts it) ...
    ordinary = [i for i in range(rows) if i != outlier]
    _, hi_tensorwise = fp8_gemm_error_range(x[ordinary], w, E4M3, E4M3, amax_a=x.abs().max())
    err = {r: rel_err(y[r][ordinary], ref[ordinary], ref[ordinary]) for r in y}
    assert err["tensorwise"] <= 1.25 * hi_tensorwise
    # ... which is several times the normal-range error that rowwise keeps there.
    _, hi_rowwise = fp8_gemm_error_range(x[ordinary], w, E4M3, E4M3)
    assert hi_tensorwise > 4 * hi_rowwise and err["tensorwise"] > 4 * err["rowwise"]


def test_high_precision_kernels_equal_nn_linear():
    torch.manual_seed(3)
    plain = nn.Linear(IN, OUT)
    loka = LokaLinear.from_linear(nn.Linear(IN, OUT))
    loka.load_state_dict(plain.state_dict())
    x, dy = make_inputs(3)
    for got, want in zip(run_layer(loka, x, dy), run_layer(plain, x, dy)):
        assert torch.equal(got, want)


def test_mixed_kernels_keep_high_precision_roles_at_nn_linear_accuracy():
    """fwd and dgrad in high precision, only wgrad FP8: output and grad_input match nn.Linear."""
    torch.manual_seed(4)
    plain = nn.Linear(IN, OUT)
    loka = LokaLinear(IN, OUT, kernels=LayerKernels(wgrad=KernelChoice("scaled_mm", "rowwise")))
    loka.load_state_dict(plain.state_dict())
    x, dy = make_inputs(4)
    y, dx, dw, db = run_layer(loka, x, dy)
    y_p, dx_p, dw_p, db_p = run_layer(plain, x, dy)
    torch.testing.assert_close(y, y_p)
    torch.testing.assert_close(dx, dx_p)
    torch.testing.assert_close(db, db_p)
    assert not torch.allclose(dw, dw_p, rtol=1e-4, atol=0)  # the FP8 GEMM really ran


# --------------------------------------------------------------------------------------- conversion
def test_state_dict_round_trip_both_directions():
    plain = nn.Linear(12, 7)
    loka = LokaLinear(12, 7, kernels=kernels_for("emulated:rowwise", "all"))
    assert list(loka.state_dict()) == ["weight", "bias"]  # the event counter is not model state
    loka.load_state_dict(plain.state_dict(), strict=True)
    assert torch.equal(loka.weight, plain.weight) and torch.equal(loka.bias, plain.bias)
    with torch.no_grad():
        loka.weight.mul_(2.0)
    back = nn.Linear(12, 7)
    back.load_state_dict(loka.state_dict(), strict=True)
    assert torch.equal(back.weight, loka.weight)
    no_bias = LokaLinear(12, 7, bias=False)
    nn.Linear(12, 7, bias=False).load_state_dict(no_bias.state_dict(), strict=True)


def test_from_linear_shares_parameters_and_mode():
    plain = nn.Linear(10, 6).eval()
    opt = torch.optim.SGD(plain.parameters(), lr=0.5)  # built before the swap
    loka = LokaLinear.from_linear(plain, kernels=kernels_for("emulated:tensorwise", "fwd"))
    assert loka.weight is plain.weight and loka.bias is plain.bias
    assert not loka.training
    assert loka.nonfinite_events.device == plain.weight.device
    before = loka.weight.detach().clone()
    loka(torch.randn(3, 10, requires_grad=True)).sum().backward()
    opt.step()
    assert not torch.equal(loka.weight, before)
    back = loka.to_linear()
    assert type(back) is nn.Linear and back.weight is plain.weight and back.bias is plain.bias and not back.training
    assert LokaLinear.from_linear(nn.Linear(4, 2, bias=False)).bias is None
    with pytest.raises(TypeError, match="linear"):
        LokaLinear.from_linear(nn.Conv1d(2, 2, 1))


def test_deepcopy_keeps_kernels_and_parameters_apart():
    layer = LokaLinear(16, 8, kernels=kernels_for("emulated:tensorwise", "all"))
    x = torch.randn(4, 16)
    with torch.no_grad():
        y = layer(x)  # fills the weight cache
        twin = copy.deepcopy(layer)
        assert twin.weight is not layer.weight and twin.kernels == layer.kernels
        assert torch.equal(twin(x), y)
        twin.weight.mul_(2.0)
        assert torch.equal(layer(x), y) and not torch.equal(twin(x), y)


# --------------------------------------------------------------------------------------- caching
def test_weight_quantized_once_per_step_tensorwise(quantize_calls):
    torch.manual_seed(5)
    layer = LokaLinear(32, 16, kernels=kernels_for("emulated:tensorwise", "all"))
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    for _ in range(2):  # two micro-batches: forward and dgrad share one quantized weight
        layer(torch.randn(8, 32, requires_grad=True)).sum().backward()
    with torch.no_grad():
        layer.eval()(torch.randn(4, 32))  # an eval call in the same step reuses it too
    layer.train()
    assert quantize_calls.count("weight") == 1
    assert quantize_calls.count("weight^T") == 0  # W^T is W's FP8 bytes transposed
    # tensorwise x and dy are reused transposed for wgrad: no second quantization
    assert quantize_calls.count("input^T") == 0 and quantize_calls.count("grad_output^T") == 0
    opt.step()  # bumps weight._version
    layer(torch.randn(8, 32, requires_grad=True)).sum().backward()
    assert quantize_calls.count("weight") == 2


@pytest.mark.parametrize("optimizer", [torch.optim.Adam, torch.optim.Adagrad, torch.optim.SGD])
def test_a_fused_optimizer_step_invalidates_the_weight_cache(optimizer):
    # PyTorch's fused optimizers update the weight in place without bumping its _version: the
    # next forward must still see the new weight, not the FP8 copy of the old one.
    torch.manual_seed(6)
    layer = LokaLinear(32, 16, kernels=kernels_for("emulated:tensorwise", "all"))
    opt = optimizer(layer.parameters(), lr=0.1, fused=True)
    x = torch.randn(8, 32)
    layer(x).sum().backward()
    version = layer.weight._version
    opt.step()
    assert layer.weight._version == version  # the premise: no version bump
    fresh = LokaLinear(32, 16, kernels=kernels_for("emulated:tensorwise", "all"))
    fresh.load_state_dict(layer.state_dict())
    with torch.no_grad():
        assert torch.equal(layer(x), fresh(x))


def test_weight_cache_rowwise_quantizes_both_axes(quantize_calls):
    layer = LokaLinear(32, 16, kernels=kernels_for("scaled_mm:rowwise", "all"))
    for _ in range(3):
        layer(torch.randn(8, 32, requires_grad=True)).sum().backward()
    assert quantize_calls.count("weight") == 1 and quantize_calls.count("weight^T") == 1
    # x with x^T (scaled per column of x) and dy with dy^T: one paired call each per step
    assert quantize_calls.count("input+T") == 3 and quantize_calls.count("grad_output+T") == 3
    assert quantize_calls.count("input^T") == 0 and quantize_calls.count("input") == 0
    with torch.no_grad():
        layer.weight.add_(1.0)  # any in-place update invalidates
    layer(torch.randn(8, 32))
    assert quantize_calls.count("weight") == 2


@pytest.mark.parametrize("choice", ["scaled_mm:rowwise", "scaled_mm:tensorwise"])
def test_paired_quantization_equals_separate_quantization(choice, monkeypatch):
    """x with x^T and dy with dy^T from one call give bit-identical outputs and gradients."""
    torch.manual_seed(3)
    x, dy = make_inputs()
    layer = LokaLinear(IN, OUT, kernels=kernels_for(choice, "all"))
    paired = run_layer(layer, x, dy)
    from loka_torchrec.dispatch.quantizer import Quantizer

    monkeypatch.setattr(Quantizer, "paired", lambda self, *args, **kwargs: None)
    layer.weight.grad = layer.bias.grad = None
    separate = run_layer(layer, x, dy)
    for got, want in zip(paired, separate):
        assert torch.equal(got, want)


def test_a_backend_without_paired_quantization_says_so_and_quantizes_separately(quantize_calls):
    """``quantize_with_transpose`` is declared on ``GemmBackend``: its default refuses, and a layer
    on such a backend quantizes ``x`` and ``x^T`` (``dy`` and ``dy^T``) in two calls."""
    emulated = get_backend("emulated")
    assert get_backend("scaled_mm").quantizes_with_transpose and not emulated.quantizes_with_transpose
    spec = recipe_for("rowwise", GemmRole.FORWARD).a
    with pytest.raises(NotImplementedError, match="emulated: quantize_with_transpose is not supported"):
        emulated.quantize_with_transpose(torch.randn(8, 32), spec)
    layer = LokaLinear(32, 16, kernels=kernels_for("emulated:rowwise", "all"))
    layer(torch.randn(8, 32, requires_grad=True)).sum().backward()
    assert not any(call.endswith("+T") for call in quantize_calls)
    assert quantize_calls.count("input") == 1 and quantize_calls.count("input^T") == 1
    assert quantize_calls.count("grad_output") == 1 and quantize_calls.count("grad_output^T") == 1


def test_paired_quantization_skipped_when_rows_need_padding(quantize_calls, monkeypatch):
    """Rows that grad-weight must pad (alignment 16) fall back to separate quantization, exactly."""
    monkeypatch.setattr(get_backend("scaled_mm"), "alignment", lambda device, recipe=None: 16)
    layer = LokaLinear(32, 16, kernels=kernels_for("scaled_mm:rowwise", "all"))
    x = torch.randn(10, 32, requires_grad=True)  # 10 rows: padded to 16 for grad-weight
    y = layer(x)
    y.sum().backward()
    assert "input+T" not in quantize_calls and "input^T" in quantize_calls
    ref = x.detach().double() @ layer.weight.detach().double().t() + layer.bias.detach().double()
    assert torch.allclose(y.detach().double(), ref, rtol=0.15, atol=0.15)


@pytest.mark.parametrize(
    "granularity, block, shape", [("tensorwise", None, (80, 160)), ("blockwise", (128, 128), (200, 136))]
)
def test_transposed_reuse_equals_direct_quantization(granularity, block, shape):
    w = torch.randn(*shape)
    reused = transpose_fp8(quantize(w, E4M3, granularity, block=block))
    direct = quantize(w.t(), E4M3, granularity, block=block)
    assert torch.equal(reused.data.view(torch.uint8), direct.data.view(torch.uint8))
    assert torch.equal(reused.dequant_scale, direct.dequant_scale)
    assert reused.data.is_contiguous()


# --------------------------------------------------------------------------------------- saved activation
def saved_for_backward(layer, x):
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    return saved, y


@pytest.mark.parametrize(
    "kernels, expected",
    [
        # high-precision wgrad: x itself (rows, in)
        (LayerKernels(fwd=KernelChoice("emulated", "rowwise")), (torch.float32, (24, 40))),
        # FP8 wgrad after a high-precision forward: the quantized x^T operand (in, rows)
        (LayerKernels(wgrad=KernelChoice("emulated", "rowwise")), (torch.float8_e4m3fn, (40, 24))),
        (LayerKernels(wgrad=KernelChoice("emulated", "blockwise")), (torch.float8_e4m3fn, (40, 24))),
        # tensorwise forward and wgrad on a backend without paired quantization: the forward's
        # FP8 x, transposed only in the backward
        (kernels_for("emulated:tensorwise", "all"), (torch.float8_e4m3fn, (24, 40))),
        # with paired quantization (scaled_mm): x^T written with x in one call, kept for wgrad
        (kernels_for("scaled_mm:tensorwise", "all"), (torch.float8_e4m3fn, (40, 24))),
        # rowwise forward scales rows of x, wgrad needs columns: a second operand x^T
        (kernels_for("scaled_mm:rowwise", "all"), (torch.float8_e4m3fn, (40, 24))),
    ],
)
def test_saved_activation_has_the_wgrad_format(kernels, expected):
    layer = LokaLinear(40, 16, kernels=kernels)
    x = torch.randn(24, 40, requires_grad=True)
    saved, y = saved_for_backward(layer, x)
    activations = [s for s in saved if s[1] in ((24, 40), (40, 24))]
    assert activations == [expected]  # exactly one copy of x, in the wgrad kernel's format
    assert (torch.float32, (16, 40)) in saved  # the weight Parameter (no copy), for the version check
    y.sum().backward()
    assert x.grad.shape == x.shape


# --------------------------------------------------------------------------------------- shapes and modes
def test_leading_batch_dims_and_no_bias():
    torch.manual_seed(6)
    layer = LokaLinear(20, 12, bias=False, kernels=kernels_for("emulated:rowwise", "all"))
    x = torch.randn(2, 3, 5, 20)
    dy = torch.randn(2, 3, 5, 12)
    y, dx, dw, db = run_layer(layer, x, dy)
    assert y.shape == (2, 3, 5, 12) and dx.shape == x.shape and db is None
    assert layer.last_rows == 30 and isinstance(layer.last_rows, int)
    layer.weight.grad = None
    y2, dx2, dw2, _ = run_layer(layer, x.reshape(30, 20), dy.reshape(30, 12))
    assert torch.equal(y, y2.reshape(y.shape)) and torch.equal(dx, dx2.reshape(dx.shape)) and torch.equal(dw, dw2)
    empty = layer(torch.randn(0, 4, 20))
    assert empty.shape == (0, 4, 12) and layer.last_rows == 0
    with pytest.raises(ValueError, match="in_features=20"):
        layer(torch.randn(3, 21))


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_inference_keeps_nothing_for_backward(context, quantize_calls):
    layer = LokaLinear(40, 16, kernels=kernels_for("emulated:rowwise", "all")).eval()
    x = torch.randn(24, 40, requires_grad=True)
    with context():
        saved, y = saved_for_backward(layer, x)
    assert saved == [] and y.grad_fn is None and not y.requires_grad
    assert "input^T" not in quantize_calls  # no wgrad operand made
    with torch.no_grad():
        y_train_mode = layer.train()(x)
    assert torch.equal(y, y_train_mode)
    frozen = LokaLinear(40, 16, kernels=kernels_for("emulated:rowwise", "all")).requires_grad_(False)
    assert frozen(torch.randn(3, 40)).grad_fn is None  # grad enabled but nothing to differentiate


def test_nonfinite_inputs_give_nan_and_count_events():
    layer = LokaLinear(16, 8, kernels=LayerKernels(fwd=KernelChoice("emulated", "rowwise")))
    x = torch.randn(4, 16)
    x[2, 3] = float("inf")
    with torch.no_grad():
        y = layer(x)
    assert torch.isnan(y[2]).all() and torch.isfinite(y[[0, 1, 3]]).all()  # never silently finite
    assert layer.nonfinite_events.dtype == torch.int64 and int(layer.nonfinite_events) == 1
    assert "nonfinite_events" not in layer.state_dict()

    tensorwise = LokaLinear(16, 8, kernels=kernels_for("emulated:tensorwise", "all"))
    x = torch.randn(4, 16, requires_grad=True)
    dy = torch.randn(4, 8)
    dy[1, 1] = float("nan")
    y = tensorwise(x)
    y.backward(dy)
    assert torch.isfinite(y).all() and int(tensorwise.nonfinite_events) == 1  # only dy (its tensorwise FP8 copy is reused for wgrad)
    assert torch.isnan(x.grad).all() and torch.isnan(tensorwise.weight.grad).all()

    high_precision = LokaLinear(16, 8, kernels=LayerKernels(dgrad=KernelChoice("emulated", "rowwise")))
    with torch.no_grad():
        high_precision(torch.full((2, 16), float("nan")))
    assert int(high_precision.nonfinite_events) == 0  # only FP8-quantized operands count


# --------------------------------------------------------------------------------------- unaligned shapes
class _Aligned16Backend(EmulatedBackend):
    """The emulated kernels, but refusing K or N not a multiple of 16 (like scaled_mm on CUDA)."""

    name = "emulated_aligned16"

    def __init__(self):
        super().__init__()
        self.mm_shapes, self.checks = [], 0

    def alignment(self, device, recipe=None):
        return 16

    def check(self, recipe, shape, device):
        self.checks += 1
        return super().check(recipe, shape, device)

    def mm(self, a, b, recipe, out_dtype):
        if a.shape[1] % 16 or b.shape[0] % 16:
            raise RuntimeError(f"unaligned GEMM {tuple(a.shape)} x {tuple(b.shape)}")
        self.mm_shapes.append((a.shape[1], b.shape[0]))
        return super().mm(a, b, recipe, out_dtype)


class _SmallKBackend(EmulatedBackend):
    """Refuses K > 32 for a reason padding cannot fix."""

    name = "emulated_small_k"

    def check(self, recipe, shape, device):
        return f"K={shape.k} exceeds 32" if shape.k > 32 else super().check(recipe, shape, device)


@pytest.fixture
def fake_backends(monkeypatch):
    backends = {cls.name: cls() for cls in (_Aligned16Backend, _SmallKBackend)}
    for name, backend in backends.items():
        monkeypatch.setitem(backend_base._REGISTRY, name, backend)
    return backends


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_unaligned_shapes_are_zero_padded_exactly(recipe, fake_backends):
    aligned = fake_backends["emulated_aligned16"]
    torch.manual_seed(7)
    padded = LokaLinear(40, 24, kernels=kernels_for(f"emulated_aligned16:{recipe}", "all"))
    plain = LokaLinear(40, 24, kernels=kernels_for(f"emulated:{recipe}", "all"))
    plain.load_state_dict(padded.state_dict())
    x, dy = make_inputs(7, rows_shape=(10,), in_features=40, out_features=24)
    got, want = run_layer(padded, x, dy), run_layer(plain, x, dy)
    for g, w in zip(got, want):  # same quantization; zeros only lengthen the fp32 sums
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert padded.fallback_reasons == {}
    assert all(k % 16 == 0 and n % 16 == 0 for k, n in aligned.mm_shapes) and len(aligned.mm_shapes) == 3
    checks = aligned.checks
    run_layer(padded, x, dy)  # same shape: no new check
    run_layer(padded, torch.randn(26, 40), torch.randn(26, 24))  # 26 = 10 mod 16: same plan
    assert aligned.checks == checks


def test_shapes_no_padding_fixes_fall_back_to_high_precision(fake_backends, caplog):
    torch.manual_seed(8)
    layer = LokaLinear(40, 24, kernels=kernels_for("emulated_small_k:rowwise", "all"))
    plain = nn.Linear(40, 24)
    plain.load_state_dict(layer.state_dict())
    x, dy = make_inputs(8, rows_shape=(10,), in_features=40, out_features=24)
    y, dx, dw, _ = run_layer(layer, x, dy)
    y_p, dx_p, dw_p, _ = run_layer(plain, x, dy)
    assert list(layer.fallback_reasons) == [GemmRole.FORWARD]  # fwd K=40; dgrad K=24, wgrad K=10 run
    assert "K=40 exceeds 32" in layer.fallback_reasons[GemmRole.FORWARD]
    assert "emulated_small_k" in caplog.text
    torch.testing.assert_close(y, y_p)  # the fallback is the high-precision GEMM
    assert not torch.allclose(dx, dx_p, rtol=1e-4, atol=0)  # dgrad still FP8
    layer.set_kernels(LayerKernels())
    assert layer.fallback_reasons == {}


# --------------------------------------------------------------------------------------- configuration errors
def test_kernel_names_are_validated():
    with pytest.raises(ValueError, match="kernels.dgrad: .*'no_such_backend'"):
        LokaLinear(8, 8, kernels=LayerKernels(dgrad=KernelChoice("no_such_backend", "rowwise")))
    layer = LokaLinear(8, 8)
    with pytest.raises(ValueError, match="kernels.fwd: backend 'scaled_mm' has no recipe 'blockwise'"):
        layer.set_kernels(LayerKernels(fwd=KernelChoice("scaled_mm", "blockwise")))
    with pytest.raises(ValueError, match="'hp'"):
        layer.kernels = LayerKernels(wgrad=KernelChoice("bf16", "rowwise"))
    with pytest.raises(TypeError, match="kernels: expected a LayerKernels"):
        layer.set_kernels("scaled_mm:rowwise")
    with pytest.raises(ValueError, match="grad_format"):
        LokaLinear(8, 8, grad_format="e3m4")
    assert layer.kernels == LayerKernels()  # a refused change leaves the layer as it was
    layer.kernels = kernels_for("scaled_mm:rowwise", "wgrad")
    assert layer.kernels.wgrad == KernelChoice("scaled_mm", "rowwise") and layer.kernels.fwd == BF16
    assert "wgrad=scaled_mm:rowwise" in repr(layer) and "fwd=bf16:hp" in repr(layer)


def test_docstring_example_runs():
    result = doctest.testmod(linear_module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


# --------------------------------------------------------------------------------------- torch.compile
def test_torch_compile_aot_eager_matches_eager():
    torch._dynamo.reset()
    torch.manual_seed(9)
    model = nn.Sequential(
        LokaLinear(32, 48, kernels=kernels_for("scaled_mm:tensorwise", "all")),
        nn.ReLU(),
        LokaLinear(48, 16, kernels=LayerKernels(wgrad=KernelChoice("scaled_mm", "rowwise"))),
        nn.ReLU(),
        LokaLinear(16, 8),  # high precision: nn.Linear
    )
    compiled = torch.compile(model, backend="aot_eager")
    for rows in (8, 12):  # a second batch size must not break it either
        x = torch.randn(rows, 32, requires_grad=True)
        results = []
        for m in (model, compiled):
            model.zero_grad()
            x.grad = None
            y = m(x)
            y.square().sum().backward()
            results.append([y.detach(), x.grad] + [p.grad.clone() for p in model.parameters()])
        for eager, comp in zip(*results):
            torch.testing.assert_close(comp, eager, rtol=1e-6, atol=1e-6)
        assert model[0].last_rows == rows
    torch._dynamo.reset()


# Quantized operands (amax ops not feeding another amax) in the compiled forward / backward graphs.
# Tensorwise: x and W / dy (W^T and the transposed operands are the forward's and grad-input's FP8
# bytes transposed). Rowwise: x, W and x^T (grad-weight's B) / dy, dy^T and W^T (a row of W^T is a
# column of W: quantized again).
@pytest.mark.parametrize("choice, fwd_amaxes, bwd_amaxes", [("scaled_mm:tensorwise", 2, 1), ("scaled_mm:rowwise", 3, 3)])
@pytest.mark.parametrize("in_features", [64, 512])  # 512: tensorwise amaxes reduced in chunks of a row
def test_compiled_backward_reuses_the_forward_fp8_weight(choice, fwd_amaxes, bwd_amaxes, in_features):
    """Compiled, a tensorwise W^T for grad-input is the forward's FP8 W transposed: the backward
    computes no amax of the weight; rowwise must quantize W^T again."""
    from torch._dynamo.backends.common import aot_autograd

    amaxes = {}

    def counting(name):
        def compiler(gm, example_inputs):
            amax = torch.ops.aten.amax.default  # a tensorwise amax may be a chain (chunks, rows, all)
            amaxes[name] = sum(n.target is amax and not any(u.target is amax for u in n.users) for n in gm.graph.nodes)
            return gm

        return compiler

    torch._dynamo.reset()
    torch.manual_seed(3)
    # Current scaling: the compiled call must give the eager call's FP8 bytes (delayed scales differ).
    layer = LokaLinear(in_features, 32, bias=False, kernels=kernels_for(choice, "all"), forward_scaling="current")
    x = torch.randn(16, in_features, requires_grad=True)
    compiled = torch.compile(layer, backend=aot_autograd(fw_compiler=counting("fwd"), bw_compiler=counting("bwd")), fullgraph=True)
    results = []
    for m in (layer, compiled):
        layer.zero_grad()
        x.grad = None
        m(x).square().sum().backward()
        results.append((x.grad.clone(), layer.weight.grad.clone()))
    torch._dynamo.reset()
    assert (amaxes["fwd"], amaxes["bwd"]) == (fwd_amaxes, bwd_amaxes)
    for eager, comp in zip(*results):
        torch.testing.assert_close(comp, eager, rtol=0, atol=0)  # the same FP8 bytes either way


# --------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "tensorwise_fast_accum", "rowwise_fast_accum"])
@pytest.mark.parametrize("rows, in_f, out_f", [(64, 128, 256), (40, 40, 24)])
def test_cuda_scaled_mm_all_roles(recipe, rows, in_f, out_f):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("torch._scaled_mm needs compute capability >= 8.9")
    torch.manual_seed(10)
    layer = LokaLinear(in_f, out_f, device="cuda", kernels=kernels_for(f"scaled_mm:{recipe}", "all"))
    x, dy = make_inputs(10, rows_shape=(rows,), in_features=in_f, out_features=out_f)
    x, dy = x.cuda(), dy.cuda()
    y, dx, dw, _ = run_layer(layer, x, dy)
    assert layer.fallback_reasons == {}  # unaligned shapes are padded, not refused
    assert y.dtype == torch.float32
    y_ref, dx_ref, dw_ref, _ = reference(layer, x, dy)
    x64, dy64, w = x.double(), dy.double(), layer.weight.detach().double()
    out_roundoff = 2.0**-8 if recipe.startswith("rowwise") else 0.0  # CUDA rowwise _scaled_mm outputs bf16
    for out, ref, a, b in ((y, y_ref, x64, w), (dx, dx_ref, dy64, w.t()), (dw, dw_ref, dy64.t(), x64.t())):
        lo, hi = fp8_gemm_error_range(a, b, E4M3, E4M3, out_roundoff=out_roundoff)
        err = rel_err(out, ref, a @ b.t())
        assert 0.8 * lo <= err <= 1.25 * hi


@pytest.mark.gpu
@requires_cuda
def test_cuda_torch_compile_inductor_matches_eager():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("torch._scaled_mm needs compute capability >= 8.9")
    torch._dynamo.reset()
    torch.manual_seed(11)
    model = nn.Sequential(
        LokaLinear(64, 128, kernels=kernels_for("scaled_mm:rowwise", "all")),
        nn.ReLU(),
        LokaLinear(128, 32, kernels=LayerKernels(fwd=KernelChoice("scaled_mm", "tensorwise"))),
    ).cuda()
    compiled = torch.compile(model)
    x = torch.randn(32, 64, device="cuda", requires_grad=True)
    results = []
    for m in (model, compiled):
        model.zero_grad()
        x.grad = None
        y = m(x)
        y.square().sum().backward()
        results.append([y.detach(), x.grad] + [p.grad.clone() for p in model.parameters()])
    for eager, comp in zip(*results):
        # Fused quantization may round a few elements to the neighbouring FP8 value; anything
        # beyond E4M3's unit roundoff would be a different computation.
        assert rel_err(comp, eager.double(), eager.double()) <= E4M3.unit_roundoff
    torch._dynamo.reset()


def test_nonfinite_scales_are_counted_in_batches_without_losing_any():
    """The scale queue stays bounded over many steps, and a NaN queued long ago is still counted."""
    layer = LokaLinear(16, 8, kernels=kernels_for("emulated:rowwise", "all"))
    for step in range(30):  # 4 operands per step: 120 queued scales, flushed every 64
        x = torch.randn(5, 16, requires_grad=True)
        if step == 3:
            with torch.no_grad():
                x[1, 2] = float("nan")  # one row of x (and of nothing else rowwise) goes NaN
        layer(x).sum().backward()
        assert len(layer._eager.pending_scales) < 64 + 4  # flushed at the next forward
    # x's row 1 (forward), column 2 of x (x^T for grad-weight: one group); dy and W stay finite...
    # ...except dx and dW, which are outputs, not operands. So exactly 2 groups.
    assert int(layer.nonfinite_events) == 2 and not layer._eager.pending_scales
