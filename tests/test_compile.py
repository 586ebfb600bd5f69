"""LoKA under ``torch.compile`` (CPU inductor): whole graphs, no recompiles, plans that survive any shape."""

import copy
import re

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import outside_models
import test_models_dhen
import test_models_dcn_v2
import test_models_hstu
import test_models_interformer

import loka_torchrec
from loka_torchrec.compile import compile_dense, cuda_graph_stats, eager, end_compiled_step, resolve_compile_mode
from loka_torchrec.dispatch import DispatchConfig
from loka_torchrec.gemm.backends import GemmBackend, get_backend, register_backend
from loka_torchrec.gemm.backends.base import BackendUnavailableError
from loka_torchrec.gemm.backends.operand_quantize import quantize_operand
from loka_torchrec.dispatch.dispatcher import resolve_candidates
from loka_torchrec.dispatch.layer_kernels import LayerKernels
from loka_torchrec.evidence import GemmRole, KernelChoice
from loka_torchrec.fp8 import Fp8Tensor

ROWWISE = KernelChoice("scaled_mm", "rowwise")


@register_backend
class _PickyBackend(GemmBackend):
    """A CPU stand-in for a CUDA FP8 GEMM: needs dims that are multiples of 16 (as ``torch._scaled_mm``
    on CUDA), fails outright at one shape (as FBGEMM's "cutlass cannot implement"), and does not trace."""

    name = "test_picky"
    recipes = ("rowwise",)
    devices = ("cpu",)
    in_auto = False
    refuse_n = 48  # every GEMM with N == 48 fails

    def alignment(self, device, recipe=None) -> int:
        return 16

    def quantize(self, t, spec, *, name="operand"):
        return quantize_operand(t, spec, name=name)

    def mm(self, a: Fp8Tensor, b: Fp8Tensor, recipe, out_dtype):
        (m, k), n = a.data.shape, b.data.shape[0]
        if k % 16 or n % 16:
            raise RuntimeError(f"Expected trailing dimension of mat1 to be divisible by 16 (got K={k}, N={n})")
        if n == self.refuse_n:
            raise RuntimeError("cutlass cannot implement")
        return (a.dequantize() @ b.dequantize().t()).to(out_dtype)


def _mlp(widths=(40, 28, 13, 8)):
    layers = []
    for fan_in, fan_out in zip(widths, widths[1:]):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _step(model, batch, seed):
    x = torch.randn(batch, 40, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    y = model(x)
    y.square().mean().backward()
    return x, y


def test_converted_model_compiles_whole_and_matches_eager():
    torch.manual_seed(0)
    model = _mlp()
    loka_torchrec.apply(model, DispatchConfig(mode="all:scaled_mm:rowwise"))
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, fullgraph=True)  # a graph break raises here
    x, y = _step(compiled, 24, seed=1)
    x_ref, y_ref = _step(reference, 24, seed=1)
    assert counters["graph_break"] == {}
    # Same scales and codes by construction (the same torch ops, fused by Inductor): equal up to
    # float32 rounding of the fused kernels, far inside FP8's own error.
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    # And both are FP8 results: close to float64, not equal to it.
    exact = nn.Sequential(*copy.deepcopy(list(model))).double()
    for layer in exact:
        if isinstance(layer, loka_torchrec.LokaLinear):
            layer.set_kernels(LayerKernels())
    err = (y.double() - exact(x.detach().double())).norm() / exact(x.detach().double()).norm()
    assert 1e-4 < err < 0.1


