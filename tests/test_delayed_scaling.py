"""Delayed scaling of the forward's FP8 operands (``forward_scaling="delayed"``).

Compiled, a delayed layer scales its tensorwise input and weight operands by the largest amax of
its earlier calls (``GemmSite._amax_history``), so the cast needs no reduction over the operand
first; eagerly it scales by the current amax, as a ``"current"`` layer does, and records the
history. These tests check the scales it uses (against a float64 GEMM of the operands quantized
with exactly those scales), the saturation past them, the recompiles, the non-finite handling, the
configuration (Dispatch's default for layers that run compiled), and that what judges a plan (the
Probe's error evidence, random evidence, the gradient check) measures the error of those scales.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import loka_torchrec
from loka_torchrec.dispatch import DispatchConfig
from loka_torchrec.dispatch.layer_kernels import LayerKernels
from loka_torchrec.dispatch.linear import AMAX_HISTORY, LokaLinear, compiled_scaling
from loka_torchrec.evidence import GemmRole, GemmShape, KernelChoice
from loka_torchrec.fp8 import Fp8Format, quantize, tensor_amax
from loka_torchrec.gemm.backends import get_backend
from loka_torchrec.gemm.candidates import CandidateRun, resolve_candidate
from loka_torchrec.gemm.measure import DelayedOperandAmax, error_samples
from loka_torchrec.gemm.recipes import recipe_for
from loka_torchrec.probe.quantify import LayerSnapshot, quantify_errors
from loka_torchrec.probe.reservoir import RowReservoir
from loka_torchrec.probe.statistics import TensorStatistics

E4M3 = Fp8Format.E4M3
TENSORWISE = LayerKernels.uniform(KernelChoice("scaled_mm", "tensorwise"))


def _compile_counter():
    from torch._dynamo.testing import CompileCounterWithBackend

    return CompileCounterWithBackend("inductor")


def _forward_reference(x: torch.Tensor, weight: torch.Tensor, amax_x: torch.Tensor, amax_w: torch.Tensor) -> torch.Tensor:
    """``x W^T`` in float64 from the operands quantized with these amaxes (the FP8 values are exact)."""
    xq = quantize(x, E4M3, "tensorwise", nonfinite="propagate", amax=amax_x).dequantize(torch.float64)
    wq = quantize(weight, E4M3, "tensorwise", nonfinite="propagate", amax=amax_w).dequantize(torch.float64)
    return xq @ wq.t()


def _fp32_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """An fp32-accumulated GEMM of exact FP8 values: relative error within a few fp32 roundoffs per term."""
    scale = ref.abs().max().item()
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=scale * 64 * 2.0**-24 * 8)


# --------------------------------------------------------------------------------------- quantize
def test_quantize_with_a_given_amax_scales_by_it_and_saturates_beyond():
    torch.manual_seed(0)
    x = torch.randn(32, 64)
    x[3, 5] = 6.0
    amax = torch.tensor(2.0)
    q = quantize(x, E4M3, "tensorwise", amax=amax)
    assert torch.equal(q.dequant_scale, (E4M3.max / amax).reciprocal())
    clipped = x.clamp(-2.0, 2.0).double()
    back = q.dequantize(torch.float64)
    inside = x.abs() < 2.0
    # In range: e4m3 rounding (3 mantissa bits: relative error <= 2**-4) or the subnormal step.
    step = E4M3.smallest_subnormal * 2.0 / E4M3.max
    assert ((back - clipped).abs()[inside] <= (clipped.abs() * 2.0**-4).clamp(min=step)[inside]).all()
    # Beyond it: exactly the format's maximum, i.e. the given amax.
    torch.testing.assert_close(back[~inside].abs(), torch.full_like(back[~inside], 2.0), rtol=1e-6, atol=0)
    # The tensor's own amax given explicitly is current scaling, bit for bit.
    own = quantize(x, E4M3, "tensorwise", amax=tensor_amax(x))
    assert torch.equal(own.data.view(torch.uint8), quantize(x, E4M3, "tensorwise").data.view(torch.uint8))


@pytest.mark.parametrize("granularity, amax, match", [
    ("rowwise", torch.tensor(1.0), "tensorwise"),
    ("tensorwise", torch.ones(4, 1), "0-d"),
])  # fmt: skip
def test_quantize_refuses_an_amax_it_cannot_use(granularity, amax, match):
    with pytest.raises(ValueError, match=match):
        quantize(torch.randn(4, 16), E4M3, granularity, amax=amax, name="x")


# --------------------------------------------------------------------------------------- layer
def test_compiled_layer_scales_by_the_history_saturates_and_compiles_twice():
    """The first compiled call scales by the current amax and records it; the second compiles once
    more and from then on scales by the largest recorded amax: an input that grows saturates."""
    torch._dynamo.reset()
    torch.manual_seed(1)
    layer = LokaLinear(64, 32, bias=False, kernels=TENSORWISE, forward_scaling="delayed")
    counter = _compile_counter()
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    amaxes = []
    for step, growth in enumerate((1.0, 1.0, 1.0, 8.0, 1.0)):
        x = torch.randn(16, 64) * growth
        prior = layer._amax_history.amax(dim=1)
        with torch.no_grad():
            y = compiled(x)
        if step == 0:  # no history yet: the current amaxes
            ref = _forward_reference(x, layer.weight.detach(), tensor_amax(x), tensor_amax(layer.weight.detach()))
        else:
            ref = _forward_reference(x, layer.weight.detach(), prior[0], prior[1])
        _fp32_close(y, ref)
        amaxes.append(float(tensor_amax(x)))
    assert counter.frame_count == 2  # the seeding call, then the delayed graph; no recompile after
    history = layer._amax_history
    assert history.shape == (2, AMAX_HISTORY)
    assert history[0, :5].tolist() == pytest.approx(amaxes[::-1], rel=0, abs=0)
    assert torch.equal(history[1, :5], tensor_amax(layer.weight.detach()).expand(5))
    assert int(layer.nonfinite_events) == 0
    torch._dynamo.reset()


def test_a_grown_input_differs_from_current_scaling_only_by_saturation():
    """The same step under current and delayed scaling: equal where the input stays within the
    history's amax, and delayed clips where it grows past it."""
    torch._dynamo.reset()
    torch.manual_seed(2)
    base = nn.Linear(64, 32, bias=False)
    layers = {s: LokaLinear.from_linear(base, kernels=TENSORWISE, forward_scaling=s) for s in ("current", "delayed")}
    compiled = {s: torch.compile(layer, backend="inductor", fullgraph=True) for s, layer in layers.items()}
    x = torch.randn(16, 64)
    with torch.no_grad():
        for s in compiled:
            for _ in range(2):  # seed the delayed layer's history with x's amax
                compiled[s](x)
        same = {s: compiled[s](x) for s in compiled}
        grown = x.clone()
        grown[0] *= 10.0
        clipped = {s: compiled[s](grown) for s in compiled}
    torch.testing.assert_close(same["delayed"], same["current"], rtol=0, atol=0)  # history amax == current amax
    assert not torch.allclose(clipped["delayed"][0], clipped["current"][0], rtol=0.05)
    torch._dynamo.reset()


