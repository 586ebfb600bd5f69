"""Reach on models LoKA was not written for: the README's loop under ``torch.compile`` manages every GEMM.

The model is a Wukong written as outside users write it (``outside_models.UserWukong``): its
``Embedding`` module holds a dense ``nn.Linear`` beside the sparse table, its token-mixing GEMMs
multiply raw Parameters, its MLPs are ``nn.Linear`` + ``nn.BatchNorm1d``. The Probe's cadence is
longer than one step, so the first steps run compiled and only the probe steps run eagerly.
"""

import contextlib
import dataclasses
import importlib

import pytest
import torch
import torch.nn.functional as F

import outside_models

import loka_torchrec
from loka_torchrec.compile import dense_modules


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _readme_loop(model, config, run_dir, steps, compile="default"):
    """The README's loop: ``prepare``, then ``with loka.step(step)`` around each training step."""
    loka = loka_torchrec.prepare(model, config, run_dir=str(run_dir), compile=compile, device="cpu")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(1, steps + 1):
        with loka.step(step):
            logits = model(*model.batch(32, seed=step)).squeeze(-1)
            F.binary_cross_entropy_with_logits(logits, torch.rand(32)).backward()
            optimizer.step()
            optimizer.zero_grad()
    return loka


def _config(**probe):
    return loka_torchrec.LokaConfig.from_dict({
        "enabled": True, "probe": {"every": 5, "warmup_steps": 10, **probe},
        # a CPU is not faster in FP8: the speed gates off, so that the plan shows where FP8 can go
        "dispatch": {"min_speedup": 0.0, "layer_check_reps": 0, "grad_check": False},
    })  # fmt: skip


def test_a_module_named_embedding_with_a_dense_layer_is_not_a_table():
    """The dense layer inside the user's ``Embedding`` compiles; the sparse table beside it does not."""
    model = outside_models.UserWukong()
    assert dense_modules(model) == ["embedding.dense", "interaction", "head"]


def test_the_readme_loop_under_compile_reaches_every_gemm_of_an_outside_wukong(tmp_path):
    model = outside_models.UserWukong()
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    parameters = [n for n, p in model.named_parameters() if p.dim() == 2 and "sparse" not in n]
    loka = _readme_loop(model, _config(), tmp_path, steps=12)
    loka.close()
    assert loka.compiled_modules == ["embedding.dense", "interaction", "head"]
    plan = loka.dispatcher.plan
    assert plan.step == 9  # planned at the end of the warm-up, from the probe steps 5 and ...
    assert plan.never_ran == {}
    assert plan.coverage["ran_checked"] is True
    assert plan.coverage["share"] == 1.0 and plan.coverage["unreached"] == {}
    # every nn.Linear and every token-mixing Parameter is a site with a plan, and runs FP8 somewhere
    assert set(linears) <= set(plan.layers)
    assert {n for n in parameters if n.endswith("weight") and "mlp" not in n and "head" not in n
            and "dense" not in n} <= set(plan.layers)  # fmt: skip
    assert plan.fp8_gemm_count() > len(plan.layers)


def test_a_compiled_first_step_shows_which_sites_run(tmp_path):
    """Step 1 runs compiled, before any probe step: its compiled calls leave their trace
    (``ran_compiled``), so it decides which sites run as an eager step would, and no compiled site
    looks idle beside the dense layer in the user's ``Embedding``."""
    model = outside_models.UserWukong()
    loka = _readme_loop(model, _config(warmup_steps=100), tmp_path, steps=1)
    layers = loka.dispatcher.managed_layers()
    assert all(m.last_rows == 0 for m in layers.values())  # no site ran eagerly
    assert loka.dispatcher.plan.coverage["ran_checked"] is True
    assert loka.dispatcher.never_ran == {} and loka.dispatcher.plan.coverage["share"] == 1.0
    loka.close()


@pytest.mark.parametrize("offload", [True, False])
def test_probe_steps_and_the_gradient_check_offload_saved_activations_only_when_asked(tmp_path, monkeypatch, offload):
    """``probe.offload_activations`` on a GPU: the steps whose compiled modules run eagerly for the
    Probe, and the gradient check's passes after the plan, keep autograd's saved tensors in host
    memory (``offload_saved_activations``); compiled steps do not. On a CPU the option does nothing;
    the GPU's decision and the offload (pinned memory needs CUDA) are stood in for here, the
    saved-tensor hooks are real."""
    entered, packed, in_check = [], [], [False]

    @contextlib.contextmanager
    def offload_saved_activations():
        entered.append(("check" if in_check[0] else "step", current[0]))
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(current[0]) or t, lambda t: t):
            yield

    prepare_module = importlib.import_module("loka_torchrec.prepare")  # (the package's `prepare` is the function)
    monkeypatch.setattr(prepare_module, "offload_saved_activations", offload_saved_activations)
    model = outside_models.UserWukong()
    config = _config(offload_activations=offload)
    config = dataclasses.replace(config, dispatch=dataclasses.replace(config.dispatch, grad_check=True))
    loka = loka_torchrec.prepare(model, config, run_dir=str(tmp_path), compile="default", device="cpu")
    assert loka.offload_probe_activations is False  # a CPU: nothing to offload to
    loka.offload_probe_activations = offload  # as prepare decides on a CUDA device
    check_gradients = loka.dispatcher.check_gradients

    def checking(*args, **kwargs):
        in_check[0] = True
        try:
            return check_gradients(*args, **kwargs)
        finally:
            in_check[0] = False

    loka.dispatcher.check_gradients = checking
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    current, eager_steps = [0], []
    for step in range(1, 13):
        current[0] = step
        if loka.eager_at(step):
            eager_steps.append(step)
        with loka.step(step):
            logits = model(*model.batch(32, seed=step)).squeeze(-1)
            F.binary_cross_entropy_with_logits(logits, torch.rand(32)).backward()
            optimizer.step()
            optimizer.zero_grad()
    loka.close()
    assert eager_steps and len(eager_steps) < 12  # some probe steps, the rest compiled
    if offload:
        assert [s for kind, s in entered if kind == "step"] == eager_steps
        plan_step = loka.dispatcher.plan.step
        checks = [s for kind, s in entered if kind == "check"]
        assert checks and set(checks) == {plan_step}  # each of the check's passes, at the plan's step
        assert set(packed) == set(eager_steps) | set(checks)  # every probe step and the check saved through the hooks
    else:
        assert entered == [] and packed == []