def test_a_one_output_layer_compiles_with_tensorwise_fp8():
    """A logit layer (``out_features=1``) in FP8: its grad-input GEMM has K = 1, where the weight's
    transpose is both row- and column-major; Inductor's ``_scaled_mm`` lowering checks the strides
    themselves, so the backend gives such operands the strides it expects."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 8), nn.ReLU(), nn.Linear(8, 1))
    loka_torchrec.apply(model, DispatchConfig(mode="all:scaled_mm:tensorwise"))
    reference = copy.deepcopy(model)
    x, y = _step(torch.compile(model, fullgraph=True), 24, seed=2)
    x_ref, y_ref = _step(reference, 24, seed=2)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(model[2].weight.grad, reference[2].weight.grad, rtol=1e-4, atol=1e-5)


def test_padding_and_varying_batches_compile_once(monkeypatch):
    """With a 16-alignment (as on CUDA) every dim is padded symbolically: batches of any size after
    the first reuse one dynamic graph, and the results stay exact up to FP8."""
    monkeypatch.setattr(type(get_backend("scaled_mm")), "alignment", lambda self, device, recipe=None: 16)
    model = _mlp()
    layers = loka_torchrec.apply(model, DispatchConfig(mode="all:scaled_mm:rowwise")).dispatcher.managed_layers()
    assert all(layer.plan.fwd.align == 16 for layer in layers.values())
    compiled = torch.compile(model, fullgraph=True)
    for batch in (24, 13, 21, 34, 55, 89, 7):
        _, y = _step(compiled, batch, seed=batch)
        assert y.shape == (batch, 8) and torch.isfinite(y).all()
    # The first batch compiles static shapes, the second marks the batch dim dynamic: then nothing.
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert counters["graph_break"] == {}


def test_a_new_plan_recompiles_once_and_runs_the_new_kernels():
    model = _mlp()
    layers = loka_torchrec.apply(model, DispatchConfig(mode="all-bf16")).dispatcher.managed_layers()
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    _, y_bf16 = _step(compiled, 16, seed=3)
    for layer in layers.values():
        layer.set_kernels(LayerKernels.uniform(ROWWISE))
    _, y_fp8 = _step(compiled, 16, seed=3)
    _step(compiled, 16, seed=4)
    assert counters["stats"]["unique_graphs"] == 2  # one per plan, none per step
    assert not torch.equal(y_bf16, y_fp8)  # the FP8 kernels really run after the re-plan


def test_a_dozen_kernel_sets_each_compile_and_none_runs_eagerly():
    """Plan trials, safety-valve holds and readmissions each leave another set of kernels, each a graph
    of its own: past Dynamo's default limit of 8 the module would run eagerly (``fullgraph`` makes that
    an error here). Every set compiles, and a set seen before runs its graph again."""
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(recompile_limit=8):  # Dynamo's default: compile_dense raises it
        model = nn.ModuleDict({"over_arch": _mlp((16, 16, 16, 16, 16, 16, 8))})
        layers = loka_torchrec.apply(model, DispatchConfig(mode="all-bf16")).dispatcher.managed_layers()
        compile_dense(model, "default", fullgraph=True)
        names = sorted(layers)
        x = torch.randn(16, 16)
        outputs = {}
        sets = [names[:k] for k in range(len(names) + 1)] + [names[k:] for k in range(1, len(names))]
        for fp8 in [*sets, sets[2], sets[0]]:
            for name, layer in layers.items():
                layer.set_kernels(LayerKernels.uniform(ROWWISE) if name in fp8 else LayerKernels())
            with torch.no_grad():
                y = model["over_arch"](x)
            if tuple(fp8) in outputs:
                torch.testing.assert_close(y, outputs[tuple(fp8)], rtol=0, atol=0)  # its own graph again
            outputs[tuple(fp8)] = y
        assert len(sets) > 8 and counters["stats"]["unique_graphs"] == len(sets)
    torch._dynamo.reset()


def test_compiled_call_gives_each_module_its_own_recompile_limit():
    """Every nn.Linear shares nn.Linear.forward, so torch.compile of one Linear after another counts
    against one limit; compiled_call (the serving timer's) compiles each on a code object of its own."""
    from loka_torchrec.compile import compiled_call

    torch._dynamo.reset()
    layers = [nn.Linear(k, 4) for k in (8, 16, 24)]
    with torch._dynamo.config.patch(recompile_limit=1):
        for layer in layers:
            x = torch.randn(3, layer.in_features)
            torch.testing.assert_close(compiled_call(layer, dynamic=False, fullgraph=True)(x), layer(x))
        torch._dynamo.reset()
        torch.compile(layers[0], dynamic=False, fullgraph=True)(torch.randn(3, 8))
        with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):  # the same code object: the limit reached
            torch.compile(layers[1], dynamic=False, fullgraph=True)(torch.randn(3, 16))
    torch._dynamo.reset()