def test_compiled_delayed_gradients_against_float64():
    torch._dynamo.reset()
    torch.manual_seed(3)
    layer = LokaLinear(128, 64, kernels=TENSORWISE, forward_scaling="delayed")
    compiled = torch.compile(layer, backend="inductor", fullgraph=True)
    for _ in range(3):
        x = torch.randn(32, 128, requires_grad=True)
        dy = torch.randn(32, 64)
        layer.zero_grad()
        compiled(x).backward(dy)
    w = layer.weight.detach().double()
    ref_dx, ref_dw = dy.double() @ w, dy.double().t() @ x.detach().double()
    for got, ref in ((x.grad, ref_dx), (layer.weight.grad, ref_dw)):
        rel = float((got.double() - ref).norm() / ref.norm())
        assert rel < 0.1, rel  # e4m3 operands: a few % relative Frobenius error, never a wrong result
    torch._dynamo.reset()


def test_eager_calls_scale_by_the_current_amax_and_record_the_history():
    torch.manual_seed(4)
    base = nn.Linear(64, 32)
    current = LokaLinear.from_linear(base, kernels=TENSORWISE, forward_scaling="current")
    delayed = LokaLinear.from_linear(base, kernels=TENSORWISE, forward_scaling="delayed")
    high_precision = LokaLinear.from_linear(base, forward_scaling="delayed")  # all bf16: history recorded eagerly too
    for step in range(3):
        x = torch.randn(8, 64) * (step + 1)
        with torch.no_grad():
            assert torch.equal(delayed(x), current(x))
            high_precision(x)
        for layer in (delayed, high_precision):
            assert layer._amax_history[0, 0] == tensor_amax(x)
    assert delayed._history_seeded and not current._history_seeded
    assert (current._amax_history == 0).all()  # current layers keep no history
    assert "_amax_history" not in delayed.state_dict()  # run-time state: checkpoints stay nn.Linear's


