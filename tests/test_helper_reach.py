"""GEMMs on a module's Parameters made in helper functions and child modules are Dispatch sites.

The models are HSTU layers written as production HSTU code is (``outside_models``): the fused
u|v|q|k projection is ``torch.addmm(bias, layer_norm(x), weight)`` in a free function handed
``self._uvqk_weight``, the output projection an ``addmm`` in a child module's forward handed the
parent's Parameter (``UserHstuLayer``), or both in another Python module, reached by keyword
through a project-level ``addmm`` wrapper (``KeywordHstuLayer``). What runs is counted, not only
what the plan says: the FP8 GEMM calls in the Inductor code of a compiled step, the multiply-adds of
each GEMM an eager step dispatches.
"""

import copy
import functools
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor.utils import run_and_get_code
from torch.utils._python_dispatch import TorchDispatchMode

import outside_models

import loka_torchrec
from loka_torchrec import LokaConfig
from loka_torchrec.dispatch import DispatchConfig
from loka_torchrec.dispatch.gemm_source import parameter_use
from loka_torchrec.fp8.error_metrics import sqnr_db
from loka_torchrec.probe import ProbeConfig

OUTPUT_DB = 18.0  # torchao's floor for an FP8 layer output
LAYERS = {"positional": outside_models.UserHstuLayer, "keyword": outside_models.KeywordHstuLayer}


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _hstu(layer: str) -> nn.Module:
    torch.manual_seed(0)
    return outside_models.UserHstu(layer=LAYERS[layer])


def _parameter_gemm_macs_per_row(model: nn.Module) -> int:
    """Multiply-adds per row of every GEMM on a 2-D Parameter (the projections and the head)."""
    return sum(p.shape[0] * p.shape[1] for n, p in model.named_parameters() if p.dim() == 2)


