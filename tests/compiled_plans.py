"""A small model whose every GEMM is planned on one kernel, compiled: how the backend tests compare kernels on the CPU."""

import torch
import torch._dynamo
from torch import nn

import loka_torchrec
from loka_torchrec.compile import compile_dense
from loka_torchrec.dispatch import DispatchConfig


def compiled_over_arch_step(kernel: str):
    """One compiled (``fullgraph=True``) forward and backward of a two-layer over arch planned on
    ``kernel`` (``backend:recipe``), same weights and input for every kernel; returns the output,
    the input's gradient and the first layer's weight gradient. 40 input features: a backend with an
    alignment pads them."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.ModuleDict({"over_arch": nn.Sequential(nn.Linear(40, 32), nn.ReLU(), nn.Linear(32, 8))})
    loka_torchrec.apply(model, DispatchConfig(mode=f"all:{kernel}", forward_scaling="current"))
    compile_dense(model, "default")
    x = torch.randn(24, 40, generator=torch.Generator().manual_seed(1), requires_grad=True)
    y = model["over_arch"](x)
    y.square().mean().backward()
    return y.detach(), x.grad, model["over_arch"][0].weight.grad
