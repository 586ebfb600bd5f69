"""CUDA graphs of FP8 ``LokaLinear`` layers: the replayed step equals the eager one.

CPU tests check the switch, its plumbing and that nothing is captured off CUDA; the GPU tests
(run on the device) compare graphed layers with eager twins over several optimizer steps.
"""

import copy
import pickle

import pytest
import torch

from loka_torchrec.dispatch import DispatchConfig, LayerKernels
from loka_torchrec.dispatch.convert import convert_linears
from loka_torchrec.dispatch.layer_check import time_layer_step
from loka_torchrec.dispatch.layer_graph import LayerGraphs
from loka_torchrec.dispatch.linear import LokaLinear
from loka_torchrec.evidence import KernelChoice

ROWWISE = LayerKernels(
    fwd=KernelChoice("scaled_mm", "rowwise"),
    dgrad=KernelChoice("scaled_mm", "rowwise"),
    wgrad=KernelChoice("scaled_mm", "rowwise"),
)
EMULATED = LayerKernels(fwd=KernelChoice("emulated", "rowwise"))


# ------------------------------------------------------------------------------------------ CPU
def test_cpu_layer_with_graphs_on_runs_eagerly_and_equals_the_plain_one():
    torch.manual_seed(0)
    plain = LokaLinear(32, 16, kernels=EMULATED)
    graphed = copy.deepcopy(plain)
    graphed.cuda_graphs = True
    for _ in range(3):
        x = torch.randn(8, 32)
        y1, y2 = plain(x), graphed(x)
        torch.testing.assert_close(y1, y2, rtol=0, atol=0)
        y2.sum().backward()
        y1.sum().backward()
    torch.testing.assert_close(plain.weight.grad, graphed.weight.grad, rtol=0, atol=0)
    assert graphed.graphs.captures == 0 and graphed.graphs.replays == 0
    assert "cuda_graphs=True" in repr(graphed)


def test_bad_switch_values_are_refused():
    with pytest.raises(TypeError, match="cuda_graphs"):
        LokaLinear(8, 8, cuda_graphs=1)
    with pytest.raises(ValueError, match="dispatch.cuda_graphs"):
        DispatchConfig(cuda_graphs="yes")
    with pytest.raises(ValueError, match="capture_after"):
        LayerGraphs(capture_after=0)


@pytest.mark.parametrize("flag", [False, True])
def test_conversion_sets_the_switch_on_every_layer(flag):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), LokaLinear(8, 4))
    layers, _ = convert_linears(model, DispatchConfig(cuda_graphs=flag))
    assert len(layers) == 2
    assert all(layer.cuda_graphs is flag for layer in layers.values())


def test_copies_and_pickles_carry_the_switch_but_no_graphs():
    layer = LokaLinear(8, 8, cuda_graphs=True)
    layer.graphs.captures = 3
    for clone in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert clone.cuda_graphs is True
        assert len(clone.graphs) == 0 and clone.graphs.captures == 0


def test_capture_leaves_alias_the_parameters_with_accumulators_of_their_own():
    from loka_torchrec.dispatch.layer_graph import _leaves

    layer = torch.nn.Linear(4, 3)
    static_x = torch.zeros(2, 4)
    x, w, b = _leaves(static_x, True, layer.weight, layer.bias)
    assert all(t.is_leaf and t.requires_grad for t in (x, w, b))
    assert w is not layer.weight and w.data_ptr() == layer.weight.data_ptr() and b.data_ptr() == layer.bias.data_ptr()
    with torch.no_grad():
        layer.weight.add_(1.0)  # an optimizer's in-place update is seen through the alias
    torch.testing.assert_close(w, layer.weight.detach())
    static_x.copy_(torch.ones(2, 4))
    (torch.nn.functional.linear(x, w, b).sum()).backward()
    assert layer.weight.grad is None and w.grad is not None  # the parameter's own .grad is untouched
    torch.testing.assert_close(x.grad, layer.weight.detach().sum(0).expand(2, 4))
    frozen = torch.nn.Linear(4, 3, bias=False).requires_grad_(False)
    x, w, b = _leaves(static_x, False, frozen.weight, None)
    assert not x.requires_grad and not w.requires_grad and b is None


