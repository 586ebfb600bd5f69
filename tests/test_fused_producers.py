"""A Mods block that feeds an FP8 GEMM, compiled: the producer hands the GEMM its FP8 operand.

``BlockNorm -> Hardswish -> LokaLinear`` (tensorwise FP8, the forward scaled by its amax history,
``forward_scaling="delayed"``) under ``torch.compile``: Inductor computes the norm, the activation
and the FP8 cast of the activation in one pass, because the cast's scale is known before the data
(with ``"current"`` scaling the cast waits for a reduction over the activation first). What the
forward keeps for the backward is the FP8 operand, never a high-precision copy of it. The fused
path computes what the unfused eager one does: the same output and weight gradient, bit for bit,
and the input and bias gradients within float32 rounding.
"""

from __future__ import annotations

import copy

import pytest
import torch
from functorch.compile import make_boxed_func
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend

from loka_torchrec.dispatch.layer_kernels import LayerKernels
from loka_torchrec.dispatch.linear import LokaLinear
from loka_torchrec.evidence import KernelChoice
from loka_torchrec.mods.block_norm import BlockNorm

TENSORWISE = LayerKernels.uniform(KernelChoice("scaled_mm", "tensorwise"))
ROWS, WIDTH, OUT = 16, 64, 48


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _block(scaling: str) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(BlockNorm(WIDTH, block_size=32), nn.Hardswish(), LokaLinear(WIDTH, OUT, kernels=TENSORWISE, forward_scaling=scaling))


def _forward_graph(scaling: str) -> torch.fx.Graph:
    """The forward graph of a training step as AOTAutograd hands it to Inductor (the second step's:
    the first seeds the amax history)."""
    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    def backward_as_is(gm, _inputs):
        return make_boxed_func(gm.forward)

    compiled = torch.compile(_block(scaling), backend=aot_autograd(fw_compiler=keep, bw_compiler=backward_as_is), fullgraph=True)
    for _ in range(2):
        compiled(torch.randn(ROWS, WIDTH, requires_grad=True)).sum().backward()
    return graphs[-1].graph


def _is_fp8_cast(node: torch.fx.Node) -> bool:
    if node.target == torch.ops.prims.convert_element_type.default:
        return node.args[1] == torch.float8_e4m3fn
    return node.target == torch.ops.aten._to_copy.default and node.kwargs.get("dtype") == torch.float8_e4m3fn


def _activation(graph: torch.fx.Graph) -> torch.fx.Node:
    (node,) = [n for n in graph.nodes if n.target == torch.ops.aten.hardswish.default]
    return node


def _depends_on(node: torch.fx.Node, pred) -> bool:
    seen, stack = set(), list(node.all_input_nodes)
    while stack:
        parent = stack.pop()
        if parent in seen:
            continue
        seen.add(parent)
        if pred(parent):
            return True
        stack += parent.all_input_nodes
    return False


@pytest.mark.parametrize("scaling, waits", [("delayed", False), ("current", True)])
def test_the_activations_fp8_cast_waits_for_no_reduction_of_it_under_delayed_scaling(scaling, waits):
    graph = _forward_graph(scaling)
    activation = _activation(graph)
    casts = [n for n in graph.nodes if _is_fp8_cast(n) and _depends_on(n, lambda p: p is activation)]
    assert casts, "no FP8 cast of the activation in the forward graph"

    def amax_of_activation(p):
        return p.target == torch.ops.aten.amax.default and _depends_on(p, lambda q: q is activation)

    assert any(_depends_on(cast, amax_of_activation) for cast in casts) is waits


def test_the_forward_keeps_the_fp8_operand_and_no_high_precision_copy_of_it():
    graph = _forward_graph("delayed")
    activation = _activation(graph)
    (output,) = [n for n in graph.nodes if n.op == "output"]
    saved = [n for n in output.args[0] if isinstance(n, torch.fx.Node)]
    fp8 = [n for n in saved if n.meta["val"].dtype == torch.float8_e4m3fn and tuple(n.meta["val"].shape) == (ROWS, WIDTH)]
    assert fp8 and all(_depends_on(n, lambda p: p is activation) for n in fp8)  # the GEMM's input, in FP8

    def high_precision_activation(n):
        follow = (torch.ops.aten.view.default, torch.ops.aten.clone.default, torch.ops.aten.detach.default)
        while n is not activation and n.target in follow:
            n = n.args[0]
        return n is activation

    assert not [n for n in saved if high_precision_activation(n)]


def test_the_fused_block_computes_what_the_unfused_eager_block_does():
    """Compiled (norm, activation and cast in one pass, scaled by the history) against eager (one
    operation at a time, scaled by the current amax): the same input three times, so the history's
    amax is the current one and the two scale alike."""
    fused = _block("delayed")
    unfused = copy.deepcopy(fused)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(fused, backend=counter, fullgraph=True)
    x = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(1))
    dy = torch.randn(ROWS, OUT, generator=torch.Generator().manual_seed(2))
    results = {}
    for name, run, model in (("fused", compiled, fused), ("unfused", unfused, unfused)):
        for _ in range(3):
            model.zero_grad()
            xi = x.clone().requires_grad_(True)
            y = run(xi)
            (y * dy).sum().backward()
        results[name] = (y.detach(), xi.grad, model[2].weight.grad, model[2].bias.grad)
    (y, dx, dw, db), (y_ref, dx_ref, dw_ref, db_ref) = results["fused"], results["unfused"]
    assert torch.equal(y, y_ref) and torch.equal(dw, dw_ref)  # the same FP8 operands, the same GEMMs
    # float32 rounding: of the norm's and the activation's backward (dx), of a sum over the rows (db)
    torch.testing.assert_close(dx, dx_ref, rtol=0, atol=dx_ref.abs().max().item() * WIDTH * 2.0**-24 * 8)
    torch.testing.assert_close(db, db_ref, rtol=0, atol=dy.abs().max().item() * ROWS * 2.0**-24 * 8)
    assert counter.frame_count == 2  # the seeding step, then the delayed graph; no recompile after
    assert int(fused[2].nonfinite_events) == 0
