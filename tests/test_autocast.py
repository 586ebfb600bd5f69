"""``train.autocast=bf16``: LokaLinear under torch.autocast, the train module, the loop settings."""

import copy

import pytest
import torch
from torch import nn

import loka_torchrec
from loka_torchrec.dispatch import DispatchConfig
from loka_torchrec.dispatch.layer_kernels import LayerKernels
from loka_torchrec.dispatch.linear import LokaLinear
from loka_torchrec.evidence import KernelChoice
from loka_job.training.dense_optimizer import dense_adagrad, dense_optimizer_kind
from loka_job.training.trainer import ClickTrainModule, TrainConfig, step_time_stats

BF16 = torch.bfloat16


def _autocast():
    return torch.autocast("cpu", dtype=BF16)


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 1))


def test_all_bf16_loka_model_matches_autocast_nn_linear():
    ref = _mlp()
    model = copy.deepcopy(ref)
    report = loka_torchrec.apply(model, DispatchConfig(mode="all-bf16"))
    assert len(report.converted) == 3 and all(isinstance(m, LokaLinear) for m in (model[0], model[2], model[4]))
    x = torch.randn(40, 64)
    with _autocast():
        y_ref, y = ref(x), model(x)
    assert y.dtype == y_ref.dtype == BF16  # as nn.Linear under autocast
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=0, atol=0)
    y_ref.float().sum().backward()
    y.float().sum().backward()
    for a, b in zip(ref.parameters(), model.parameters()):
        assert b.grad.dtype == torch.float32  # the master weights keep fp32 gradients
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    "kernels",
    [
        # high-precision forward inside the autograd function (FP8 only in grad-input)
        LayerKernels(dgrad=KernelChoice("emulated", "tensorwise")),
        # every GEMM in FP8 on torch._scaled_mm
        LayerKernels(
            fwd=KernelChoice("scaled_mm", "rowwise"),
            dgrad=KernelChoice("scaled_mm", "rowwise"),
            wgrad=KernelChoice("scaled_mm", "rowwise"),
        ),
    ],
)
def test_mixed_and_fp8_plans_take_bf16_inputs_under_autocast(kernels):
    torch.manual_seed(1)
    linear = nn.Linear(64, 32)
    layer = LokaLinear.from_linear(copy.deepcopy(linear))
    layer.set_kernels(kernels)
    x = torch.randn(24, 64)
    x_ref, x_loka = x.clone().requires_grad_(), x.clone().requires_grad_()
    with _autocast():
        y_ref = linear(x_ref)
        y = layer(x_loka)
    assert y.dtype == BF16
    fp8_fwd = kernels.fwd.backend != "bf16"
    # bf16 forward: the same bf16 GEMM (bias added after it); FP8 forward: within FP8's error
    tol = 0.1 if fp8_fwd else 2e-2
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=tol, atol=tol)
    y_ref.float().pow(2).sum().backward()
    y.float().pow(2).sum().backward()
    assert x_loka.grad.dtype == torch.float32 and layer.weight.grad.dtype == torch.float32
    assert torch.isfinite(layer.weight.grad).all() and not layer.fallback_reasons
    cos = nn.functional.cosine_similarity(layer.weight.grad.flatten(), linear.weight.grad.flatten(), dim=0)
    assert cos > 0.98


def test_loka_model_trains_under_bf16_autocast():
    torch.manual_seed(2)
    model = _mlp(2)
    loka_torchrec.apply(model, DispatchConfig(mode="all:scaled_mm:tensorwise"))
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
    x = torch.randn(256, 64)
    target = (x[:, :8].sum(1, keepdim=True) > 0).float()
    losses = []
    for _ in range(30):
        with _autocast():
            logits = model(x)
        loss = nn.functional.binary_cross_entropy_with_logits(logits.float(), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert losses[-1] < 0.6 * losses[0]


class _Batch:
    def __init__(self, dense, sparse, labels):
        self.dense_features, self.sparse_features, self.labels = dense, sparse, labels


entered = []  # what the baseline context in the test below records


class _DenseOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 1)
        self.seen = []

    def forward(self, dense, sparse):
        self.seen.append((torch.is_autocast_enabled("cpu"), entered[-1] if entered else None))
        return self.linear(dense).squeeze(-1)