def test_nonfinite_operands_are_counted_inside_the_graph():
    layer = loka_torchrec.LokaLinear(16, 8, kernels=LayerKernels.uniform(ROWWISE))
    compiled = torch.compile(layer, fullgraph=True)
    x = torch.randn(4, 16)
    x[2, 3] = float("inf")
    y = compiled(x.requires_grad_(True))
    assert torch.isnan(y[2]).all() and torch.isfinite(y[[0, 1, 3]]).all()
    # Counted in the compiled forward: x's row 2 (forward A) and x's column 3 (grad-weight's B, x^T).
    assert int(layer.nonfinite_events) == 2


def test_policy_planning_survives_unaligned_and_unsupported_shapes():
    """Layers of 13 and 28 features (not multiples of 16) and one GEMM the backend refuses: the plan
    is made, the failing candidate is excluded with its reason, and training goes on."""
    model = _mlp((40, 28, 13, 48, 8))
    config = DispatchConfig(
        mode="policy", candidates=("test_picky:rowwise", "scaled_mm:rowwise"), evidence="random", plan_at_step=1,
        min_speedup=0.0, samples=2, timing_reps=1, layer_check_reps=0,
    )  # fmt: skip
    dispatcher = loka_torchrec.apply(model, config).dispatcher
    _step(model, 20, seed=0)
    dispatcher.on_step_end(1)
    plan = dispatcher.plan
    assert plan.step == 1
    # The 13 -> 48 layer's forward GEMM has N = 48: test_picky fails there and is excluded with the reason.
    decision = plan.layers["4"].roles[GemmRole.FORWARD]
    notes = {str(e.candidate): e.note for e in decision.considered}
    assert notes["test_picky:rowwise"].startswith("excluded: RuntimeError: cutlass cannot implement")
    assert decision.choice == ROWWISE  # the other candidate still runs
    # Unaligned dims are padded, not excluded: test_picky ran (and was measured) on 28- and 13-wide layers.
    considered = {str(e.candidate): e for e in plan.layers["2"].roles[GemmRole.FORWARD].considered}
    assert considered["test_picky:rowwise"].note == "" and considered["test_picky:rowwise"].error.value < 0.2
    _step(model, 20, seed=1)  # and training goes on with the plan
    assert dispatcher.seconds["decide"] >= 0.0


def test_compiled_layers_offer_only_kernels_that_trace():
    compiled = DispatchConfig(compiled=True, candidates=("auto",))
    offered = resolve_candidates(compiled, torch.device("cpu"))
    assert offered and all(get_backend(c.backend).compile_reason(c.recipe) is None for c in offered)
    named = DispatchConfig(compiled=True, candidates=("test_picky:rowwise",))
    with pytest.raises(BackendUnavailableError, match="test_picky:rowwise does not trace under torch.compile"):
        resolve_candidates(named, torch.device("cpu"))
    lenient = DispatchConfig(compiled=True, candidates=("test_picky:rowwise",), fallback="bf16")
    assert resolve_candidates(lenient, torch.device("cpu")) == []


def test_compile_dense_compiles_in_place_and_eager_bypasses_it():
    model = nn.ModuleDict({"over_arch": _mlp(), "tables": nn.EmbeddingBag(10, 4)})
    keys = set(model.state_dict())
    assert compile_dense(model, "default") == ["over_arch"]
    assert set(model.state_dict()) == keys  # nothing renamed, nothing wrapped
    x = torch.randn(8, 40)
    with eager():
        model["over_arch"](x)
    assert counters["stats"].get("unique_graphs", 0) == 0
    model["over_arch"](x)
    assert counters["stats"]["unique_graphs"] == 1