def test_compiled_nonfinite_input_gives_nan_is_counted_and_keeps_the_history():
    torch._dynamo.reset()
    torch.manual_seed(5)
    layer = LokaLinear(64, 32, bias=False, kernels=TENSORWISE, forward_scaling="delayed")
    compiled = torch.compile(layer, backend="inductor", fullgraph=True)
    x = torch.randn(8, 64)
    with torch.no_grad():
        for _ in range(2):
            compiled(x)
        before = layer._amax_history.clone()
        bad = x.clone()
        bad[2, 7] = float("inf")
        y = compiled(bad)
    assert torch.isnan(y[2]).all() and torch.isfinite(y[[0, 1, 3]]).all()  # never silently finite
    assert int(layer.nonfinite_events) == 1
    assert torch.isfinite(layer._amax_history).all()
    assert torch.equal(layer._amax_history[:, 0], before[:, 0])  # the newest finite amax repeated
    torch._dynamo.reset()


# --------------------------------------------------------------------------------------- config
def test_bad_forward_scaling_names_the_field():
    with pytest.raises(ValueError, match="dispatch.forward_scaling"):
        DispatchConfig(forward_scaling="lazy")
    with pytest.raises(ValueError, match="forward_scaling"):
        LokaLinear(16, 8, forward_scaling="lazy")
    layer = LokaLinear(16, 8)
    with pytest.raises(ValueError, match="forward_scaling"):
        layer.forward_scaling = "Delayed"
    assert layer.forward_scaling == "current"  # a layer's own default, unchanged by the refused value
    assert DispatchConfig().forward_scaling == "delayed"  # what Dispatch gives layers that run compiled


def test_apply_sets_every_site_and_a_second_apply_changes_it():
    """Sites of layers that run compiled take ``forward_scaling``; eager layers are ``current``
    (they would scale by the current amax anyway, and keep no history)."""
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 8))
    loka_torchrec.apply(model, DispatchConfig(mode="all:scaled_mm:tensorwise", forward_scaling="current", compiled=True))
    sites = [m for m in model.modules() if isinstance(m, LokaLinear)]
    assert len(sites) == 2 and all(s.forward_scaling == "current" for s in sites)
    loka_torchrec.apply(model, DispatchConfig(mode="all:scaled_mm:tensorwise", compiled=True))
    assert all(s.forward_scaling == "delayed" for s in sites)
    report = loka_torchrec.apply(model, DispatchConfig(mode="all:scaled_mm:tensorwise"))  # eager
    assert all(s.forward_scaling == "current" for s in sites) and report.dispatcher.forward_scaling == "current"
    with torch.no_grad():
        model(torch.randn(4, 32))
    assert all((s._amax_history == 0).all() for s in sites)  # nothing recorded eagerly


# ------------------------------------------------------------------- what judges a delayed plan
def test_measured_draws_are_scaled_by_the_draws_before_them():
    """The layer input's operand (fwd ``A``, wgrad ``B`` = ``x^T``) of each draw gets the largest
    amax of the earlier draws, the first its own; every other operand, and current scaling, none."""
    draws = [torch.full((2, 4), v) for v in (1.0, 3.0, 2.0, 5.0)]
    other = torch.ones(3, 4)
    fwd = DelayedOperandAmax(GemmRole.FORWARD, "delayed")
    assert [float(fwd(x, other)[0]) for x in draws] == [1.0, 1.0, 3.0, 3.0]
    wgrad = DelayedOperandAmax(GemmRole.GRAD_WEIGHT, "delayed")
    given = [wgrad(other, x.t()) for x in draws]
    assert [g[0] for g in given] == [None] * 4 and [float(g[1]) for g in given] == [1.0, 1.0, 3.0, 3.0]
    for role, scaling in ((GemmRole.GRAD_INPUT, "delayed"), (GemmRole.FORWARD, "current")):
        amaxes = DelayedOperandAmax(role, scaling)
        assert all(amaxes(x, other) == (None, None) for x in draws)
    with pytest.raises(ValueError, match="forward_scaling"):
        DelayedOperandAmax(GemmRole.FORWARD, "lazy")
    # Random evidence's error samples, in order: a grown second input saturates under delayed scaling.
    torch.manual_seed(10)
    w = torch.randn(16, 64) / 8
    pairs = [(torch.randn(32, 64), w), (torch.randn(32, 64) * 16, w)]
    errors = {
        scaling: error_samples(KernelChoice("scaled_mm", "tensorwise"), GemmRole.FORWARD, pairs, grad_format=E4M3, forward_scaling=scaling)
        for scaling in ("current", "delayed")
    }
    assert errors["delayed"][0] == errors["current"][0] and errors["delayed"][1] > 5 * errors["current"][1], errors


