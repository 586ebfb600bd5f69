"""Parameter GEMM sites: raw-Parameter HSTU blocks, nn.TransformerEncoderLayer, never-ran sites, coverage.

Numerics: the converted model (emulated rowwise FP8, e4m3 operands) is compared with a float64
copy of the unconverted model by SQNR, with torchao's per-level floors for FP8 training (layer
output >= 18 dB, gradients >= 17 dB); high-precision sites must match the unconverted fp32
model to fp32 round-off.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import loka_torchrec
from loka_torchrec.dispatch import DispatchConfig
from loka_torchrec.dispatch.linear import LokaLinear
from loka_torchrec.dispatch.sites import ParameterSite
from loka_torchrec.fp8.error_metrics import sqnr_db
from loka_torchrec.probe import ProbeCallback, ProbeConfig

FP8 = "all:emulated:rowwise"
OUTPUT_DB, GRAD_DB = 18.0, 17.0  # torchao's floors for an FP8 layer output and gradients


class RawHstuBlock(nn.Module):
    """An HSTU block as users write it: its own Parameters, F.linear, @ and addmm, no nn.Linear."""

    def __init__(self, dim: int = 32, head: int = 16, max_len: int = 8) -> None:
        super().__init__()
        self.head = head
        self._uvqk_weight = nn.Parameter(torch.randn(4 * head, dim) * dim**-0.5)  # (out, in): F.linear
        self._output_weight = nn.Parameter(torch.randn(head, dim) * head**-0.5)  # (in, out): x @ W
        self._output_bias = nn.Parameter(torch.zeros(dim))
        self._gate_weight = nn.Parameter(torch.randn(dim, dim) * dim**-0.5)  # (in, out): addmm
        self._pos_emb = nn.Parameter(torch.randn(max_len, dim) * 0.1)  # indexed, not a GEMM operand
        self.max_len = max_len

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (batch, seq, dim) -> (batch, seq, dim)."""
        x = x + self._pos_emb[: x.shape[1]]
        normed = F.layer_norm(x, x.shape[-1:])
        u, v, q, k = F.linear(normed, self._uvqk_weight).split(self.head, dim=-1)
        attn = F.silu(q @ k.transpose(-1, -2)) / self.max_len
        y = F.silu(u) * F.layer_norm(attn @ v, (self.head,))
        out = x + y @ self._output_weight + self._output_bias
        gate = torch.addmm(self._output_bias, out.reshape(-1, out.shape[-1]), self._gate_weight)
        return out + torch.sigmoid(gate).reshape(out.shape)


def raw_hstu() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(RawHstuBlock(), RawHstuBlock(), nn.Linear(32, 1))


def encoder() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return nn.Sequential(layer, nn.Linear(32, 1))


def _loss_and_grads(model, x):
    model.zero_grad()
    y = model(x)
    y.square().mean().backward()
    return y, {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()}


def _compare_with_float64(make, x, grad_db=None):
    ref = make().double()
    y_ref, g_ref = _loss_and_grads(ref, x.double())
    model = make()
    report = loka_torchrec.apply(model, DispatchConfig(mode=FP8))
    y, g = _loss_and_grads(model, x)
    assert sqnr_db(y.double(), y_ref) >= OUTPUT_DB
    for name, grad in g_ref.items():
        assert torch.isfinite(g[name]).all(), name
        if grad_db is not None and grad.dim() == 2:  # the GEMM weights
            assert sqnr_db(g[name].double(), grad) >= grad_db, name
    return model, report


