"""Dispatch: per GEMM (forward, grad-input, grad-weight) the fastest accurate kernel, else bf16."""

from loka_torchrec.dispatch.config import DispatchConfig
from loka_torchrec.dispatch.dispatcher import Dispatcher
from loka_torchrec.dispatch.layer_kernels import LayerKernels
from loka_torchrec.dispatch.linear import LokaLinear
from loka_torchrec.dispatch.plan import DispatchPlan, InForce, LayerPlan, RoleDecision
from loka_torchrec.dispatch.policy import decide

__all__ = ["DispatchConfig", "DispatchPlan", "InForce", "LayerKernels", "LayerPlan", "RoleDecision", "decide", "Dispatcher", "LokaLinear"]
