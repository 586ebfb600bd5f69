"""CUDA graphs of whole dense modules (``dispatch.dense_graphs``): replays equal eager steps.

CPU tests check the choice of modules, the switch, the eager paths and the bookkeeping (nothing
is captured off CUDA). GPU tests (run on the device) train a graphed model and an eager twin side
by side and compare outputs, gradients and parameters, bf16 and FP8, with and without autocast,
with a TorchRec ``KeyedTensor`` argument, across a dispatch plan change.
"""

import copy

import pytest
import torch
from torch import nn

import loka_torchrec
from loka_torchrec.dispatch import DispatchConfig, LayerKernels
from loka_torchrec.dispatch.convert import convert_linears
from loka_torchrec.dispatch.module_graph import ModuleGraphs, default_dense_modules, graph_dense_modules
from loka_torchrec.evidence import KernelChoice

ROWWISE = LayerKernels(
    fwd=KernelChoice("scaled_mm", "rowwise"),
    dgrad=KernelChoice("scaled_mm", "rowwise"),
    wgrad=KernelChoice("scaled_mm", "rowwise"),
)


class Tower(nn.Module):
    """A dense tower over a dense input and (optionally) a TorchRec KeyedTensor of pooled features."""

    def __init__(self, dense_in=16, pooled=0, width=64, device=None):
        super().__init__()
        self.pooled = pooled
        self.mlp = nn.Sequential(
            nn.Linear(dense_in + pooled, width, device=device), nn.SiLU(), nn.LayerNorm(width, device=device),
            nn.Linear(width, width, device=device), nn.SiLU(), nn.Linear(width, 1, device=device),
        )

    def forward(self, dense, kt=None):
        x = dense if kt is None else torch.cat([dense, kt.values()], dim=1)
        return self.mlp(x).squeeze(-1)


class Model(nn.Module):
    def __init__(self, pooled=0, device=None):
        super().__init__()
        self.embedding_bag = nn.EmbeddingBag(10, 4, device=device)  # holds tables: never graphed
        self.over_arch = Tower(pooled=pooled, device=device)
        self.scale = nn.Identity()  # no parameters: never graphed


# ------------------------------------------------------------------------------------------ CPU
def test_default_choice_is_the_children_with_parameters_and_no_tables():
    assert default_dense_modules(Model()) == ["over_arch"]


def test_default_choice_on_the_project_models():
    from loka_torchrec.models import build_model
    from loka_torchrec.training.synthetic import SyntheticConfig, make_data_spec

    spec = make_data_spec(SyntheticConfig(num_tables=3, num_embeddings=50, embedding_dim=32))
    assert default_dense_modules(build_model("dhen", {}, spec, torch.device("cpu"))) == ["over_arch"]
    dlrm_sizes = {"dense_arch_layer_sizes": [16, 32], "over_arch_layer_sizes": [16, 1]}
    dlrm = default_dense_modules(build_model("dlrm", dlrm_sizes, spec, torch.device("cpu")))
    assert dlrm == ["model.dense_arch", "model.over_arch"]  # inter_arch has no parameters


def test_cpu_calls_run_the_module_itself_and_count():
    torch.manual_seed(0)
    model = Model()
    twin = copy.deepcopy(model)
    graphs = graph_dense_modules(model)
    assert list(graphs) == ["over_arch"] and isinstance(model.over_arch.forward, ModuleGraphs)
    for _ in range(4):
        x = torch.randn(8, 16)
        y, y_twin = model.over_arch(x), twin.over_arch(x)
        torch.testing.assert_close(y, y_twin, rtol=0, atol=0)
        y.sum().backward()
        y_twin.sum().backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    g = graphs["over_arch"]
    assert g.captures == 0 and g.replays == 0 and g.eager_calls == 4 and g.failure is None
    assert g.summary() == {
        "module": "over_arch", "captures": 0, "replays": 0, "eager_calls": 4,
        "eager_reasons": {"not CUDA tensors": 4}, "failure": None, "gave_up": None,
    }
    g.remove()
    assert "forward" not in model.over_arch.__dict__