def test_raw_parameter_hstu_sites_cover_its_projections_and_match_float64():
    torch.manual_seed(1)
    # Gradients are finite here; with every GEMM in FP8 they are below the 17 dB floor, which the
    # gradient check restores (tests/test_grad_check.py).
    model, report = _compare_with_float64(raw_hstu, torch.randn(4, 8, 32))
    converted = {n: (i, o) for n, i, o in report.converted}
    assert converted["0._uvqk_weight"] == (32, 64) and converted["0._output_weight"] == (16, 32)
    assert converted["1._gate_weight"] == (32, 32) and "2" in converted
    assert "0._pos_emb" not in converted  # read by indexing, not multiplied
    assert isinstance(model[0]._loka_sites["_uvqk_weight"], ParameterSite)
    layers = report.dispatcher.managed_layers()
    assert layers["0._uvqk_weight"].last_rows == 32 and layers["1._gate_weight"].last_rows == 32
    report.dispatcher.on_step_end(1)
    plan = report.dispatcher.plan
    assert plan.never_ran == {} and plan.coverage["share"] >= 0.9
    assert plan.fp8_gemm_count() == 7 * 3
    assert "100.0% of the linear multiply-adds" in plan.summary()


@pytest.mark.parametrize("layout", ["linear", "matmul"])
def test_parameter_site_is_lokalinear_bitwise(layout):
    """A site runs exactly LokaLinear's three GEMMs: same output and gradients, bit for bit."""
    from loka_torchrec.dispatch.layer_kernels import LayerKernels
    from loka_torchrec.evidence import KernelChoice

    torch.manual_seed(0)
    kernels = LayerKernels.uniform(KernelChoice("emulated", "rowwise"))
    lin = LokaLinear(24, 40, bias=False, kernels=kernels)
    owner = nn.Module()
    owner.w = nn.Parameter(lin.weight.detach().clone() if layout == "linear" else lin.weight.detach().t().clone())
    site = ParameterSite(owner, "w", layout=layout, kernels=kernels)
    x = torch.randn(7, 24)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = lin(x1), site(x2)
    g = torch.randn_like(y1)
    y1.backward(g)
    y2.backward(g)
    assert torch.equal(y1, y2) and torch.equal(x1.grad, x2.grad)
    grad_w = owner.w.grad if layout == "linear" else owner.w.grad.t()
    assert torch.equal(lin.weight.grad, grad_w)


def test_a_sites_layout_is_an_enum_given_as_a_string():
    """``layout`` takes the config's strings and holds a :class:`SiteLayout`; its repr shows the string."""
    from loka_torchrec.dispatch.gemm_source import SiteLayout

    owner = nn.Module()
    owner.w = nn.Parameter(torch.randn(4, 8))
    site = ParameterSite(owner, "w", layout="matmul")
    assert site.layout is SiteLayout.MATMUL and "w, layout=matmul, in_features=4, out_features=8" in repr(site)
    assert ParameterSite(owner, "w", layout=SiteLayout.LINEAR).layout is SiteLayout.LINEAR
    with pytest.raises(ValueError, match="layout: expected 'linear' or 'matmul', got 'transposed'"):
        ParameterSite(owner, "w", layout="transposed")


def test_sites_keep_state_dict_keys_and_parameters():
    model = raw_hstu()
    keys, params = list(model.state_dict()), list(model.parameters())
    loka_torchrec.apply(model, DispatchConfig(mode=FP8))
    assert list(model.state_dict()) == keys and list(model.parameters()) == params
    fresh = raw_hstu()
    fresh.load_state_dict(model.state_dict())


def test_high_precision_sites_are_the_unconverted_model():
    x = torch.randn(3, 5, 32)
    ref = raw_hstu()
    model = copy.deepcopy(ref)
    loka_torchrec.apply(model, DispatchConfig(mode="all-bf16"))
    y_ref, g_ref = _loss_and_grads(ref, x)
    y, g = _loss_and_grads(model, x)
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-5, atol=1e-6)