def test_compile_settings_are_checked():
    assert resolve_compile_mode("auto", "cpu") is None and resolve_compile_mode("auto", "cuda") == "reduce-overhead"
    assert resolve_compile_mode("none", "cuda") is None
    with pytest.raises(ValueError, match="train.compile: expected one of"):
        resolve_compile_mode("fast", "cpu")
    with pytest.raises(ValueError, match="compile_dense: mode must be one of"):
        compile_dense(_mlp(), "auto")
    with pytest.raises(ValueError, match="compile_dense: modules: no submodule 'nope'"):
        compile_dense(_mlp(), "default", modules=["nope"])


def test_cuda_graph_stats_are_none_without_cuda_graphs():
    assert cuda_graph_stats("cpu") is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_stats_show_a_steady_loop_replaying():
    model = nn.ModuleDict({"mlp": _mlp()}).cuda()
    compile_dense(model, "reduce-overhead")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        model["mlp"](torch.randn(32, 40, device="cuda")).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()  # the gradients are the backward graph's outputs: dropped, not zeroed in place
        end_compiled_step()

    for _ in range(4):
        step()
    before = cuda_graph_stats("cuda")
    for _ in range(5):
        step()
    after = cuda_graph_stats("cuda")
    assert before["graphs"] >= 2 and before["functions"] >= 2  # a forward and a backward graph
    assert after == before  # replays only: nothing recorded, re-recorded or skipped


@pytest.mark.parametrize("mode, marks", [("reduce-overhead", 2), ("default", 0), ("none", 0)])
def test_step_end_ends_the_step_for_cuda_graphs(mode, marks, monkeypatch, tmp_path):
    """Under CUDA graphs every step's end is marked (else Inductor may keep each step's graph memory)."""
    calls = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: calls.append(1))
    model = nn.ModuleDict({"over_arch": _mlp(), "tables": nn.EmbeddingBag(10, 4)})
    config = loka_torchrec.LokaConfig.from_dict({"enabled": True, "probe": {"enabled": False}})
    loka = loka_torchrec.prepare(model, config, run_dir=str(tmp_path), compile=mode, device="cpu")
    assert loka.cuda_graphs == (mode == "reduce-overhead")
    # What the job prints says how the compiled layers scale their FP8 forward operands.
    assert ("torch.compile: over_arch; FP8 forward operands: delayed scaling" in str(loka)) == (mode != "none")
    loka.step_end(1)
    loka.step_end(2)
    assert len(calls) == marks


def test_a_plan_without_fp8_drops_the_recorded_dense_inputs(tmp_path):
    """Compiled, with the Probe: after a plan that keeps every GEMM in bf16, the dense inputs recorded
    for the gradient check are dropped (nothing to check; later compiled steps record nothing)."""
    model = nn.ModuleDict({"over_arch": _mlp((40, 32, 16)), "tables": nn.EmbeddingBag(10, 4)})
    config = loka_torchrec.LokaConfig.from_dict({
        "enabled": True, "probe": {"warmup_steps": 1, "every": 1},
        "dispatch": {"candidates": ["scaled_mm:tensorwise"], "min_speedup": 1000.0, "layer_check_reps": 0},
    })  # fmt: skip
    loka = loka_torchrec.prepare(model, config, run_dir=str(tmp_path), compile="default", device="cpu")
    for step in (1, 2, 3):
        with loka.step(step):
            model["over_arch"](torch.randn(16, 40)).square().mean().backward()
        if step == 1:  # the planning step ran eagerly and recorded its inputs; the plan dropped them
            assert loka.dispatcher.plan.step == 1 and loka.dispatcher.plan.fp8_gemm_count() == 0
            assert loka.dense_inputs is not None and not loka.dense_inputs.recorded
    loka.close()
    assert not loka.dense_inputs.recorded


