"""Parameter sites on a GPU: GEMMs on a module's own Parameters run the real FP8 kernels.

The CPU tests (``test_sites.py``) pin the routing with the emulated backend; here the same kind of
model (an HSTU block written with raw Parameters, ``F.linear``, ``@`` and ``addmm``) runs
``torch._scaled_mm`` on CUDA, eagerly and compiled, against a float64 reference.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import loka_torchrec
from loka_torchrec.dispatch import DispatchConfig
from loka_torchrec.fp8.error_metrics import sqnr_db

pytestmark = pytest.mark.gpu
OUTPUT_DB = 18.0  # the project's floor for an FP8 layer's output against float64


class RawBlock(nn.Module):
    """An HSTU-style block with its own Parameters (dims multiples of 16, as FP8 GEMMs need)."""

    def __init__(self, dim: int = 256, head: int = 64) -> None:
        super().__init__()
        self.head = head
        self._uvqk_weight = nn.Parameter(torch.randn(4 * head, dim) * dim**-0.5)  # F.linear
        self._output_weight = nn.Parameter(torch.randn(head, dim) * head**-0.5)  # x @ W
        self._gate_weight = nn.Parameter(torch.randn(dim, dim) * dim**-0.5)  # addmm
        self._gate_bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u, v, q, k = F.linear(F.layer_norm(x, x.shape[-1:]), self._uvqk_weight).split(self.head, dim=-1)
        attn = F.silu(q @ k.transpose(-1, -2)) / x.shape[1]
        out = x + (F.silu(u) * F.layer_norm(attn @ v, (self.head,))) @ self._output_weight
        gate = torch.addmm(self._gate_bias, out.reshape(-1, out.shape[-1]), self._gate_weight)
        return out + torch.sigmoid(gate).reshape(out.shape)


def make() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(RawBlock(), RawBlock(), nn.Linear(256, 16)).cuda()


def loss_and_grads(model, x):
    model.zero_grad(set_to_none=True)
    y = model(x)
    y.float().square().mean().backward()
    return y, {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("recipe", ["scaled_mm:tensorwise", "scaled_mm:rowwise"])
def test_parameter_sites_run_scaled_mm_eager_and_compiled(recipe):
    torch.manual_seed(1)
    x = torch.randn(8, 64, 256, device="cuda")
    ref = make().double()
    y_ref, g_ref = loss_and_grads(ref, x.double())
    model = make()
    report = loka_torchrec.apply(model, DispatchConfig(mode=f"all:{recipe}"))
    sites = report.dispatcher.managed_layers()
    assert {"0._uvqk_weight", "0._output_weight", "1._gate_weight", "2"} <= set(sites)
    y, g = loss_and_grads(model, x)
    assert all(site.last_rows > 0 for site in sites.values())  # every site ran, in FP8
    assert report.dispatcher.plan.fp8_gemm_count() == 3 * len(sites)
    assert sqnr_db(y.double(), y_ref) >= OUTPUT_DB
    assert all(torch.isfinite(grad).all() for grad in g.values())

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    for _ in range(2):
        y_c, g_c = loss_and_grads(compiled, x)
    assert sqnr_db(y_c.double(), y.double()) >= 30  # the compiled FP8 path computes what eager does
    for name in g:
        assert sqnr_db(g_c[name].double(), g[name].double()) >= 25, name