def test_transformer_encoder_layer_runs_every_projection_in_fp8():
    torch.manual_seed(1)
    x = torch.randn(4, 6, 32)
    model, report = _compare_with_float64(encoder, x, grad_db=GRAD_DB - 2)
    names = {n for n, _, _ in report.converted}
    assert {"0.self_attn.in_proj_weight", "0.self_attn.out_proj", "0.linear1", "0.linear2", "1"} <= names
    layers = report.dispatcher.managed_layers()
    assert all(m.last_rows == 24 for n, m in layers.items() if n != "1"), {n: m.last_rows for n, m in layers.items()}
    report.dispatcher.on_step_end(1)
    assert report.dispatcher.plan.never_ran == {} and report.dispatcher.plan.coverage["share"] == 1.0
    # eval / no_grad: PyTorch's fast path would bypass every GEMM; the scope runs the sites instead
    model.eval()
    for layer in layers.values():
        layer.last_rows = 0
    with torch.no_grad():
        y = model(x)
    assert all(m.last_rows == 24 for n, m in layers.items() if n != "1")
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("kind", ["layer", "stack", "attention"])
def test_compiled_eval_takes_no_fused_fast_path(kind):
    """Compiled in eval/no_grad, TransformerEncoderLayer, TransformerEncoder's nested-tensor path
    (with a padding mask) and MultiheadAttention would bypass every site through PyTorch's fused fast
    paths: the compiled graph runs the sites, as eager does."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model = {
        "layer": layer,
        "stack": nn.TransformerEncoder(layer, 2, enable_nested_tensor=True, mask_check=False),
        "attention": nn.MultiheadAttention(32, 4, batch_first=True),
    }[kind]
    ref = copy.deepcopy(model).eval()
    loka_torchrec.apply(model, DispatchConfig(mode=FP8))
    model.eval()
    x = torch.randn(3, 6, 32)
    pad = torch.zeros(3, 6, dtype=torch.bool)
    pad[0, 4:] = True
    args, kwargs = ((x, x, x), {}) if kind == "attention" else ((x,), {"src_key_padding_mask": pad} if kind == "stack" else {})
    graphs = []

    def record(gm, inputs):
        graphs.append(gm)
        return gm.forward

    def out(m, *a, **k):
        y = m(*a, **k)
        return y[0] if kind == "attention" else y

    torch._dynamo.reset()
    with torch.no_grad():
        y_eager, y_ref = out(model, *args, **kwargs), out(ref, *args, **kwargs)
        y = out(torch.compile(model, fullgraph=True, backend=record), *args, **kwargs)
    targets = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    fused = ("_transformer_encoder_layer_fwd", "nested_tensor", "_native_multi_head_attention")
    assert not any(f in t for f in fused for t in targets), targets
    assert torch.equal(y, y_eager)
    kept = ~pad.unsqueeze(-1).expand_as(y) if kind == "stack" else torch.ones_like(y, dtype=torch.bool)
    db = sqnr_db(y[kept].double(), y_ref[kept].double())
    assert OUTPUT_DB <= db < 60, db  # FP8 ran (not fp32's round-off), within the FP8 floor


def test_multihead_attention_need_weights_and_masks_match_pytorch():
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(16, 2, batch_first=True)
    mha = copy.deepcopy(ref)
    loka_torchrec.apply(mha, DispatchConfig(mode="all-bf16"))
    x = torch.randn(3, 5, 16)
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[0, 3:] = True
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    for kwargs in ({}, {"key_padding_mask": pad}, {"attn_mask": causal, "need_weights": False}):
        out, w = mha(x, x, x, **kwargs)
        out_ref, w_ref = ref(x, x, x, **kwargs)
        torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-6)
        if w_ref is not None:
            torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)
    assert mha.out_proj.last_rows == 15


def test_cross_attention_and_unsupported_attention_are_reported():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 2, kdim=8, vdim=8)
    report = loka_torchrec.apply(mha, DispatchConfig(mode=FP8))
    skipped = dict(report.skipped)
    assert "separate q/k/v" in skipped["q_proj_weight"] and "out_proj" in skipped
    assert not isinstance(mha.out_proj, LokaLinear) and report.converted == []
    # cross-attention on a converted MultiheadAttention: high precision, reported as never ran
    model = nn.MultiheadAttention(16, 2)
    report = loka_torchrec.apply(model, DispatchConfig(mode=FP8))
    q, kv = torch.randn(4, 2, 16), torch.randn(6, 2, 16)
    model(q, kv, kv)[0].sum().backward()
    model.out_proj.last_rows = 1  # the step ran something eagerly
    report.dispatcher.on_step_end(1)
    plan = report.dispatcher.plan
    assert "cross-attention" in plan.never_ran["in_proj_weight"]
    assert plan.fp8_gemm_count() == 3 and plan.coverage["share"] < 0.5


class ReadsChildWeight(nn.Module):
    """Calls ``F.linear`` with its child's weight, never the child: the child's site never runs."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(F.linear(x, self.proj.weight, self.proj.bias))