def test_click_train_module_runs_forward_in_autocast_and_baseline_context():
    import contextlib

    @contextlib.contextmanager
    def marker():
        entered.append("in")
        try:
            yield
        finally:
            entered.append("out")

    model = _DenseOnly()
    module = ClickTrainModule(model, autocast_dtype=BF16, forward_context=marker, device_type="cpu")
    batch = _Batch(torch.randn(4, 8), None, torch.tensor([0.0, 1.0, 1.0, 0.0]))
    loss, (loss_d, logits, labels) = module(batch)
    assert model.seen == [(True, "in")] and entered[-1] == "out"
    assert logits.dtype == BF16 and loss.dtype == torch.float32  # loss in fp32, outside autocast
    plain = ClickTrainModule(_DenseOnly())
    _, (_, logits, _) = plain(batch)
    assert logits.dtype == torch.float32


def test_train_config_validates_autocast_and_timing_start():
    assert TrainConfig(autocast="bf16", steps=10, timing_start=4).autocast == "bf16"
    with pytest.raises(ValueError, match="train.autocast"):
        TrainConfig(autocast="fp16")
    with pytest.raises(ValueError, match="train.timing_start"):
        TrainConfig(steps=10, timing_start=10)


def test_step_time_stats_in_milliseconds():
    stats = step_time_stats([0.010 + 0.001 * i for i in range(11)])  # 10 .. 20 ms
    assert stats["median_step_ms"] == pytest.approx(15.0)
    assert stats["p10_step_ms"] == pytest.approx(11.0) and stats["p90_step_ms"] == pytest.approx(19.0)
    assert stats["mean_step_ms"] == pytest.approx(15.0)
    one = step_time_stats([0.002])
    assert one["p10_step_ms"] == one["p90_step_ms"] == pytest.approx(2.0)


def test_dense_adagrad_is_fused_where_pytorch_has_the_kernel_and_updates_as_the_default_one(caplog):
    torch.manual_seed(0)
    fused_param = nn.Parameter(torch.randn(8, 4))
    plain_param = nn.Parameter(fused_param.detach().clone())
    start = fused_param.detach().clone()
    fused = dense_adagrad([fused_param], lr=0.1, fused=True)
    plain = dense_adagrad([plain_param], lr=0.1, fused=False)
    assert fused.defaults["fused"] is True and not plain.defaults["fused"]
    assert (dense_optimizer_kind(fused), dense_optimizer_kind(plain)) == ("fused", "foreach")
    for _ in range(3):
        grad = torch.randn(8, 4)
        fused_param.grad, plain_param.grad = grad.clone(), grad.clone()
        fused.step()
        plain.step()
    assert fused_param.detach().sub(plain_param.detach()).abs().max() < 1e-6
    assert fused_param.detach().sub(start).abs().min() > 0.01  # every entry took its steps
    # A device without PyTorch's fused kernel (meta here): the default implementation, and a warning.
    with caplog.at_level("WARNING", logger="loka_job.train"):
        meta = dense_adagrad([nn.Parameter(torch.empty(2, 2, device="meta"))], lr=0.1, fused=True)
    assert not meta.defaults["fused"]
    assert "no fused Adagrad for meta" in caplog.text


def test_dense_adagrad_without_a_fused_kernel_compiles_its_step_in_a_compiled_job(monkeypatch):
    import loka_job.training.dense_optimizer as dense_optimizer

    monkeypatch.setattr(dense_optimizer, "_fused_adagrad_runs", lambda device_type: False)  # as PyTorch 2.11 on CUDA
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(16, 8)), nn.Parameter(torch.randn(8))]
    twins = [nn.Parameter(p.detach().clone()) for p in params]
    compiled = dense_adagrad(params, lr=0.1, fused=True, compiled=True)
    plain = dense_adagrad(twins, lr=0.1, fused=True, compiled=False)
    assert (dense_optimizer_kind(compiled), dense_optimizer_kind(plain)) == ("step compiled", "foreach")
    torch._dynamo.reset()
    counts = torch._dynamo.utils.counters
    counts.clear()
    for _ in range(3):
        for p, q in zip(params, twins):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        compiled.step()
        plain.step()
    assert counts["stats"]["unique_graphs"] >= 1  # the step ran compiled ...
    for p, q in zip(params, twins):
        assert (p.detach() - q.detach()).abs().max() < 1e-5  # ... with the eager update (3 steps)
    graphs = counts["stats"]["unique_graphs"]
    for p in params:
        p.grad = torch.randn_like(p)
    compiled.step()
    assert counts["stats"]["unique_graphs"] == graphs  # no recompile from step to step
    assert compiled.state_dict()["state"][0]["sum"].shape == (16, 8)  # checkpoints as before