# ------------------------------------------------------------------------------------------ GPU
def _twins(in_f=256, out_f=128, bias=True, kernels=ROWWISE):
    torch.manual_seed(0)
    eager = LokaLinear(in_f, out_f, bias=bias, device="cuda", kernels=kernels)
    graphed = copy.deepcopy(eager)
    graphed.cuda_graphs = True
    return eager, graphed


def _graphed_ok(layer):
    assert layer.graphs.failure is None, f"capture failed: {layer.graphs.failure}"


def _assert_same(a, b, what):
    # Same kernels on the same operands: equal up to the GEMM's own run-to-run freedom (cuBLAS may
    # pick another algorithm inside a capture); bound by half a bf16 ulp of the largest value.
    scale = float(a.abs().max()) or 1.0
    torch.testing.assert_close(b, a, rtol=2**-8, atol=scale * 2**-9, msg=lambda m: f"{what}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_graphed_steps_equal_eager_steps_across_weight_updates(bias, set_to_none):
    eager, graphed = _twins(bias=bias)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_g = torch.optim.SGD(graphed.parameters(), lr=0.1)
    gen = torch.Generator(device="cuda").manual_seed(1)
    steps = 5
    for step in range(steps):
        x = torch.randn(512, 256, device="cuda", generator=gen).to(torch.bfloat16)
        dy = torch.randn(512, 128, device="cuda", generator=gen).to(torch.bfloat16)
        xe, xg = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        ye, yg = eager(xe), graphed(xg)
        _assert_same(ye, yg, f"step {step} output")
        ye.backward(dy)
        yg.backward(dy)
        _assert_same(xe.grad, xg.grad, f"step {step} grad input")
        _assert_same(eager.weight.grad, graphed.weight.grad, f"step {step} grad weight")
        if bias:
            _assert_same(eager.bias.grad, graphed.bias.grad, f"step {step} grad bias")
        opt_e.step(), opt_g.step()  # in-place weight updates: the graph must re-quantize the weight
        opt_e.zero_grad(set_to_none=set_to_none), opt_g.zero_grad(set_to_none=set_to_none)
    assert graphed.graphs.failure is None
    assert graphed.graphs.captures == 1
    assert graphed.graphs.replays == steps - 1  # the first call at a shape runs eagerly


@pytest.mark.gpu
def test_gradients_accumulate_over_two_backwards():
    eager, graphed = _twins()
    gen = torch.Generator(device="cuda").manual_seed(2)
    xs = [torch.randn(512, 256, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(4)]
    for x in xs:  # no zero_grad in between: .grad must be the sum, not the last graph buffer
        eager(x).float().square().sum().backward()
        graphed(x).float().square().sum().backward()
    _graphed_ok(graphed)
    assert graphed.graphs.replays == 3
    _assert_same(eager.weight.grad, graphed.weight.grad, "accumulated grad weight")
    assert graphed.weight.grad.data_ptr() not in {
        t.data_ptr() for step in graphed.graphs._steps.values() for t in step.static_grads if t is not None
    }


@pytest.mark.gpu
def test_second_forward_before_backward_runs_eagerly():
    eager, graphed = _twins()
    x1 = torch.randn(512, 256, device="cuda").to(torch.bfloat16)
    x2 = torch.randn(512, 256, device="cuda").to(torch.bfloat16)
    for layer in (eager, graphed):  # two steps: the shape is captured
        for _ in range(2):
            layer(x1).sum().backward()
        layer.zero_grad()
    _graphed_ok(graphed)
    replays = graphed.graphs.replays
    ye = eager(x1) * 2 + eager(x2)
    yg = graphed(x1) * 2 + graphed(x2)  # the layer used twice before one backward
    assert graphed.graphs.replays == replays + 1
    _assert_same(ye, yg, "output")
    ye.sum().backward()
    yg.sum().backward()
    _assert_same(eager.weight.grad, graphed.weight.grad, "grad weight")


@pytest.mark.gpu
def test_rows_that_change_every_call_are_never_captured():
    _, graphed = _twins()
    for rows in range(100, 110):
        graphed(torch.randn(rows, 256, device="cuda")).sum().backward()
    assert graphed.graphs.captures == 0 and graphed.graphs.replays == 0


@pytest.mark.gpu
def test_nonfinite_inputs_are_counted_in_the_graph():
    _, graphed = _twins()
    x = torch.randn(512, 256, device="cuda").to(torch.bfloat16)
    for _ in range(3):
        graphed(x).sum().backward()
    _graphed_ok(graphed)
    before = int(graphed.nonfinite_events)
    bad = x.clone()
    bad[3, 5] = float("inf")
    y = graphed(bad)
    assert graphed.graphs.replays >= 2
    assert torch.isnan(y[3]).all() and not torch.isnan(y[4]).any()
    assert int(graphed.nonfinite_events) > before


@pytest.mark.gpu
def test_a_failed_capture_leaves_random_ops_working():
    # A synchronization inside the capture invalidates it: the layer must stay eager, and the
    # device's default generator must still serve eager random ops afterwards.
    from loka_torchrec.dispatch import layer_graph

    _, graphed = _twins()

    def unsafe_step(layer, plan, x2d):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            torch.randn(4, device="cuda")  # an RNG op inside the capture
            torch.cuda.synchronize()  # not permitted while capturing
        raise AssertionError("the capture above should have failed")

    graphed.graphs._new_step = unsafe_step
    x = torch.randn(512, 256, device="cuda").to(torch.bfloat16)
    for _ in range(3):
        graphed(x).sum().backward()
    assert graphed.graphs.failure is not None and "should have failed" not in graphed.graphs.failure
    assert graphed.graphs.captures == 0 and graphed.graphs.replays == 0
    assert torch.isfinite(torch.randn(1000, device="cuda")).all()  # raised before the reset
    torch.nn.init.kaiming_uniform_(torch.empty(64, 64, device="cuda"))
    layer_graph.release_generator(torch.device("cuda"))  # harmless when nothing failed
    assert torch.rand(8, device="cuda").max() < 1


@pytest.mark.gpu
def test_layer_check_times_the_graphed_variant():
    timing = time_layer_step(
        1024, 1024, 4096, ROWWISE, bias=False, device=torch.device("cuda"), weight_dtype=torch.float32,
        input_dtype=torch.bfloat16, autocast_dtype=torch.bfloat16, grad_format="e4m3", reps=5,
        cuda_graphs=True,
    )
    assert timing.fp8_ms.value > 0 and timing.bf16_ms.value > 0


# ------------------------------------------------- the replay plumbing, with a stand-in for a graph
class _EagerStep:
    """Behaves like a captured step (static buffers written by 'replays') but computes eagerly."""

    def __init__(self, layer, x2d):
        self.layer = layer
        self.static_y = torch.zeros(x2d.shape[0], layer.out_features)
        self.static_grads = (torch.zeros_like(x2d), torch.zeros_like(layer.weight), torch.zeros_like(layer.bias))
        self.param_stamp = None
        self._x = None
        self._owner = None

    busy = __import__("loka_torchrec.dispatch.layer_graph", fromlist=["x"])._CapturedStep.busy

    def forward(self, ctx, x2d):
        import weakref

        self._x = x2d.detach().clone()
        self.static_y.copy_(x2d @ self.layer.weight.detach().t() + self.layer.bias.detach())
        self._owner = weakref.ref(ctx)
        return self.static_y.detach()

    def backward(self, dy):
        dx, dw, db = self.static_grads
        dx.copy_(dy @ self.layer.weight.detach())
        dw.copy_(dy.t() @ self._x)
        db.copy_(dy.sum(0))
        self._owner = None
        return self.static_grads


class _CpuGraphs(LayerGraphs):
    @staticmethod
    def _capturable(x2d):
        return True

    def _new_step(self, layer, plan, x2d):
        step = _EagerStep(layer, x2d)
        from loka_torchrec.dispatch import layer_graph

        step.param_stamp = layer_graph._stamp(layer.weight, layer.bias)
        return step


def _cpu_twins():
    # The stand-in step computes in fp32, so the eager twin is the same layer in high precision.
    torch.manual_seed(0)
    eager = LokaLinear(16, 8)
    graphed = copy.deepcopy(eager)
    graphed.set_kernels(EMULATED)  # an FP8 plan: the only kind that is graphed
    graphed.cuda_graphs = True
    graphed._graphs = _CpuGraphs(capture_after=1)
    # A plain nn.Linear: the patched is_cuda below would route a LokaLinear through bf16 GEMMs.
    return eager.to_linear(), graphed


def test_replays_accumulate_gradients_and_never_hand_out_the_graph_buffer(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # take the graph path on the CPU
    eager, graphed = _cpu_twins()
    gen = torch.Generator().manual_seed(3)
    for step in range(4):  # no zero_grad: the sum of all steps
        x = torch.randn(6, 16, generator=gen)
        dy = torch.randn(6, 8, generator=gen)
        xe, xg = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        eager(xe).backward(dy)
        graphed(xg).backward(dy)
        torch.testing.assert_close(xg.grad, xe.grad)
    monkeypatch.undo()
    assert graphed.graphs.captures == 1 and graphed.graphs.replays == 4
    torch.testing.assert_close(graphed.weight.grad, eager.weight.grad)
    torch.testing.assert_close(graphed.bias.grad, eager.bias.grad)
    buffers = {t.data_ptr() for s in graphed.graphs._steps.values() for t in s.static_grads}
    assert graphed.weight.grad.data_ptr() not in buffers and graphed.bias.grad.data_ptr() not in buffers


def test_a_busy_step_sends_the_second_forward_to_the_eager_path(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    exact, graphed = _cpu_twins()
    fp8 = LokaLinear.from_linear(copy.deepcopy(exact), kernels=EMULATED)
    x1, x2 = torch.randn(6, 16), torch.randn(6, 16)
    graphed(x1).sum().backward()
    graphed.zero_grad()
    replays = graphed.graphs.replays
    yg = graphed(x1) * 2 + graphed(x2)  # the layer used twice before one backward
    assert graphed.graphs.replays == replays + 1  # x2 ran eagerly: x1's buffers were still in use
    yg.sum().backward()
    monkeypatch.undo()
    ye = exact(x1) * 2 + fp8(x2)  # what the replay (stand-in: exact) and the eager FP8 path compute
    ye.sum().backward()
    torch.testing.assert_close(yg, ye)
    # The eager call's grad-weight ran in bf16 (the patched is_cuda makes bf16 the high precision):
    # bounded by a few bf16 roundings of the inputs.
    want = exact.weight.grad + fp8.weight.grad
    torch.testing.assert_close(graphed.weight.grad, want, rtol=2**-6, atol=2**-6 * float(want.abs().max()))
    # A forward whose graph is dropped without a backward frees the step again.
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    graphed(x1)
    graphed(x1).sum().backward()
    monkeypatch.undo()
    assert graphed.graphs.replays == replays + 3


def test_replaced_parameters_are_captured_again(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    _, graphed = _cpu_twins()
    x = torch.randn(6, 16)
    for _ in range(3):
        graphed(x).sum().backward()
    graphed.weight = torch.nn.Parameter(graphed.weight.detach().clone())
    for _ in range(3):
        graphed(x).sum().backward()
    monkeypatch.undo()
    assert graphed.graphs.captures == 2 and graphed.graphs.replays == 6


def test_a_failed_capture_leaves_the_layer_eager(monkeypatch, caplog):
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    _, graphed = _cpu_twins()
    attempts = []

    def boom(layer, plan, x2d):
        attempts.append(tuple(x2d.shape))
        raise RuntimeError("operation not permitted when stream is capturing")

    graphed.graphs._new_step = boom
    for _ in range(3):
        y = graphed(torch.randn(6, 16))
        y.sum().backward()
    monkeypatch.undo()
    assert attempts == [(6, 16)]  # tried once, then eager for good
    assert graphed.graphs.failure.startswith("RuntimeError: operation not permitted")
    assert graphed.graphs.captures == 0 and graphed.graphs.replays == 0
    assert torch.isfinite(y).all() and graphed.weight.grad is not None
    assert "running eagerly" in caplog.text
    graphed.set_kernels(EMULATED)  # a new plan clears the failure: the next shape may be captured
    assert graphed.graphs.failure is None


def test_sightings_count_and_forget_the_oldest_keys():
    from loka_torchrec.dispatch.layer_graph import Sightings

    seen = Sightings(limit=2)
    assert [seen.add("a"), seen.add("a"), seen.add("b")] == [1, 2, 1]
    seen.add("c")  # three keys: "a", the least recently seen, is forgotten
    assert seen.add("a") == 1 and seen.add("c") == 2
    seen.clear()
    assert seen.add("c") == 1