def test_a_site_that_never_runs_is_reported_and_not_counted(tmp_path):
    model = ReadsChildWeight()
    report = loka_torchrec.apply(model, DispatchConfig(mode=FP8), run_dir=str(tmp_path))
    model(torch.randn(4, 16)).sum().backward()
    report.dispatcher.on_step_end(1)
    plan = report.dispatcher.plan
    assert list(plan.never_ran) == ["proj"] and plan.fp8_gemm_count() == 3
    assert "never ran" in plan.table() and "1 converted site(s) never ran: proj" in plan.summary()
    assert plan.coverage["share"] == pytest.approx(16 / (16 + 256), abs=1e-4)
    import json

    saved = json.loads((tmp_path / "dispatch_plan.json").read_text())
    assert "proj" in saved["never_ran"] and saved["coverage"]["ran_checked"] is True
    assert any(e["event"] == "never_ran" for e in report.dispatcher.events)


def test_a_site_that_never_runs_under_compile_is_found_at_the_first_compiled_step(tmp_path):
    """With the Probe off and every step compiled, no call is eager: the compiled calls' own trace
    (``ran_compiled``, set as each runs, no recompile) finds the site that never runs at step 1."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    model = ReadsChildWeight()
    report = loka_torchrec.apply(model, DispatchConfig(mode=FP8), run_dir=str(tmp_path))
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    for step in (1, 2, 3):
        compiled(torch.randn(4, 16)).sum().backward()
        report.dispatcher.on_step_end(step)
        if step == 1:
            assert list(report.dispatcher.plan.never_ran) == ["proj"]
    assert report.dispatcher.managed_layers()["head"].last_rows == 0  # it ran compiled only
    assert report.dispatcher.in_force().fp8_gemm_count() == 3
    assert counter.frame_count == 1  # the trace is a side effect, not a guard
    torch._dynamo.reset()


def test_sites_compile_fullgraph_without_graph_breaks():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    x = torch.randn(4, 8, 32)
    model = raw_hstu()
    loka_torchrec.apply(model, DispatchConfig(mode=FP8))
    y_eager, g_eager = _loss_and_grads(model, x)
    compiled = torch.compile(model, fullgraph=True, backend="inductor")
    for _ in range(2):
        y, g = _loss_and_grads(compiled, x)
    assert not counters["graph_break"]
    assert sqnr_db(y.double(), y_eager.double()) >= 40
    for name in g_eager:
        assert sqnr_db(g[name].double(), g_eager[name].double()) >= 30, name


def test_probe_learns_parameter_site_statistics(tmp_path):
    model = raw_hstu()
    report = loka_torchrec.apply(model, DispatchConfig(mode="all-bf16"))
    cfg = ProbeConfig(enabled=True, every=1, warmup_steps=4, every_after=1, monitor_budget=0.0, samples=2, speed_reps=1, max_rows_per_step=32)
    probe = ProbeCallback(model, cfg, run_dir=str(tmp_path), consumer=report.dispatcher)
    assert {"0._uvqk_weight", "1._output_weight", "1._gate_weight"} <= set(probe.layer_names)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(0, 3):
        opt.zero_grad()
        model(torch.randn(4, 8, 32)).square().mean().backward()
        opt.step()
        report.dispatcher.on_step_end(step)
        probe.on_step_end(step)
    assert probe.layer_state("0._uvqk_weight").rows > 0
    probe.close()


class _Unflattens(nn.Module):
    """User code in a scope calling ``Tensor.unflatten``, a method written in Python that ends in
    ``super().unflatten(...)``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(32, 32) * 32**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = (x @ self.weight).unflatten(-1, (4, 8))
        return heads.softmax(-1).flatten(-2)