def test_a_module_whose_input_shapes_never_repeat_stops_forming_keys(monkeypatch):
    # Jagged inputs (HSTU's attention blocks): a new shape every call never captures; after
    # give_up_after distinct shapes the module runs eagerly without keys or hook scans.
    import loka_torchrec.dispatch.module_graph as mg

    monkeypatch.setattr(mg, "_capturable", lambda tensors: True)  # the bookkeeping of a GPU run, on the CPU
    torch.manual_seed(0)
    model = Model()
    twin = copy.deepcopy(model)
    g = graph_dense_modules(model, capture_after=2, give_up_after=5)["over_arch"]
    for rows in range(1, 10):
        x = torch.randn(rows, 16)
        torch.testing.assert_close(model.over_arch(x), twin.over_arch(x), rtol=0, atol=0)
    assert g.captures == 0 and g.gave_up == "5 distinct input shapes and none seen 2 times"
    assert g.eager_reasons == {"warming up": 5, "input shapes never repeat": 4}
    assert g.summary()["gave_up"] == g.gave_up


def test_a_repeated_shape_is_tried_not_given_up(monkeypatch):
    import loka_torchrec.dispatch.module_graph as mg

    monkeypatch.setattr(mg, "_capturable", lambda tensors: True)
    monkeypatch.setattr(ModuleGraphs, "_capture", lambda self, *a: None)  # a capture that fails
    g = graph_dense_modules(Model(), capture_after=2, give_up_after=3)["over_arch"]
    g.module(torch.randn(4, 16))  # one shape, then a second sighting: the capture is attempted
    g.module(torch.randn(4, 16))
    assert g.gave_up is None and g.eager_reasons["capture failed"] == 1


def test_state_dict_is_unchanged_by_the_wrapper():
    model = Model()
    keys = set(model.state_dict())
    graph_dense_modules(model)
    assert set(model.state_dict()) == keys


def test_bad_names_and_double_wrapping_are_refused():
    model = Model()
    with pytest.raises(ValueError, match="dispatch.dense_graph_modules: no submodule 'nope'"):
        graph_dense_modules(model, ["nope"])
    graph_dense_modules(model, ["over_arch"])
    with pytest.raises(ValueError, match="already has CUDA graphs"):
        graph_dense_modules(model, ["over_arch"])
    with pytest.raises(ValueError, match="capture_after"):
        ModuleGraphs(Tower(), capture_after=0)


def test_config_validates_the_switches():
    with pytest.raises(ValueError, match="dispatch.dense_graphs"):
        DispatchConfig(dense_graphs="yes")
    with pytest.raises(ValueError, match="dispatch.dense_graph_modules"):
        DispatchConfig(dense_graph_modules=["", "x"])
    assert DispatchConfig(dense_graph_modules=["a.b"]).dense_graph_modules == ("a.b",)


def test_apply_installs_dense_graphs_and_reports_them():
    model = Model()
    report = loka_torchrec.apply(model, DispatchConfig(mode="all-bf16", dense_graphs=True))
    assert list(report.dense_graphs) == ["over_arch"] and "dense CUDA graphs" in str(report)
    assert report.dispatcher.times_in_graphs is True
    plain = loka_torchrec.apply(Model(), DispatchConfig(mode="all-bf16"))
    assert plain.dense_graphs == {} and plain.dispatcher.times_in_graphs is False


_FAKE_CAPTURE_JOB = r"""
import os, sys, json, torch
import loka_torchrec.dispatch.module_graph as mg

class FakeCall:  # stands in for a captured call: replays by running the module's own forward
    def __init__(self, owner, leaves, spec, autocast_state, warmup):
        self.owner, self.spec = owner, spec
        self.params = [p for p in owner.module.parameters() if p.requires_grad]
        self.param_stamp = tuple(p.data_ptr() for p in self.params)
        self.tensor_slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        self.out_spec = mg.pytree.tree_flatten(torch.zeros(1))[1]
    def busy(self):
        return False

class FakeReplay:
    @staticmethod
    def apply(call, *tensors):
        args = mg.pytree.tree_unflatten(list(tensors[: len(call.tensor_slots)]), call.spec)
        with call.owner.bypass():
            return (call.owner.module(*args),)

mg._capturable, mg._CapturedCall, mg._ModuleReplay = (lambda tensors: True), FakeCall, FakeReplay
os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
from loka_torchrec.train import run
cfg = {"device": "cpu", "seed": 0, "model": {"name": "dhen", "embedding_dim": 32},
       "data": {"kind": "pooled", "num_tables": 3, "num_embeddings": 100, "embedding_dim": 32, "batch_size": 64,
                "eval_batches": 2},
       "train": {"steps": 8, "progress_bar": False, "log_every": 4, "autocast": "bf16"},
       "loka": {"enabled": True, "dispatch": {"mode": "all-bf16", "dense_graphs": True}, "mods": {"preset": "all"}}}
summary = run(cfg, sys.argv[1])
print("DENSE", json.dumps(summary["loka"]["dense_graphs"]))
"""


