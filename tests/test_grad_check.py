"""The gradient check (loka_torchrec/dispatch/grad_check.py) on the raw-Parameter HSTU test model.

Emulated rowwise FP8 on every GEMM of that model puts the weight gradient of block 0's fused u|v|q|k
projection at 7.3 dB against float64 (seed 1), under torchao's 17 dB floor for FP8 gradients. With
only one role in FP8 that gradient is 30.7 dB for the grad-weight GEMM, 26.4 dB for grad-input and
7.2 dB for the forward: the projection's forward error, amplified by the block's attention and
per-head layer norm, is what breaks it. The check must find that role and only send it to bf16.
These tests use the floor alone, except those of the noise rule (``max_grad_noise_ratio``), which
keeps FP8 whose error is a small, unshared part of the batch's own gradient noise.
"""

import pytest
import torch

import loka_torchrec
from loka_torchrec import LokaConfig
from loka_torchrec.probe import ProbeConfig
from loka_torchrec.dispatch import DispatchConfig
from loka_torchrec.dispatch.grad_check import SOURCE
from loka_torchrec.dispatch.layer_kernels import LayerKernels
from loka_torchrec.evidence import BF16, GemmRole, KernelChoice
from loka_torchrec.fp8.error_metrics import sqnr_db
from test_sites import GRAD_DB, _loss_and_grads, raw_hstu

ROWWISE = KernelChoice("emulated", "rowwise")


def _batch():
    torch.manual_seed(1)
    return torch.randn(4, 8, 32)


def _float64_grads(x):
    return _loss_and_grads(raw_hstu().double(), x.double())[1]


def _site_weight_db(model, x, ref):
    _, grads = _loss_and_grads(model, x)
    return {n: sqnr_db(grads[n].double(), ref[n]) for n in ("0._uvqk_weight", "1._uvqk_weight", "0._output_weight", "0._gate_weight")}


def test_forward_of_the_fused_projection_is_what_breaks_its_weight_gradient():
    x = _batch()
    ref = _float64_grads(x)
    db = {}
    for role in (None, *GemmRole):
        model = raw_hstu()
        report = loka_torchrec.apply(model, DispatchConfig(mode="all-bf16"))
        kernels = LayerKernels.uniform(ROWWISE) if role is None else LayerKernels().replace(role, ROWWISE)
        for site in report.dispatcher.managed_layers().values():
            site.set_kernels(kernels)
        db[role] = _site_weight_db(model, x, ref)["0._uvqk_weight"]
    assert db[None] < GRAD_DB and db[GemmRole.FORWARD] < GRAD_DB, db
    assert db[GemmRole.GRAD_WEIGHT] >= GRAD_DB + 10 and db[GemmRole.GRAD_INPUT] >= GRAD_DB + 5, db


def test_gradient_check_sends_the_projection_forward_to_bf16_and_meets_the_floor(tmp_path):
    x = _batch()
    ref = _float64_grads(x)
    model = raw_hstu()
    report = loka_torchrec.apply(model, DispatchConfig(mode="all:emulated:rowwise"), run_dir=str(tmp_path))
    assert min(_site_weight_db(model, x, ref).values()) < GRAD_DB  # the unchecked plan is below the floor
    plan = report.dispatcher.check_gradients(lambda: model(x).square().mean(), step=1)
    uvqk = plan.layers["0._uvqk_weight"].roles
    assert uvqk[GemmRole.FORWARD].choice == BF16 and uvqk[GemmRole.FORWARD].source == SOURCE
    assert "fwd alone puts" in uvqk[GemmRole.FORWARD].reason and "floor 17.0 dB" in uvqk[GemmRole.FORWARD].reason
    assert uvqk[GemmRole.GRAD_WEIGHT].choice == ROWWISE and uvqk[GemmRole.GRAD_INPUT].choice == ROWWISE
    assert plan.fp8_gemm_count() >= 7 * 3 - 3  # only what the floor needs goes back
    # what Dispatch now runs: every site's weight gradient at the floor against float64
    assert report.dispatcher.managed_layers()["0._uvqk_weight"].kernels.fwd == BF16
    for name, db in _site_weight_db(model, x, ref).items():
        assert db >= GRAD_DB, (name, db)
    events = [e for e in report.dispatcher.events if e["event"] == "grad_check"]
    assert events[0]["kind"] == "plan" and events[0]["worst_db"] < GRAD_DB
    assert events[-1]["kind"] == "demote" and events[-1]["worst_db_after"] >= GRAD_DB
    assert "gradient check" in (tmp_path / "dispatch_plan.json").read_text()