def _inductor_code(fn) -> list:
    """The Inductor output code ``fn()`` compiles (forward and backward graphs), with the names that
    differ from compile to compile (graph ids, cache paths) taken out, in a stable order."""
    _, codes = run_and_get_code(fn)
    scrub = [(r"AOT ID: \[.*?\]", "AOT ID"), (r"# kernel path: .*", ""), (r"/tmp/\S+", "PATH")]
    out = []
    for code in codes:
        for pattern, repl in scrub:
            code = re.sub(pattern, repl, code)
        out.append(code)
    return sorted(out)


def _small_recsys(kind: str):
    """A CPU-sized model of the zoo with a batch for it: the project's DHEN, HSTU, Wukong, Interformer
    and DCN-V2 (the model tests' helpers), and a Wukong written as outside users write it (``outside_models``)."""
    if kind == "dhen":
        return test_models_dhen._model(), test_models_dhen._batch(test_models_dhen._spec(), batch=32)
    if kind == "wukong":
        from loka_job.models.wukong import WukongConfig, build_wukong

        spec = test_models_dhen._spec(dim=16)
        torch.manual_seed(0)
        return build_wukong(WukongConfig.small(), spec, torch.device("cpu"), embedding_device=torch.device("cpu")), (
            test_models_dhen._batch(spec, batch=32))  # fmt: skip
    if kind == "interformer":
        spec = test_models_interformer._spec()
        return test_models_interformer._model(spec=spec), test_models_interformer._batch(spec, batch=32)
    if kind.startswith("dcnv2"):  # low-rank cross layers: Parameter sites (full-rank CrossNet's are not sites)
        from loka_job.models.dcn_v2 import DcnV2Config

        spec = test_models_dhen._spec(dim=16)
        config = DcnV2Config(cross="low_rank", cross_layers=2 if kind == "dcnv2_two_cross_layers" else 1)
        return test_models_dcn_v2._model(config, spec), test_models_dhen._batch(spec, batch=32)
    if kind == "outside_wukong":
        torch.manual_seed(0)
        model = outside_models.UserWukong()
        return model, model.batch(32)
    kjt = test_models_hstu._kjt([[1, 2, 3], [4, 5, 6, 7, 8, 9], [10], [], [11, 12, 13, 14, 15], [16, 17]], [20, 21, 22, 23, 24, 25])
    return test_models_hstu._model(), (torch.randn(6, 3), kjt)


@pytest.mark.parametrize(
    "kind",
    ["dhen", "hstu", "wukong", "interformer", "dcnv2", "outside_wukong",
     pytest.param("dcnv2_two_cross_layers", marks=pytest.mark.xfail(strict=True, reason=(
         "the same kernels and calls, but the converted model's graph takes the second cross layer's "
         "Parameters as inputs in another order (W_kernels.1 before bias.0)")))],
)  # fmt: skip
def test_a_plan_without_fp8_compiles_to_the_plain_models_code(kind, tmp_path):
    """Where LoKA's plan keeps every GEMM in bf16, its compiled step is the plain model's: the same
    Inductor kernels and calls, forward and backward, after the Probe's eager steps and the plan."""
    plain, batch = _small_recsys(kind)
    converted = copy.deepcopy(plain)

    def step(model):
        def run():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(*batch)
            logits.float().square().mean().backward()
        return run

    compile_dense(plain, "default")
    expected = _inductor_code(step(plain))
    torch._dynamo.reset()
    config = loka_torchrec.LokaConfig.from_dict({
        "enabled": True, "probe": {"warmup_steps": 1, "every": 1},
        "dispatch": {"candidates": ["scaled_mm:tensorwise"], "min_speedup": 1000.0, "layer_check_reps": 0},
    })  # fmt: skip
    loka = loka_torchrec.prepare(converted, config, run_dir=str(tmp_path), compile="default", device="cpu")
    with loka.step(1):  # the Probe's step, eager; the plan is made at its end
        step(converted)()
    assert loka.dispatcher.plan.step == 1 and loka.dispatcher.plan.fp8_gemm_count() == 0
    assert len(loka.dispatcher.plan.layers) > 5
    with loka.step(2):
        got = _inductor_code(step(converted))
    loka.close()
    assert len(got) == len(expected) >= 2
    assert got == expected


