"""The large presets on a CUDA GPU: forward/backward in bf16 autocast, mods on, aligned GEMMs."""

import copy

import pytest
import torch
from torch import nn
from torchrec import KeyedJaggedTensor

from loka_job.models.dhen import DhenConfig, build_dhen
from loka_job.models.hstu import HstuConfig, build_hstu
from loka_torchrec.mods import ModsConfig, apply_mods
from loka_job.training.data_spec import DataSpec, TableSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _dhen_inputs(device, batch=512):
    spec = DataSpec(num_dense=13, tables=tuple(TableSpec(f"t{i}", f"f{i}", 10_000, 256, 3) for i in range(7)))
    lengths = torch.randint(0, 5, (7 * batch,), device=device)
    values = torch.randint(0, 10_000, (int(lengths.sum()),), device=device)
    kjt = KeyedJaggedTensor.from_lengths_sync([t.feature for t in spec.tables], values, lengths)
    return spec, torch.randn(batch, 13, device=device), kjt


def _hstu_inputs(device, batch=256, max_len=128):
    spec = DataSpec(
        num_dense=8,
        tables=(
            TableSpec("t_item", "hist_item", 50_000, 512, pooling_factor=max_len, sequence=True),
            TableSpec("t_item", "cand_item", 50_000, 512, pooling_factor=1, sequence=True),
        ),
    )
    lengths = torch.randint(1, max_len + 1, (batch,), device=device)
    values = torch.randint(0, 50_000, (int(lengths.sum()) + batch,), device=device)
    all_lengths = torch.cat([lengths, torch.ones(batch, dtype=lengths.dtype, device=device)])
    kjt = KeyedJaggedTensor.from_lengths_sync(["hist_item", "cand_item"], values, all_lengths)
    return spec, torch.randn(batch, 8, device=device), kjt


@pytest.mark.parametrize("model_name", ["dhen", "hstu"])
def test_large_presets_train_on_gpu_baseline_and_modded(model_name):
    device = torch.device("cuda")
    torch.manual_seed(0)
    if model_name == "dhen":
        spec, dense, kjt = _dhen_inputs(device)
        baseline = build_dhen(DhenConfig.large(), spec, device, embedding_device=device)
    else:
        spec, dense, kjt = _hstu_inputs(device)
        baseline = build_hstu(HstuConfig.large(), spec, device, embedding_device=device)
    exact = copy.deepcopy(baseline)
    apply_mods(exact, ModsConfig(preset="custom", fuse_siblings=True, pad_to_16=True))
    with torch.no_grad():
        reference = baseline(dense, kjt).double()
        torch.testing.assert_close(exact(dense, kjt).double(), reference, rtol=1e-3, atol=1e-3)  # TF32 off by default
    modded = copy.deepcopy(baseline)
    apply_mods(modded, ModsConfig(preset="all"))
    for module in modded.modules():
        if isinstance(module, nn.Linear):
            assert module.in_features % 16 == 0 and module.out_features % 16 == 0
    for model in (baseline, modded):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(dense, kjt)
        assert logits.shape == (dense.shape[0],)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), torch.rand_like(logits.float()))
        loss.backward()
        assert torch.isfinite(loss)
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