def test_a_candidate_given_an_amax_quantizes_as_the_compiled_layer(monkeypatch):
    torch.manual_seed(6)
    x, w = torch.randn(32, 64), torch.randn(16, 64) / 8
    amax = torch.tensor(1.5)  # below x's own: the rest saturates, as in a compiled delayed call
    run = resolve_candidate(KernelChoice("scaled_mm", "tensorwise"), GemmRole.FORWARD, GemmShape(32, 64, 16), "cpu")
    _fp32_close(run.gemm(x, w, torch.float32, (amax, None)), _forward_reference(x, w, amax, tensor_amax(w)))
    assert not torch.allclose(run.gemm(x, w, torch.float32, (amax, None)), run.gemm(x, w, torch.float32), rtol=0.05)
    # A rowwise operand has no tensorwise amax to replace: the given one is ignored.
    rowwise = resolve_candidate(KernelChoice("scaled_mm", "rowwise"), GemmRole.FORWARD, GemmShape(32, 64, 16), "cpu")
    assert torch.equal(rowwise.gemm(x, w, torch.float32, (amax, None)), rowwise.gemm(x, w, torch.float32))
    # Kernels that do not run compiled never run with delayed scales: refused, with the reason.
    # (Every tensorwise kernel compiles today; TE's, taken out of its compiled recipes, stands for one.)
    monkeypatch.setattr(type(get_backend("te")), "compile_recipes", ())
    te = CandidateRun(KernelChoice("te", "tensorwise"), recipe_for("tensorwise", GemmRole.FORWARD))
    with pytest.raises(ValueError, match="te:tensorwise: a given amax .* run compiled; te:tensorwise does not trace"):
        te.gemm(x, w, torch.float32, (amax, None))


def _growing_input_snapshot() -> LayerSnapshot:
    """Four batches of a layer's input, the newest 16 times larger than the three before it."""
    gen = torch.Generator().manual_seed(7)
    act, reservoir = TensorStatistics(32), RowReservoir(32, 16, capacity=256)
    for growth in (1.0, 1.0, 1.0, 16.0):
        x = torch.randn(64, 32, generator=gen) * growth
        act.update(x)
        reservoir.offer_inputs(x)
    return LayerSnapshot("layer", torch.randn(16, 32, generator=gen) / 6, act, None, None, reservoir, 64)


def test_probe_errors_under_delayed_scaling_see_an_input_that_grows():
    """Captured rows, oldest batch first: the grown batch saturates against the earlier ones' amax
    (a large error that current scaling does not have); Gaussian draws from one distribution do
    not grow, and delayed scaling changes their error little."""
    snap = _growing_input_snapshot()
    tensorwise, rowwise = KernelChoice("scaled_mm", "tensorwise"), KernelChoice("scaled_mm", "rowwise")
    errors = {
        scaling: quantify_errors(snap, {GemmRole.FORWARD: [tensorwise, rowwise]}, samples=4, forward_scaling=scaling)
        for scaling in ("current", "delayed")
    }
    current, delayed = (errors[s][(GemmRole.FORWARD, tensorwise)] for s in ("current", "delayed"))
    # Three chunks at E4M3's error, the grown one mostly saturated.
    assert current.captured.value < 0.1 and delayed.captured.value > 3 * current.captured.value
    assert abs(delayed.gaussian.value - current.gaussian.value) <= 0.1 * current.gaussian.value
    # Rowwise operands are scaled per row in both: the same numbers.
    assert errors["current"][(GemmRole.FORWARD, rowwise)] == errors["delayed"][(GemmRole.FORWARD, rowwise)]


