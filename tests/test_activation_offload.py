"""offload_saved_activations: saved CUDA activations wait for the backward in host memory."""

import pytest
import torch

from loka_torchrec.activation_offload import MIN_OFFLOAD_BYTES, _pack, _unpack, offload_saved_activations


def _grads(x, w, offload, **kwargs):
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    context = offload_saved_activations(**kwargs) if offload else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    with context:
        y = torch.nn.functional.gelu(x @ w.t()).square().sum()
    y.backward()
    return x.grad, w.grad


def test_off_cuda_nothing_moves_and_gradients_are_unchanged():
    x, w = torch.randn(64, 32, dtype=torch.float64), torch.randn(16, 32, dtype=torch.float64)
    got, want = _grads(x, w, True, min_bytes=0), _grads(x, w, False)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    t = torch.ones(1 << 20)  # 4 MiB on the CPU: stays
    assert _pack(0)(t) is t and _unpack(t) is t
    with pytest.raises(ValueError, match="min_bytes: expected >= 0, got -1"):
        with offload_saved_activations(min_bytes=-1):
            pass


@pytest.mark.gpu
def test_large_saved_cuda_tensors_go_to_pinned_host_memory_and_come_back_exactly():
    if not torch.cuda.is_available():
        pytest.skip("CUDA only")
    small = torch.ones(8, device="cuda")
    assert _pack(MIN_OFFLOAD_BYTES)(small) is small  # under the threshold: stays on the device
    weight = torch.nn.Parameter(torch.randn(1024, 1024, device="cuda"))
    assert _pack(MIN_OFFLOAD_BYTES)(weight) is weight  # a Parameter stays on the device anyway
    big = torch.randn(1024, 1024, device="cuda")  # 4 MiB
    device, host = _pack(MIN_OFFLOAD_BYTES)(big)
    assert host.is_pinned() and host.device.type == "cpu" and device == big.device
    assert torch.equal(_unpack((device, host)), big)
    x, w = torch.randn(4096, 1024, device="cuda"), torch.randn(1024, 1024, device="cuda")

    def peak_rise(offload):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        grads = _grads(x, w, offload)
        torch.cuda.synchronize()
        return grads, torch.cuda.max_memory_allocated() - base

    (want, kept), (got, offloaded) = peak_rise(False), peak_rise(True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))  # the same values, bit for bit
    assert offloaded < kept  # the forward's saved (4096, 1024) activations waited on the host