@pytest.mark.slow
def test_in_a_dmp_job_the_dense_module_replays_after_its_warm_up(tmp_path):
    """The bookkeeping in TorchRec's real pipeline on a CPU, the capture faked: a sharded module's
    output arrives as an awaitable, every call must still find the same key (it once did not)."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, "-c", _FAKE_CAPTURE_JOB, str(tmp_path / "run"), "29641"],
        cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (dense,) = json.loads(proc.stdout.split("DENSE", 1)[1])
    assert dense["module"] == "over_arch" and dense["failure"] is None
    # 8 train steps: 2 eager while the key warms up, a capture, then replays; 2 eval calls eager
    assert dense["captures"] == 1 and dense["replays"] == 6
    assert dense["eager_reasons"] == {"warming up": 2, "eval or no_grad": 2}


# ------------------------------------------------------------------------------------------ GPU
def _assert_same(got, want, exact, what):
    if exact:  # bf16 GEMMs and elementwise kernels: the replay runs the very same kernels
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=what)
    else:  # FP8 GEMMs: cuBLAS may pick another algorithm inside a capture (see test_layer_graph)
        scale = float(want.abs().max()) or 1.0
        torch.testing.assert_close(got, want, rtol=2**-8, atol=scale * 2**-9, msg=what)


def _train_side_by_side(make_model, make_args, *, steps=6, autocast=False, after_step=None, exact=True):
    """Train a graphed model and an eager twin with the same data; returns both and the graphs.

    Outputs are compared at every step and the parameters at the end: bit for bit (``exact``), or
    within FP8 GEMMs' run-to-run freedom, which the SGD steps carry into the parameters."""
    torch.manual_seed(0)
    eager = make_model()
    graphed = copy.deepcopy(eager)
    graphs = graph_dense_modules(graphed, ["over_arch"], capture_after=2)["over_arch"]
    # SGD: a gradient difference moves the parameters in proportion (Adagrad's first steps are
    # lr * sign(g), which turns FP8's run-to-run freedom near zero into lr-sized differences).
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (eager, graphed)]
    for step in range(steps):
        args = make_args(step)
        outs = []
        for model, opt in zip((eager, graphed), opts):
            opt.zero_grad(set_to_none=True)
            ctx = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else torch.autocast("cuda", enabled=False)
            with ctx:
                y = model.over_arch(*args)
            loss = (y.float() ** 2).mean()
            loss.backward()
            opt.step()
            outs.append(y.detach().float())
        _assert_same(outs[1], outs[0], exact, f"step {step}")
        if after_step is not None:
            after_step(step, eager, graphed)
    for (name, p), q in zip(eager.named_parameters(), graphed.parameters()):
        if exact:
            torch.testing.assert_close(q, p, rtol=0, atol=0, msg=name)
        else:  # SGD: 8 steps of lr 0.05 times a gradient difference within 2^-8 of the gradient
            torch.testing.assert_close(q, p, rtol=1e-3, atol=1e-3, msg=name)
    return eager, graphed, graphs


@pytest.mark.gpu
@pytest.mark.parametrize("autocast", [False, True])
def test_gpu_graphed_tower_trains_exactly_as_the_eager_one(autocast):
    dev = torch.device("cuda")
    _, _, graphs = _train_side_by_side(
        lambda: Model(device=dev), lambda step: (torch.randn(64, 16, device=dev, requires_grad=False),), autocast=autocast
    )
    assert graphs.failure is None and graphs.captures == 1 and graphs.replays == 6 - 2 + 1


@pytest.mark.gpu
def test_gpu_keyed_tensor_argument_and_input_gradients():
    from torchrec.sparse.jagged_tensor import KeyedTensor

    dev = torch.device("cuda")
    grads = {}

    def args(step):
        values = torch.randn(32, 8, device=dev, requires_grad=True)
        grads[step] = values
        return torch.randn(32, 16, device=dev), KeyedTensor(keys=["a", "b"], length_per_key=[3, 5], values=values)

    _, _, graphs = _train_side_by_side(lambda: Model(pooled=8, device=dev), args)
    assert graphs.captures == 1 and graphs.replays > 0