def test_compiled_scaling_scales_eager_calls_by_the_history_and_records_nothing():
    torch.manual_seed(8)
    layer = LokaLinear(64, 32, bias=False, kernels=TENSORWISE, forward_scaling="delayed")
    with torch.no_grad():
        layer(torch.randn(16, 64))  # an eager call records the history
        history = layer._amax_history.clone()
        grown = torch.randn(16, 64) * 8
        with compiled_scaling([layer]):
            y = layer(grown)
        eager = layer(grown)  # outside: current scaling again, and recorded
    weight = layer.weight.detach()
    _fp32_close(y, _forward_reference(grown, weight, history[0, 0], history[1, 0]))
    _fp32_close(eager, _forward_reference(grown, weight, tensor_amax(grown), tensor_amax(weight)))
    assert torch.equal(layer._amax_history[:, 1:], history[:, :-1])  # one record: the call outside
    assert not layer._scaled_as_compiled


@pytest.mark.parametrize("compiled", [False, True])
def test_the_gradient_check_judges_the_scales_training_uses(compiled):
    """A delayed plan whose histories are far below the checked batch: compiled, the forward
    saturates and the check sends GEMMs back to bf16; eager training scales by the current amax,
    and the same plan passes. A check of a compiled model leaves the histories as they were."""
    torch.manual_seed(9)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    config = DispatchConfig(mode="all:scaled_mm:tensorwise", forward_scaling="delayed", compiled=compiled)
    report = loka_torchrec.apply(model, config)
    assert report.dispatcher.forward_scaling == ("delayed" if compiled else "current")
    for site in report.dispatcher.managed_layers().values():
        site.forward_scaling = "delayed"  # as a delayed site of an eager model: the check still judges current scales
    with torch.no_grad():
        model(torch.randn(64, 32) * 0.05)  # the steps so far saw small inputs
    sites = list(report.dispatcher.managed_layers().values())
    histories = [site._amax_history.clone() for site in sites]
    x = torch.randn(64, 32)
    plan = report.dispatcher.check_gradients(lambda: model(x).square().mean())
    assert (plan.fp8_gemm_count() < 6) == compiled, plan.table()
    if compiled:  # the next compiled step's scales are those of the training steps before the check
        assert all(torch.equal(site._amax_history, h) for site, h in zip(sites, histories))