def test_gradient_check_keeps_a_plan_that_meets_the_floor_and_leaves_gradients_alone():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    report = loka_torchrec.apply(model, DispatchConfig(mode="all:emulated:rowwise"))
    x = torch.randn(64, 32)
    model(x).sum().backward()
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    plan = report.dispatcher.check_gradients(lambda: model(x).square().mean())
    assert plan.fp8_gemm_count() == 6
    checks = [e for e in report.dispatcher.events if e["event"] == "grad_check"]
    assert [e["kind"] for e in checks] == ["plan"] and checks[0]["check_seconds"] > 0
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, before[n]), n



def _train_steps_with_prepare(tmp_path, grad_check: bool, noise_ratio: float = 0.0):
    """The raw HSTU model through loka_torchrec.prepare: the Probe plans after 3 steps (emulated
    rowwise FP8 wherever accurate), with or without ``dispatch.grad_check`` (its noise rule at
    ``noise_ratio``, off by default: the floor alone); weights unchanged."""
    x = _batch()
    model = raw_hstu()
    dispatch = DispatchConfig(
        candidates=("emulated:rowwise",), min_speedup=0.0, grad_check=grad_check, max_grad_noise_ratio=noise_ratio
    )
    config = LokaConfig(enabled=True, probe=ProbeConfig(warmup_steps=3, every=1), dispatch=dispatch)
    loka = loka_torchrec.prepare(model, config, run_dir=str(tmp_path))
    for step in range(1, 6):
        with loka.step(step):
            model.zero_grad()
            model(x).square().mean().backward()
    loka.close()
    return model, loka, x


def test_prepare_with_grad_check_checks_the_first_fp8_plan_on_the_planning_steps_inputs(tmp_path):
    model, loka, x = _train_steps_with_prepare(tmp_path / "checked", grad_check=True)
    ref = _float64_grads(x)
    plan = loka.dispatcher.plan
    assert plan.fp8_gemm_count() > 0 and plan.step > 0
    checks = [e for e in loka.dispatcher.events if e["event"] == "grad_check"]
    assert checks and {e["step"] for e in checks} == {plan.step}  # at the step the plan was made, once
    assert min(_site_weight_db(model, x, ref).values()) >= GRAD_DB
    assert loka.dense_inputs is None  # nothing recorded is held after the check

    unchecked, loka_off, _ = _train_steps_with_prepare(tmp_path / "unchecked", grad_check=False)
    assert not [e for e in loka_off.dispatcher.events if e["event"] == "grad_check"]
    assert loka_off.dispatcher.plan.fp8_gemm_count() > plan.fp8_gemm_count()
    assert min(_site_weight_db(unchecked, x, ref).values()) < GRAD_DB


def test_the_noise_rule_keeps_fp8_whose_error_is_small_next_to_the_batch_noise(tmp_path):
    # Four sequences: two per half, so the batch's own noise is large, and the FP8 error that the
    # floor alone sends back (12 dB here) is a small, unshared part of it.
    floor_only, checked_floor, _ = _train_steps_with_prepare(tmp_path / "floor", grad_check=True)
    model, loka, x = _train_steps_with_prepare(tmp_path / "noise", grad_check=True, noise_ratio=0.1)
    plan_run = next(e for e in loka.dispatcher.events if e["event"] == "grad_check" and e["kind"] == "plan")
    under = plan_run["under_floor"]["0._uvqk_weight"]
    assert under["db"] < GRAD_DB and under["noise_ratio"] <= 0.1 and under["systematic_db"] >= GRAD_DB
    assert plan_run["failing"] == [] and loka.dispatcher.plan.fp8_gemm_count() > checked_floor.dispatcher.plan.fp8_gemm_count()
    assert loka.dispatcher.managed_layers()["0._uvqk_weight"].kernels.fwd == ROWWISE