@pytest.mark.gpu
def test_gpu_input_gradient_equals_eager():
    dev = torch.device("cuda")
    torch.manual_seed(1)
    eager = Model(device=dev)
    graphed = copy.deepcopy(eager)
    g = graph_dense_modules(graphed, capture_after=1)["over_arch"]
    for _ in range(3):
        x = torch.randn(32, 16, device=dev)
        xe, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
        eager.over_arch(xe).square().sum().backward()
        graphed.over_arch(xg).square().sum().backward()
        torch.testing.assert_close(xg.grad, xe.grad, rtol=0, atol=0)
    assert g.replays == 3


@pytest.mark.gpu
def test_gpu_fp8_layers_and_a_plan_change_recapture():
    dev = torch.device("cuda")

    def make():
        model = Model(device=dev)
        layers, _ = convert_linears(model, DispatchConfig(min_features=16))
        for layer in layers.values():
            layer.set_kernels(ROWWISE)  # FP8 first; bf16 from step 3 on
        return model

    def switch(step, eager, graphed):
        if step == 3:  # a new plan: every layer back to bf16, as the step-time guard would do it
            for model in (eager, graphed):
                for m in model.modules():
                    if hasattr(m, "set_kernels"):
                        m.set_kernels(LayerKernels())

    _, graphed, graphs = _train_side_by_side(make, lambda step: (torch.randn(64, 16, device=dev),), steps=8,
                                             autocast=True, after_step=switch, exact=False)  # fmt: skip
    assert graphs.failure is None and graphs.captures == 2


@pytest.mark.gpu
def test_gpu_eager_paths_shape_change_hooks_eval_and_no_grad():
    dev = torch.device("cuda")
    model = Model(device=dev)
    g = graph_dense_modules(model, capture_after=1)["over_arch"]
    model.over_arch(torch.randn(16, 16, device=dev)).sum().backward()
    assert g.replays == 1
    model.over_arch(torch.randn(24, 16, device=dev)).sum().backward()  # a new shape: captured too
    assert g.captures == 2
    handle = model.over_arch.mlp[0].register_forward_hook(lambda *a: None)
    before = g.eager_calls
    model.over_arch(torch.randn(16, 16, device=dev)).sum().backward()
    assert g.eager_calls == before + 1
    handle.remove()
    with torch.no_grad():
        model.over_arch(torch.randn(16, 16, device=dev))
    model.eval()
    model.over_arch(torch.randn(16, 16, device=dev))
    assert g.eager_calls == before + 3
    model.train()
    y1 = model.over_arch(torch.randn(16, 16, device=dev))
    y2 = model.over_arch(torch.randn(16, 16, device=dev))  # the first one's backward is pending: eager
    assert g.eager_calls == before + 4
    (y1.sum() + y2.sum()).backward()


@pytest.mark.gpu
def test_gpu_device_time_measurements():
    from loka_torchrec.dispatch.layer_check import time_layer_step
    from loka_torchrec.evidence import BF16, GemmRole, GemmShape
    from loka_torchrec.fp8 import Fp8Format
    from loka_torchrec.probe.speed import time_gemm

    dev = torch.device("cuda")
    shape = GemmShape(4096, 1024, 1024)
    for choice in (BF16, KernelChoice("scaled_mm", "rowwise")):
        t = time_gemm(choice, GemmRole.FORWARD, shape, dtype=torch.bfloat16, device=dev, reps=10, device_time=True)
        assert t.n == 10 and 0 < t.low <= t.value <= t.high < 5.0
    timing = time_layer_step(
        1024, 1024, 4096, ROWWISE, bias=False, device=dev, weight_dtype=torch.float32, input_dtype=torch.bfloat16,
        autocast_dtype=torch.bfloat16, grad_format=Fp8Format.E4M3, reps=5, device_time=True,
    )
    assert timing.fp8_ms.n == 5 and timing.bf16_ms.n == 5
    assert 0 < timing.bf16_ms.value < 5.0 and 0 < timing.fp8_ms.value < 5.0