def _cpu_scaled_mm(recipe: str) -> bool:
    """Whether this torch's CPU ``_scaled_mm`` takes ``recipe``'s scales (rowwise: from torch 2.13)."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    scales = (torch.ones(16, 1), torch.ones(1, 16)) if recipe == "rowwise" else (torch.ones(()), torch.ones(()))
    try:
        torch._scaled_mm(a, a.t(), *scales, out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


def _forced(recipe: str) -> LokaConfig:
    return LokaConfig(enabled=True, dispatch=DispatchConfig(mode=f"all:scaled_mm:{recipe}"), probe=ProbeConfig(enabled=False))


def _train_step(model: nn.Module, x: torch.Tensor, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


# ------------------------------------------------------------------------------------- the source
def _add(x, w):
    return torch.addmm(torch.zeros(w.shape[1]), x, w)


class _Patterns(nn.Module):
    """One Parameter per way code hands a weight to a GEMM."""

    def __init__(self) -> None:
        super().__init__()
        self.by_method = nn.Parameter(torch.randn(8, 8))
        self.aliased = nn.Parameter(torch.randn(8, 8))
        self.looped = nn.ParameterList([nn.Parameter(torch.randn(8, 8)) for _ in range(2)])
        self.enumerated = nn.ParameterList([nn.Parameter(torch.randn(8, 8)) for _ in range(2)])
        self.transposed = nn.Parameter(torch.randn(8, 8))
        self.local_function = nn.Parameter(torch.randn(8, 8))
        self.partial = nn.Parameter(torch.randn(8, 8))
        self.table = nn.Parameter(torch.randn(8, 8))
        self.global_function = nn.Parameter(torch.randn(8, 8))
        self._matmul = functools.partial(torch.matmul)

    def _project(self, x, weight, *, scale=1.0):
        return F.linear(x, weight) * scale

    def forward(self, x, ids):
        x = self._project(x, weight=self.by_method)
        w = self.aliased
        x = x @ w
        for weight in self.looped:
            x = F.linear(x, weight)
        for _, weight in enumerate(self.enumerated):
            x = x @ weight
        x = x @ self.transposed.t()

        def local(weight):
            return x @ weight

        x = local(self.local_function) + self._matmul(x, self.partial)
        x = x + F.embedding(ids, self.table) + self.table[ids]
        return _add(x, self.global_function)


@pytest.mark.parametrize("attr, entry, expected", [
    ("by_method", False, ("linear", (), ())),
    ("aliased", False, ("matmul", (), ())),
    ("looped", True, ("linear", (), ())),
    ("enumerated", True, ("matmul", (), ())),
    ("transposed", False, (None, (), ("_Patterns: self.transposed.t()",))),
    ("local_function", False, (None, ("_Patterns: local(...) (not resolvable from the source)",), ())),
    ("partial", False, (None, ("_Patterns: self._matmul(...) (a partial, not a function)",), ())),
    ("table", False, (None, (), ())),
    ("global_function", False, ("matmul", (), ())),
])  # fmt: skip
def test_the_source_is_followed_into_the_code_the_parameter_is_passed_to(attr, entry, expected):
    use = parameter_use(_Patterns(), attr, entry=entry)
    assert (use.layout, use.unresolved, use.transformed) == expected


def test_the_docstring_examples_run():
    import doctest

    from loka_torchrec.dispatch import gemm_source

    assert doctest.testmod(gemm_source).failed == 0


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_hstu_helper_projections_are_read_from_the_source(layer):
    """Positional into a free function and a child module's forward; keyword into another module's
    function and on through its ``addmm`` wrapper: each ``(in, out)`` weight is a ``"matmul"`` site."""
    model = LAYERS[layer]()
    assert parameter_use(model, "_uvqk_weight").layouts == ("matmul",)
    assert parameter_use(model, "_output_weight").layouts == ("matmul",)
    assert not parameter_use(model, "_output_bias").reaches_code


# ------------------------------------------------------------------------------------- what runs
class _GemmMacs(TorchDispatchMode):
    """Multiply-adds of the 2-D GEMMs an eager step dispatches, FP8 (``_scaled_mm``) or not."""

    def __init__(self) -> None:
        super().__init__()
        self.fp8 = self.high_precision = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        aten = torch.ops.aten
        if packet in (aten.mm, aten.addmm, aten._scaled_mm):
            a, b = args[1:3] if packet is aten.addmm else args[:2]
            macs = a.shape[0] * a.shape[1] * b.shape[1]
            if packet is aten._scaled_mm:
                self.fp8 += macs
            else:
                self.high_precision += macs
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_forced_fp8_runs_every_parameter_gemm_in_fp8_eagerly(layer, tmp_path):
    model = _hstu(layer)
    loka = loka_torchrec.prepare(model, _forced("tensorwise"), run_dir=str(tmp_path), compile="none")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8, 32)
    for step in (1, 2):
        counted = _GemmMacs()
        with loka.step(step), counted:
            _train_step(model, x, optimizer)
    # every GEMM on a Parameter is FP8; the attention's are bmm (not 2-D GEMMs, not counted)
    rows = 32
    assert counted.high_precision == 0
    assert counted.fp8 >= 2 * rows * _parameter_gemm_macs_per_row(model)  # forward and grad-weight at least
    plan = loka.dispatcher.plan
    assert plan.never_ran == {} and plan.coverage["share"] == 1.0 and plan.fp8_gemm_count() == 15
    loka.close()


def _gemm_calls(codes):
    """``(FP8, high-precision)`` 2-D GEMM calls in Inductor's output code, Python or C++ wrapper."""
    joined = "\n".join(codes)
    fp8 = len(re.findall(r"(?:extern_kernels\.|aoti_torch_cpu_)_scaled_mm(?:_out)?\(", joined))
    high_precision = len(re.findall(r"(?:extern_kernels\.|aoti_torch_cpu_)(?:mm|addmm)(?:_out)?\(", joined))
    return fp8, high_precision