def test_the_noise_rule_fails_an_error_that_both_halves_share_or_that_is_large_next_to_the_noise():
    from loka_torchrec.dispatch.grad_check import _assess

    gen = torch.Generator().manual_seed(0)
    mean = torch.randn(64, 32, generator=gen)
    r1, r2 = mean + 3 * torch.randn(64, 32, generator=gen), mean + 3 * torch.randn(64, 32, generator=gen)
    reference = {"w": (None, (r1, r2))}

    def got(e1, e2):
        return {"w": (None, (r1 + e1, r2 + e2))}

    small = 0.2 * torch.randn(64, 32, generator=gen), 0.2 * torch.randn(64, 32, generator=gen)
    shared = 0.5 * torch.randn(64, 32, generator=gen)
    large = 4 * torch.randn(64, 32, generator=gen), 4 * torch.randn(64, 32, generator=gen)
    # Under a 30 dB floor every case is judged by the noise rule.
    _, _, failing, under = _assess(got(*small), reference, 30.0, 0.1)
    assert failing == [] and under["w"]["db"] < 30.0 and under["w"]["noise_ratio"] < 0.01 and under["w"]["systematic_db"] > 30.0
    _, _, failing, under = _assess(got(shared, shared), reference, 30.0, 0.1)  # the same error on every batch
    assert failing == ["w"] and under["w"]["noise_ratio"] < 0.1 and under["w"]["systematic_db"] < 20.0
    _, _, failing, under = _assess(got(*large), reference, 30.0, 0.1)
    assert failing == ["w"] and under["w"]["noise_ratio"] > 0.5
    assert _assess(got(*small), reference, 30.0, 0.0)[2] == ["w"]  # no rule: the floor alone
    scalar = {"w": ((r1 + r2) / 2, None)}  # a loss without halves: the floor alone
    assert _assess({"w": ((r1 + r2 + sum(small)) / 2, None)}, scalar, 30.0, 0.1)[2] == ["w"]


def test_dense_inputs_halves_average_to_the_loss_and_fall_back_to_it_for_single_rows():
    from loka_torchrec.dense_inputs import DenseInputs

    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    inputs = DenseInputs({"0": net[0]})
    inputs.record()
    net(torch.randn(6, 4))
    inputs.stop()
    halves = inputs.loss(halves=True)
    assert halves.shape == (2,) and torch.allclose(halves.mean(), inputs.loss()) and not torch.allclose(halves[0], halves[1])
    one_row = DenseInputs({"0": net[0]})
    one_row.record()
    net(torch.randn(1, 4))
    one_row.stop()
    assert one_row.loss(halves=True).dim() == 0


def test_a_reference_kept_on_the_host_gives_the_same_check():
    """On a GPU the reference gradients wait on the host and come back one site at a time; the check's
    records and demotions are those of a reference kept on the device (here both on the CPU: the
    same moves, to the same device)."""
    from loka_torchrec.dispatch import grad_check

    x = _batch()
    results = []
    for host in (None, torch.device("cpu")):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(grad_check, "_host_for", lambda layers, host=host: host)
            model = raw_hstu()
            report = loka_torchrec.apply(model, DispatchConfig(mode="all:emulated:rowwise"))
            plan = report.dispatcher.check_gradients(lambda: model(x).square().mean(), step=1)
            events = [e for e in report.dispatcher.events if e["event"] == "grad_check"]
            results.append((plan.digest(), [{k: v for k, v in e.items() if k != "check_seconds"} for e in events]))
    assert results[0] == results[1] and len(results[0][1]) >= 2  # the plan run and at least one demotion
    assert grad_check._host_for({"a": torch.nn.Linear(2, 2)}) is None  # on the CPU: nothing to move