@pytest.mark.parametrize(
    "kind, recipe",
    [(kind, "tensorwise") for kind in ("dhen", "hstu", "wukong", "interformer", "dcnv2", "outside_wukong")]
    + [("outside_wukong", "rowwise")],
)  # fmt: skip
def test_every_forced_fp8_mode_compiles_whole_on_every_zoo_model(kind, recipe, tmp_path, monkeypatch):
    """A forced ``all:scaled_mm:<recipe>`` plan on each zoo model, through ``prepare(compile="default")``
    and ``loka.step``: Dynamo and AOTAutograd take both steps whole (no graph break; the autograd
    functions traced; the second step recompiles once, with the delayed scales the first recorded),
    its GEMMs run in FP8 and the gradients are finite. Tensorwise on every model (its transposed
    operands and delayed scales are where tracing failed before), rowwise on the outside Wukong.
    Inductor's code generation is left out (``aot_eager``: minutes saved on a CPU; other tests here
    run Inductor on these models). The backends this machine lacks are refused up front
    (``test_apply_dispatch``)."""
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: real_compile(
        fn, backend="aot_eager", fullgraph=kwargs.get("fullgraph", False), dynamic=kwargs.get("dynamic")))  # fmt: skip
    model, batch = _small_recsys(kind)
    config = loka_torchrec.LokaConfig.from_dict(
        {"enabled": True, "probe": {"enabled": False}, "dispatch": {"mode": f"all:scaled_mm:{recipe}"}}
    )
    loka = loka_torchrec.prepare(model, config, run_dir=str(tmp_path), compile="default", device="cpu")
    counters.clear()
    for step in (1, 2):
        with loka.step(step):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(*batch)
            logits.float().square().mean().backward()
    loka.close()
    assert loka.compiled_modules and counters["stats"]["unique_graphs"] >= 1
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert loka.dispatcher.in_force().fp8_gemm_count() > 0
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("kind", ["interformer", "outside_wukong"])
def test_delayed_gradient_scaling_compiles_whole_on_zoo_models_and_records_every_fp8_site(kind, tmp_path, monkeypatch):
    """``dispatch.grad_scaling=delayed`` on zoo models (attention Parameters, an outside model's raw-Parameter
    GEMMs), forced tensorwise, through ``prepare(compile="default")`` and ``loka.step``: no graph break,
    every FP8 site whose forward ran recorded its ``dy`` amax in both steps (the buffer written in
    the compiled backward reaches the module), and the gradients are finite."""
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: real_compile(
        fn, backend="aot_eager", fullgraph=kwargs.get("fullgraph", False), dynamic=kwargs.get("dynamic")))  # fmt: skip
    model, batch = _small_recsys(kind)
    config = loka_torchrec.LokaConfig.from_dict(
        {"enabled": True, "probe": {"enabled": False}, "dispatch": {"mode": "all:scaled_mm:tensorwise", "grad_scaling": "delayed"}}
    )
    loka = loka_torchrec.prepare(model, config, run_dir=str(tmp_path), compile="default", device="cpu")
    counters.clear()
    for step in (1, 2):  # the seeding step, then the delayed graph
        with loka.step(step):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(*batch)
            logits.float().square().mean().backward()
    loka.close()
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    # The FP8 sites whose forward ran (it recorded its input's amax): a cross-attention's projections,
    # whose GEMMs run in high precision, did not.
    sites = [s for s in loka.dispatcher.managed_layers().values()
             if float(s._amax_history.abs().sum()) > 0 and not s.kernels.for_role(GemmRole.GRAD_INPUT).is_high_precision]  # fmt: skip
    assert len(sites) > 5 and loka.dispatcher.grad_scaling == "delayed"
    for site in sites:
        events = site.grad_scaling_events()
        assert events["calls"] == 2 and events["nonfinite"] == 0, (site, events)
        assert float(site._grad_amax_history[0]) > 0
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