@pytest.mark.parametrize("layer, recipe", [("positional", "rowwise"), ("keyword", "rowwise"), ("keyword", "tensorwise")])
def test_forced_fp8_under_compile_runs_every_parameter_gemm_in_fp8(layer, recipe, tmp_path):
    """No step runs eagerly, so the orientation of each site comes from the source alone; the compiled
    code's 2-D GEMMs are all FP8 ``_scaled_mm`` calls (the attention's are bmm)."""
    if not _cpu_scaled_mm(recipe):
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm has no {recipe} scaling")
    model = _hstu(layer)
    before = copy.deepcopy(model.state_dict())
    loka = loka_torchrec.prepare(model, _forced(recipe), run_dir=str(tmp_path), compile="default")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8, 32)
    losses = []

    def steps():
        for step in (1, 2, 3):
            with loka.step(step):
                losses.append(_train_step(model, x, optimizer))

    _, codes = run_and_get_code(steps)
    assert all(site.last_rows == 0 for site in loka.dispatcher.managed_layers().values())  # none ran eagerly
    fp8_calls, high_precision_calls = _gemm_calls(codes)
    sites = 5  # two projections per layer and the head
    assert high_precision_calls == 0
    assert fp8_calls >= 2 * sites  # the forward and grad-weight GEMM of each site
    assert all(torch.isfinite(loss) for loss in losses) and losses[-1] < losses[0]
    changed = [n for n, p in model.state_dict().items() if not torch.equal(p, before[n])]
    assert {f"layers.{i}.{w}" for i in (0, 1) for w in ("_uvqk_weight", "_output_weight")} <= set(changed)
    assert loka.dispatcher.plan.coverage["managed_macs_per_row"] == _parameter_gemm_macs_per_row(model)
    loka.close()


def test_the_readme_loop_with_the_probe_plans_every_hstu_gemm(tmp_path):
    """``prepare(..., compile="default")`` with the Probe's cadence: the first steps run compiled, the
    probe steps eagerly; the plan manages every GEMM and none is left as never ran."""
    model = _hstu("keyword")
    config = LokaConfig.from_dict({
        "enabled": True, "probe": {"every": 5, "warmup_steps": 10},
        # a CPU is not faster in FP8: the speed gates off, so that the plan shows where FP8 can go
        "dispatch": {"min_speedup": 0.0, "layer_check_reps": 0, "grad_check": False},
    })  # fmt: skip
    loka = loka_torchrec.prepare(model, config, run_dir=str(tmp_path), compile="default", device="cpu")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(1, 13):
        with loka.step(step):
            _train_step(model, torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(step)), optimizer)
    loka.close()
    plan = loka.dispatcher.plan
    assert plan.step == 9 and plan.never_ran == {} and plan.coverage["ran_checked"] is True
    assert plan.coverage["share"] == 1.0 and plan.coverage["unreached"] == {}
    assert plan.coverage["total_macs_per_row"] == _parameter_gemm_macs_per_row(model)
    assert {f"layers.{i}.{w}" for i in (0, 1) for w in ("_uvqk_weight", "_output_weight")} <= set(plan.layers)