# ------------------------------------------------------------------------ delayed gradient scaling
def _dy_cast_waits_for_dy(model: nn.Module, x: torch.Tensor) -> bool:
    """Whether, in the compiled backward graph, a cast of ``dy`` (rows x out) to FP8 depends on a
    reduction over ``dy`` (an ``amax`` of a tensor of ``dy``'s size): current scaling's two passes."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    def forward_as_is(gm, _inputs):
        return make_boxed_func(gm.forward)

    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=forward_as_is, bw_compiler=keep), fullgraph=True)
    for _ in range(2):  # the second call runs with the recorded history
        compiled(x).sum().backward()
    backward = graphs[-1].graph
    rows, out = x.shape[0], model.out_features

    def numel(node):
        val = node.meta.get("val")
        return val.numel() if isinstance(val, torch.Tensor) else 0

    def waits(node, seen):
        for parent in node.all_input_nodes:
            if parent in seen:
                continue
            seen.add(parent)
            if parent.target == torch.ops.aten.amax.default and numel(parent.args[0]) == rows * out:
                return True
            if waits(parent, seen):
                return True
        return False

    def to_fp8(node):
        if node.target == torch.ops.prims.convert_element_type.default:
            return node.args[1] == torch.float8_e4m3fn
        return node.target == torch.ops.aten._to_copy.default and node.kwargs.get("dtype") == torch.float8_e4m3fn

    casts = [n for n in backward.nodes if n.op == "call_function" and to_fp8(n) and numel(n) == rows * out]
    assert casts, "no FP8 cast of dy in the backward graph"
    torch._dynamo.reset()
    return any(waits(cast, set()) for cast in casts)


def test_delayed_gradients_cast_dy_without_waiting_for_its_amax():
    """Compiled, current scaling casts ``dy`` only after reducing ``dy`` (two passes); delayed
    scaling casts it by the recorded history, so the cast can fuse into ``dy``'s producer."""
    torch.manual_seed(4)
    x = torch.randn(32, 64, requires_grad=True)
    for scaling, waits in (("current", True), ("delayed", False)):
        layer = LokaLinear(64, 48, kernels=TENSORWISE, forward_scaling="delayed")
        layer.grad_scaling = scaling
        assert _dy_cast_waits_for_dy(layer, x) is waits, scaling


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_delayed_gradients_scale_by_the_history_record_it_and_count_saturation(device):
    """The first compiled backward scales ``dy`` by its own amax and records it; then each scales by
    the history's largest amax: the same ``dy`` gives the same gradients as current scaling, bit for
    bit, and a grown ``dy`` is clipped there and counted. On a GPU the compiled backward writes the
    history and the counters in place as on the CPU."""
    torch._dynamo.reset()
    torch.manual_seed(5)
    base = nn.Linear(64, 48, bias=False)
    layers = {
        s: LokaLinear.from_linear(base, kernels=TENSORWISE, forward_scaling="delayed").to(device) for s in ("current", "delayed")
    }
    layers["delayed"].grad_scaling = "delayed"
    counter = _compile_counter()
    compiled = {s: torch.compile(layer, backend=counter if s == "delayed" else "inductor", fullgraph=True) for s, layer in layers.items()}
    x = torch.randn(32, 64, device=device)
    dy = torch.randn(32, 48, device=device)

    def grads(scaling, dy):
        xs = x.clone().requires_grad_(True)
        layers[scaling].zero_grad()
        compiled[scaling](xs).backward(dy)
        return xs.grad, layers[scaling].weight.grad.clone()

    for step in range(3):
        same = {s: grads(s, dy) for s in compiled}
        for got, ref in zip(same["delayed"], same["current"]):
            torch.testing.assert_close(got, ref, rtol=0, atol=0)  # the history's amax is dy's own
    history = layers["delayed"]._grad_amax_history
    assert history[:3].tolist() == [float(tensor_amax(dy))] * 3 and float(history[3:].abs().sum()) == 0.0
    assert layers["current"]._grad_amax_history.abs().sum() == 0  # current scaling records nothing
    assert layers["delayed"].grad_scaling_events() == {"calls": 3, "saturated": 0, "nonfinite": 0}
    assert counter.frame_count == 2  # the seeding call, then the delayed graph
    grown = dy.clone()
    grown[0] *= 10.0
    clipped = {s: grads(s, grown) for s in compiled}
    assert not torch.allclose(clipped["delayed"][0][0], clipped["current"][0][0], rtol=0.05)  # its row saturated
    # the other rows keep the scale they had: dx's rows are those of the unchanged dy's
    torch.testing.assert_close(clipped["delayed"][0][1:], same["delayed"][0][1:], rtol=0, atol=0)
    assert layers["delayed"].grad_scaling_events() == {"calls": 4, "saturated": 1, "nonfinite": 0}
    assert float(history[0]) == float(tensor_amax(grown))  # recorded: the next call scales by it
    assert counter.frame_count == 2
    torch._dynamo.reset()


def test_delayed_gradients_count_a_nonfinite_dy_and_keep_the_history():
    torch._dynamo.reset()
    torch.manual_seed(6)
    layer = LokaLinear(32, 16, bias=False, kernels=TENSORWISE, forward_scaling="delayed")
    layer.grad_scaling = "delayed"
    compiled = torch.compile(layer, backend="inductor", fullgraph=True)
    x = torch.randn(8, 32)
    for dy in (torch.randn(8, 16), torch.randn(8, 16)):
        compiled(x.clone().requires_grad_(True)).backward(dy)
    before = layer._grad_amax_history.clone()
    bad = torch.randn(8, 16)
    bad[2, 3] = float("inf")
    xs = x.clone().requires_grad_(True)
    compiled(xs).backward(bad)
    assert not torch.isfinite(xs.grad).all()  # never silently finite
    assert layer.grad_scaling_events()["nonfinite"] == 1
    assert float(layer._grad_amax_history[0]) == float(before[0])  # the inf is not recorded
    torch._dynamo.reset()