def test_each_gradient_is_parked_as_the_backward_computes_it_and_matches_the_unparked_one():
    """With ``park`` (on a GPU: the host) every site's gradient, of each half or of the whole loss,
    moves there the moment autograd computes it, so the device never holds a set of them; here the
    ``meta`` device stands in for the host, which the CPU cannot tell apart from itself, and the
    values are checked through a CPU park. A Parameter two sites share is parked once, for both."""
    from loka_torchrec.dispatch import grad_check

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    report = loka_torchrec.apply(model, DispatchConfig(mode="all-bf16"))
    layers = report.dispatcher.managed_layers()
    x = torch.randn(6, 16)

    def halves():
        out = model(x).square().mean(dim=1)
        return torch.stack([out[:3].mean(), out[3:].mean()])

    on_meta = grad_check._gradients(layers, {}, halves, park=torch.device("meta"))
    parked = grad_check._gradients(layers, {}, halves, park=torch.device("cpu"))
    kept = grad_check._gradients(layers, {}, halves)
    assert set(on_meta) == set(parked) == set(kept) == set(layers)
    for name in layers:
        shape = grad_check.site_parameter(layers[name]).shape
        assert on_meta[name][0] is None and all(h.device.type == "meta" and h.shape == shape for h in on_meta[name][1])
        for got, ref in zip(parked[name][1], kept[name][1]):
            torch.testing.assert_close(got, ref, rtol=0, atol=0)  # parked, not changed
    # the mean of the halves' gradients is the batch's: the halves are the loss's two parts
    whole = torch.autograd.grad(halves().mean(), [grad_check.site_parameter(m) for m in layers.values()])
    for (name, (_, (first, second))), g in zip(kept.items(), whole):
        torch.testing.assert_close((first + second) / 2, g)
    # the whole loss, and two sites that multiply by one Parameter
    shared = {"a": layers["0"], "b": layers["0"], "c": layers["2"]}
    whole_parked = grad_check._gradients(shared, {}, lambda: model(x).square().mean(), park=torch.device("cpu"))
    whole_kept = grad_check._gradients(shared, {}, lambda: model(x).square().mean())
    for name in shared:
        assert whole_parked[name][1] is None
        torch.testing.assert_close(whole_parked[name][0], whole_kept[name][0], rtol=0, atol=0)
    assert all(p.grad is None for p in model.parameters())  # no .grad changed


@pytest.mark.gpu
def test_on_cuda_the_check_needs_less_memory_than_a_training_step():
    """On a GPU every gradient waits on the host as soon as it is computed, so the check adds no
    set of weight gradients to the device: its peak stays below that of one forward and backward
    of the same batch, whose gradients land in ``.grad`` (one set), and below the check's own
    peak with the gradients kept on the device."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA only")
    from loka_torchrec.dispatch import grad_check

    torch.manual_seed(0)
    peaks = {}
    for host in (None, torch.device("cpu")):
        # 32 sites of 4 MiB of fp32 weight gradient: a set (128 MiB) outweighs the few sites' worth a
        # comparison holds at once; the weights keep the activations' scale through the depth.
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(32)]).cuda()
        for layer in model:
            torch.nn.init.normal_(layer.weight, std=1024**-0.5)
        report = loka_torchrec.apply(model, DispatchConfig(mode="all:scaled_mm:rowwise"))
        x = torch.randn(64, 1024, device="cuda")

        def halves():
            out = model(x).square().mean(dim=1)
            return torch.stack([out[:32].mean(), out[32:].mean()])

        def peak_of(work):
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            work()
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - base

        peak_of(lambda: halves().mean().backward())  # kernels and cuBLAS workspaces made before measuring
        step = peak_of(lambda: halves().mean().backward())
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(grad_check, "_host_for", lambda layers, host=host: host)
            peaks[host is None] = peak_of(lambda: report.dispatcher.check_gradients(halves, step=1))
    assert grad_check._host_for(report.dispatcher.managed_layers()) == torch.device("cpu")
    assert peaks[False] < peaks[True], peaks  # the gradients waited on the host
    assert peaks[False] < step, (peaks, step)