# ------------------------------------------------------------------------------------- numerics
def _loss_and_grads(model, x):
    model.zero_grad()
    y = model(x)
    y.square().mean().backward()
    return y, {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_rerouted_helper_gemms_match_float64(layer):
    torch.manual_seed(1)
    x = torch.randn(4, 8, 32)
    y_ref, g_ref = _loss_and_grads(_hstu(layer).double(), x.double())
    model = _hstu(layer)
    loka_torchrec.apply(model, DispatchConfig(mode="all:emulated:rowwise"))
    y, g = _loss_and_grads(model, x)
    assert all(site.last_rows == 32 for layer in model.layers for site in layer._loka_sites.values())
    assert OUTPUT_DB <= sqnr_db(y.double(), y_ref) < 60  # within FP8's floor, and FP8 ran
    for name in ("_uvqk_weight", "_output_weight"):
        grad = g[f"layers.1.{name}"]
        assert torch.isfinite(grad).all() and sqnr_db(grad.double(), g_ref[f"layers.1.{name}"]) < 60, name


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_a_bf16_plan_is_the_unconverted_model_exactly(layer, compiled):
    """High-precision sites run the same op on the same operands as the user's ``addmm``: bit for bit,
    eager and compiled."""
    x = torch.randn(4, 8, 32)
    plain = _hstu(layer)
    model = copy.deepcopy(plain)
    report = loka_torchrec.apply(model, DispatchConfig(mode="all-bf16"))
    assert {n for n, _, _ in report.converted} == {"layers.0._uvqk_weight", "layers.0._output_weight", "layers.1._uvqk_weight",
                                                   "layers.1._output_weight", "head"}  # fmt: skip
    if compiled:
        plain, model = torch.compile(plain, fullgraph=True), torch.compile(model, fullgraph=True)
    y_ref, g_ref = _loss_and_grads(plain, x)
    y, g = _loss_and_grads(model, x)
    assert torch.equal(y, y_ref)
    assert all(torch.equal(g[name], g_ref[name]) for name in g_ref)


# ------------------------------------------------------------------------------------- unreadable code
class _Opaque(nn.Module):
    """Parameters handed to callables whose code is not read (``functools.partial``): one multiplied
    (square, so its shape cannot tell the orientation), one only looked up."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 16) * 16**-0.5)
        self.bias = nn.Parameter(torch.zeros(16))
        self.table = nn.Parameter(torch.randn(10, 16))
        self._project = functools.partial(torch.addmm, beta=1.0)
        self._lookup = functools.partial(F.embedding, max_norm=None)

    def forward(self, x, ids):
        return self._project(self.bias, x, self.weight) + self._lookup(ids, self.table)


def test_a_parameter_passed_to_unread_code_is_a_site_oriented_by_its_first_call(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("opaque", _Opaque())
    ref = copy.deepcopy(model).double()
    report = loka_torchrec.apply(model, DispatchConfig(mode="all:emulated:rowwise"), run_dir=str(tmp_path))
    assert {n for n, _, _ in report.converted} == {"opaque.weight", "opaque.table"}
    site = model.opaque._loka_sites["weight"]
    assert site.layout == "linear"  # the default: nothing in the source says otherwise
    x, ids = torch.randn(6, 16), torch.tensor([1, 2, 3, 4, 5, 6])
    y = model.opaque(x, ids)
    assert site.layout == "matmul" and site.last_rows == 6  # addmm(b, x, W) multiplies W as (in, out)
    y_ref = ref.opaque(x.double(), ids)
    assert OUTPUT_DB <= sqnr_db(y.double(), y_ref) < 60
    y.sum().backward()
    report.dispatcher.on_step_end(1)
    plan = report.dispatcher.plan
    assert plan.never_ran == {"opaque.table": "not a GEMM operand: its Parameter is read by embedding"}
    assert plan.coverage["share"] == 1.0 and plan.fp8_gemm_count() == 3  # a lookup is not a GEMM left behind


def test_a_parameter_on_the_left_of_a_batched_operand_is_reached():
    """TorchRec's full-rank ``CrossNet`` multiplies ``torch.matmul(W_l, x_l.unsqueeze(2))``: the
    ``(N, N)`` Parameter on the left of a ``(B, N, 1)`` operand. It is a site: bf16 is the original
    model bit for bit, FP8 (rowwise, emulated) is within the format's error, and an eager step
    shows every site ran (coverage 1.0)."""
    from torchrec.modules.crossnet import CrossNet

    torch.manual_seed(0)
    reference = torch.nn.Sequential(CrossNet(64, 2), torch.nn.Linear(64, 1)).double()
    x = torch.randn(32, 64, dtype=torch.float64)
    expected = reference(x)
    for mode, low, high in (("all-bf16", 0.0, 0.0), ("all:emulated:rowwise", 1e-3, 0.1)):
        model = copy.deepcopy(reference)
        report = loka_torchrec.apply(model, DispatchConfig(mode=mode))
        assert {"0.kernels.0", "0.kernels.1"} <= {name for name, _, _ in report.converted}
        out = model(x)
        error = ((out - expected).norm() / expected.norm()).item()
        assert low <= error <= high, (mode, error)
        out.sum().backward()
        report.dispatcher.on_step_end(1)
        assert report.dispatcher.plan.coverage["share"] == 1.0 and report.dispatcher.never_ran == {}