def test_grad_scaling_is_configured_checked_and_left_alone_by_checks():
    with pytest.raises(ValueError, match="dispatch.grad_scaling"):
        DispatchConfig(grad_scaling="lazy")
    layer = LokaLinear(16, 8, kernels=TENSORWISE)
    with pytest.raises(ValueError, match="grad_scaling"):
        layer.grad_scaling = "Delayed"
    assert layer.grad_scaling == "current" and DispatchConfig().grad_scaling == "current"  # opt-in
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 8))
    report = loka_torchrec.apply(model, DispatchConfig(mode="all:scaled_mm:tensorwise", grad_scaling="delayed", compiled=True))
    sites = [m for m in model.modules() if isinstance(m, LokaLinear)]
    assert all(s.grad_scaling == "delayed" for s in sites) and report.dispatcher.grad_scaling == "delayed"
    # an eager call judged as the compiled one (the gradient check) records nothing
    with compiled_scaling(sites):
        model(torch.randn(4, 32)).sum().backward()
    assert all(float(s._grad_amax_history.abs().sum()) == 0 for s in sites)
    assert report.dispatcher.grad_scaling_events() == {"calls": 0, "saturated": 0, "nonfinite": 0}
    eager = loka_torchrec.apply(model, DispatchConfig(mode="all:scaled_mm:tensorwise", grad_scaling="delayed"))
    assert all(s.grad_scaling == "current" for s in sites) and eager.dispatcher.grad_scaling == "current"


def test_measured_gradient_draws_are_scaled_by_the_draws_before_them():
    """Under delayed gradient scaling the output gradient's operand (dgrad ``A`` = ``dy``, wgrad
    ``A`` = ``dy^T``) of each draw gets the largest amax of the earlier draws, as training's backward
    does; with both delayed, grad-weight's two operands each keep their own record."""
    draws = [torch.full((2, 4), v) for v in (1.0, 3.0, 2.0, 5.0)]
    other = torch.ones(3, 4)
    dgrad = DelayedOperandAmax(GemmRole.GRAD_INPUT, "current", "delayed")
    given = [dgrad(dy, other) for dy in draws]
    assert [float(g[0]) for g in given] == [1.0, 1.0, 3.0, 3.0] and all(g[1] is None for g in given)
    both = DelayedOperandAmax(GemmRole.GRAD_WEIGHT, "delayed", "delayed")
    given = [both(dy, 2 * dy) for dy in draws]
    assert [(float(a), float(b)) for a, b in given] == [(1.0, 2.0), (1.0, 2.0), (3.0, 6.0), (3.0, 6.0)]
    assert DelayedOperandAmax(GemmRole.FORWARD, "current", "delayed")(draws[0], other) == (None, None)
    assert not DelayedOperandAmax(GemmRole.FORWARD, "current", "delayed").delayed
    with pytest.raises(ValueError, match="grad_scaling"):
        DelayedOperandAmax(GemmRole.GRAD_INPUT, "current", "lazy")
    # Error samples in order: a grown second dy saturates under delayed gradient scaling.
    torch.manual_seed(11)
    w_t = (torch.randn(16, 64) / 8).t().contiguous()  # dgrad's B: W^T, (in, out)
    pairs = [(torch.randn(32, 16), w_t), (torch.randn(32, 16) * 16, w_t)]
    errors = {
        scaling: error_samples(KernelChoice("scaled_mm", "tensorwise"), GemmRole.GRAD_INPUT, pairs, grad_format=E4M3,
                               grad_scaling=scaling)  # fmt: skip
        for scaling in ("current", "delayed")
    }
    assert errors["delayed"][0] == errors["current"][0] and errors["delayed"][1] > 5 * errors["current"][1], errors


def test_the_probe_and_random_evidence_measure_the_gradient_scaling_training_uses(monkeypatch):
    """Dispatch tells the Probe how its layers scale ``dy`` (``EvidenceConsumer.grad_scaling``), and
    its random evidence samples errors so."""
    from loka_torchrec.dispatch import random_evidence
    from loka_torchrec.evidence import EvidenceConsumer

    assert EvidenceConsumer().grad_scaling == "current"
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 8))
    report = loka_torchrec.apply(model, DispatchConfig(grad_scaling="delayed", compiled=True, evidence="random"))
    assert report.dispatcher.grad_scaling == "delayed"
    seen = []
    real = random_evidence.error_samples

    def spy(*args, **kwargs):
        seen.append((kwargs.get("forward_scaling"), kwargs.get("grad_scaling")))
        return real(*args, **kwargs)

    monkeypatch.setattr(random_evidence, "error_samples", spy)
    with torch.no_grad():
        model(torch.randn(8, 32))
    report.dispatcher.measure_random(seed=1)
    assert seen and set(seen) == {("delayed", "delayed")}
