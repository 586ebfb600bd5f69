"""Misuse of LoKA's surface is refused with one line that says what to do, and the off switch is honoured."""

import copy
import gc
import warnings

import pytest
import torch
from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder

import loka_torchrec
from loka_torchrec.comms import CommsConfig
from loka_torchrec.comms.sharders import LokaEmbeddingBagCollectionSharder, LokaEmbeddingCollectionSharder
from loka_torchrec.dispatch import DispatchConfig
from loka_torchrec.dispatch.linear import LokaLinear
from loka_torchrec.probe import ProbeConfig

FP32_COMMS = CommsConfig(forward="fp32", backward="fp32")


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _config(**dispatch):
    dispatch = {"mode": "policy", "plan_at_step": 2, "min_speedup": 0.0, "samples": 2, "timing_reps": 1,
                "candidates": ("emulated:rowwise",), "layer_check_reps": 0, "grad_check": False, **dispatch}  # fmt: skip
    return loka_torchrec.LokaConfig(enabled=True, probe=ProbeConfig(enabled=False), dispatch=DispatchConfig(**dispatch), comms=FP32_COMMS)


def _train(model, loka, steps):
    x = torch.randn(8, 16)
    for step in steps:
        with loka.step(step):
            model(x).sum().backward()


# ------------------------------------------------------------------ loka.step
def test_a_step_block_never_entered_warns_and_the_next_step_raises():
    model = mlp()
    loka = loka_torchrec.prepare(model, _config())
    with pytest.warns(RuntimeWarning, match=r"loka.step\(1\) was never entered.*with loka.step\(step\)"):
        loka.step(1)  # the call alone: nothing runs
        gc.collect()
    model(torch.randn(8, 16)).sum().backward()
    with pytest.raises(RuntimeError, match=r"loka.step\(1\) was never entered, so LoKA did nothing in that step: write `with loka.step\(step\):`"):
        loka.step(2)
    assert loka.dispatcher.plan.fp8_gemm_count() == 0  # step 2 was due to plan: it did not run
    _train(model, loka, [2])  # written as it should be, the loop goes on and plans
    assert loka.dispatcher.plan.step == 2 and loka.dispatcher.plan.fp8_gemm_count() > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(model, loka, [3, 4])  # entered blocks never warn


@pytest.mark.parametrize("second", [1, 2, 0])
def test_step_numbers_that_repeat_or_go_backwards_raise(second):
    model = mlp()
    loka = loka_torchrec.prepare(model, _config())
    _train(model, loka, [1, 2])
    expected = r"expected the training step's number, an int >= 1" if second == 0 else rf"loka.step\({second}\): step 2 has already ended; step numbers must increase"
    with pytest.raises(ValueError, match=expected):
        _train(model, loka, [second])
    with pytest.raises(ValueError, match="loka.step_end"):
        loka.step_end(2)
    _train(model, loka, [3])  # the loop goes on


def test_nested_step_blocks_raise_and_a_failed_step_may_run_again():
    model = mlp()
    loka = loka_torchrec.prepare(model, _config())
    with pytest.raises(RuntimeError, match=r"loka.step\(2\) inside the block of loka.step\(1\): one `with loka.step\(step\):` per training step, not nested"):
        with loka.step(1):
            with loka.step(2):
                pass
    with pytest.raises(StopIteration):
        with loka.step(1):  # the data ran out: the step reports nothing
            raise StopIteration
    _train(model, loka, [1, 2])
    assert loka.dispatcher.plan.step == 2


# ------------------------------------------------------------------ prepare
def test_prepare_twice_on_one_model_raises_until_the_first_loka_is_closed(tmp_path):
    model = mlp()
    config = loka_torchrec.LokaConfig(enabled=True, probe=ProbeConfig(warmup_steps=3, every=1), comms=FP32_COMMS)
    first = loka_torchrec.prepare(model, config, run_dir=str(tmp_path / "a"))
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    with pytest.raises(ValueError, match=r"model: already prepared by loka_torchrec.prepare.*keep using that Loka, or call its close\(\)"):
        loka_torchrec.prepare(model, config, run_dir=str(tmp_path / "b"))
    with pytest.raises(ValueError, match="its submodule '1'"):
        loka_torchrec.prepare(nn.Sequential(nn.Linear(4, 16), model), config, run_dir=str(tmp_path / "c"))
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == hooks  # nothing added
    first.close()
    second = loka_torchrec.prepare(model, config, run_dir=str(tmp_path / "d"))
    assert set(second.dispatcher.managed_layers()) == {"0", "2"}
    second.close()