def test_a_tensor_method_ending_in_super_compiles_inside_a_scope():
    """Dynamo refuses ``super()`` in ``Tensor.unflatten`` called as a plain function, which is how a
    torch-function mode receives it: the scope's mode calls it as a method again."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _Unflattens()
    loka_torchrec.apply(model, DispatchConfig(mode=FP8))
    x = torch.randn(6, 32)
    y_eager = model(x)
    y = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
    assert not counters["graph_break"] and model._loka_sites["weight"].last_rows == 6
    torch.testing.assert_close(y, y_eager, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("forward", ["bf16:hp", "emulated:rowwise"])
def test_compiled_bias_free_sites_get_the_eager_gradients(forward):
    """A bias-free site whose forward GEMM returns its result unconverted (the same dtype): torch
    2.11's Dynamo gave the inputs of an autograd.Function that returns a same-dtype ``.to()`` zero
    gradients. Forward in bf16 with FP8 gradients is what the gradient check leaves a site with."""
    from loka_torchrec.dispatch.layer_kernels import LayerKernels
    from loka_torchrec.evidence import KernelChoice

    torch._dynamo.reset()
    model = _Unflattens()
    loka_torchrec.apply(model, DispatchConfig(mode=FP8))
    fp8 = KernelChoice("emulated", "rowwise")
    model._loka_sites["weight"].set_kernels(LayerKernels(fwd=KernelChoice(*forward.split(":")), dgrad=fp8, wgrad=fp8))
    x = torch.randn(6, 32, requires_grad=True)
    grads = []
    for run in (model, torch.compile(model, fullgraph=True, backend="aot_eager")):
        model.zero_grad()
        x.grad = None
        run(x).square().sum().backward()
        grads.append((model.weight.grad.clone(), x.grad.clone()))
    (w_eager, x_eager), (w_compiled, x_compiled) = grads
    assert w_eager.abs().sum() > 0
    torch.testing.assert_close(w_compiled, w_eager, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x_compiled, x_eager, rtol=1e-5, atol=1e-6)


def test_a_never_ran_reason_found_by_a_compiled_step_is_refined_by_later_eager_calls():
    """A compiled first step decides which sites run but cannot say why one did not; the eager calls
    after it (the Probe's steps) see the call the scope could not route, and the next plan says so."""
    from loka_torchrec.dispatch.plan import DispatchPlan
    from loka_torchrec.dispatch.reach import NOT_CALLED, SiteReach

    owner = nn.Module()
    owner.used = nn.Parameter(torch.randn(8, 4))
    owner.unused = nn.Parameter(torch.randn(8, 4))
    layers = {"used": ParameterSite(owner, "used"), "unused": ParameterSite(owner, "unused")}
    reach = SiteReach(layers)
    assert reach.check_ran() is False  # no site ran yet: nothing decided
    layers["used"]._mark_ran_compiled()
    assert reach.check_ran() is True and reach.never_ran == {"unused": NOT_CALLED}
    plan = DispatchPlan(layers={}, mode="all-bf16")
    assert reach.annotated(plan).never_ran == {"unused": NOT_CALLED}
    layers["unused"].unreached_calls["multi_head_attention_forward"] = "cross-attention (query is not key and value)"
    refined = reach.annotated(plan)
    assert "cross-attention" in refined.never_ran["unused"] and refined.coverage["ran_checked"] is True
    assert reach.check_ran() is False  # decided once