def test_prepare_on_a_model_wrapped_by_distributed_model_parallel_raises():
    class DistributedModelParallel(nn.Module):  # stands in for TorchRec's wrapper by its class name
        def __init__(self, module):
            super().__init__()
            self._dmp_wrapped_module = module

    wrapped = DistributedModelParallel(mlp())
    config = _config()
    fp8_comms = loka_torchrec.LokaConfig(enabled=True, probe=ProbeConfig(enabled=False), dispatch=config.dispatch,
                                         comms=CommsConfig(forward="fp8", backward="bf16"))  # fmt: skip
    with pytest.raises(ValueError, match=r"already sharded \(DistributedModelParallel at the root\).*pass loka.sharders\(\) to DistributedModelParallel"):
        loka_torchrec.prepare(copy.deepcopy(wrapped), fp8_comms)
    with pytest.raises(ValueError, match="already sharded"):
        loka_torchrec.prepare(copy.deepcopy(wrapped), loka_torchrec.LokaConfig(enabled=True, probe=ProbeConfig(enabled=False)))  # comms "auto"
    loka = loka_torchrec.prepare(wrapped, config)  # fp32 comms: no codec to install, the dense layers convert
    assert set(loka.dispatcher.managed_layers()) == {"0", "2"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_a_device_this_machine_does_not_have_is_refused_up_front():
    model = mlp()
    with pytest.raises(ValueError, match=r"device: cuda is not on this machine \(it has 0 CUDA device\(s\)\); pass a device it has, e.g. device='cpu'"):
        loka_torchrec.prepare(model, _config(), device="cuda")
    with pytest.raises(ValueError, match="device: expected a torch.device or a device string"):
        loka_torchrec.prepare(model, _config(), device="gpu0")
    assert not any(isinstance(m, LokaLinear) for m in model.modules())  # refused before anything changed


def test_cuda_index_past_the_machines_devices_is_refused():
    with pytest.raises(ValueError, match=r"device: cuda:99 is not on this machine"):
        loka_torchrec.prepare(mlp(), _config(), device="cuda:99")


def test_loka_off_leaves_the_model_untouched_and_the_loop_working(tmp_path):
    model = mlp()
    before = copy.deepcopy(model)
    loka = loka_torchrec.prepare(model, loka_torchrec.LokaConfig(enabled=False), run_dir=str(tmp_path))
    assert not loka.enabled and str(loka) == "LoKA is off (LokaConfig.enabled=False): the model is unchanged"
    assert [type(m) for m in model.modules()] == [type(m) for m in before.modules()]
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    x = torch.randn(8, 16)
    for step in (1, 2, 3):
        with loka.step(step):
            out = model(x)
            out.sum().backward()
        assert torch.equal(out, before(x))
    assert list(tmp_path.iterdir()) == []  # nothing written
    state = loka.state_dict()
    assert state == {"enabled": False}
    loka.load_state_dict(state, step=3)
    with pytest.raises(ValueError, match="has already ended"):
        loka.step_end(3)  # step numbers are still checked
    assert all(s.qcomm_codecs_registry is None for s in loka.sharders())
    loka.close()


# ------------------------------------------------------------------ sharders
def test_sharders_take_torchrecs_fused_params_and_the_jobs_other_sharders():
    loka = loka_torchrec.prepare(mlp(), loka_torchrec.LokaConfig(enabled=True, probe=ProbeConfig(enabled=False),
                                                                 comms=CommsConfig(forward="fp8", backward="bf16")))  # fmt: skip
    fused = {"learning_rate": 0.05}
    ebc, ec = loka.sharders(fused_params=fused)
    assert isinstance(ebc, LokaEmbeddingBagCollectionSharder) and ebc.fused_params == fused and ec.fused_params == fused
    feature_processed = FeatureProcessedEmbeddingBagCollectionSharder()
    mine = [EmbeddingBagCollectionSharder(fused_params={"learning_rate": 0.1}), feature_processed, EmbeddingCollectionSharder()]
    out = loka.sharders(mine)
    assert [type(s) for s in out] == [LokaEmbeddingBagCollectionSharder, LokaEmbeddingCollectionSharder, type(feature_processed)]
    assert out[0].fused_params == {"learning_rate": 0.1} and out[0].qcomm_codecs_registry  # the job's options, LoKA's codecs
    assert loka.sharders(mine, fused_params=fused)[0].fused_params == fused

    class CustomSharder(EmbeddingBagCollectionSharder):
        pass

    with pytest.raises(ValueError, match=r"sharders\[0\]: CustomSharder shards EmbeddingBagCollection, whose LoKA sharder carries the comm codecs"):
        loka.sharders([CustomSharder()])
    with pytest.raises(TypeError, match=r"sharders\[1\]: expected a TorchRec ModuleSharder, got str"):
        loka.sharders([feature_processed, "ebc"])
    plain = loka_torchrec.prepare(mlp(), _config())  # fp32 comms: the job's own sharder stays
    custom = CustomSharder()
    assert plain.sharders([custom])[-1] is custom and isinstance(plain.sharders([custom])[0], LokaEmbeddingCollectionSharder)
