"""End-to-end comparison: LoKA against bf16 + ``torch.compile`` and other libraries' FP8 training.

For each recipe (``--recipes``, default the GPU-sized ``dlrm_large,dhen_large,dhen_xl,hstu_large,
hstu_xl``), run (``--runs``) and seed (``--seeds``), launches the training job

    torchrun --standalone --nproc_per_node=N -m loka_job.train model=<recipe> device=<device>
        <the run's overrides> train.compile=<mode> seed=<s> train.steps=<n> train.timing_start=<w> ...

with ``LOKA_RUN_DIR`` set to its own folder, one at a time, under a per-run timeout and an
overall deadline; a failing run is recorded (exit status, the last error line, the log's tail)
and the next one starts. From each run's ``summary.json`` it collects the step time over the
timed window (steps ``w+1..n``: median, p10, p90; see ``train.step_sync``), QPS, peak GPU
memory, final eval NE and AUC, and the Dispatch plan (GEMMs in FP8 by backend) or the baseline's
conversion report, and writes

    <out>/<date>-<name>.json   everything, per run and aggregated per recipe x run
    <out>/<date>-<name>.md     the tables, skipped/failed runs with reasons, exact commands
    <out>/<date>-<name>.png    step time (median, p10-p90) and NE vs bf16 per run (matplotlib)

The reference for speed-ups is the best bf16 compile mode: per recipe and seed, the faster of
``bf16_compile`` and ``bf16_compile_cudagraphs`` (``bf16`` if neither completed); the report
names the run it was per seed. Each run's speed-up is the reference's step time over the run's,
averaged over the seeds both completed; the speed-up over eager ``bf16`` is given beside it.
NE vs bf16 is relative to eager ``bf16`` of the same seed, else ``bf16_compile``, else
``bf16_compile_cudagraphs`` (same data and initialization; compiling does not change what is computed), in %: ``100 * (NE_run - NE_bf16) / NE_bf16``, then mean, min
and max over seeds; next to it each run's own seed-to-seed NE spread (sample std over seeds, %
of the mean), to tell a difference from noise. Section "Against the strongest baselines" puts
each LoKA run beside the faster compile mode of the user's job, the faster of torchao's
compiled runs and the faster TE run, with its peak memory, and names the baseline runs the call
left out.

Runs (``--runs``; the compile mode is the job's ``train.compile``: ``none`` is eager;
``default`` is Inductor without CUDA graphs; ``reduce-overhead`` adds CUDA graphs, and Inductor
runs a graph it cannot capture without them, logging why under ``TORCH_LOGS=cudagraphs``):

* ``bf16``: LoKA's model (Mods on) with every GEMM in bf16 (``loka.dispatch.mode=all-bf16``) and
  the embedding comms fixed at fp32 (TorchRec's own), eager;
* ``bf16_compile``, ``bf16_compile_cudagraphs``: the same with ``train.compile=default`` and
  ``train.compile=reduce-overhead``: the same-architecture bf16 reference;
* ``bf16_auto_comms_compile``, ``bf16_auto_comms_compile_cudagraphs``: those with LoKA's embedding
  comms at their default (``auto``): with them the report splits LoKA's gain over the user's job
  into the Mods (user's job -> ``bf16_compile*``), the comms (-> ``bf16_auto_comms_compile*``) and
  the FP8 GEMMs (-> the LoKA run), section "Where LoKA's gain comes from";
* ``plain_compile``, ``plain_compile_cudagraphs``: the user's job unchanged (``loka.enabled=false``:
  no Mods, TorchRec's own comms), compiled: the first reference for speed-ups;
* ``plain_compile_bf16_allreduce``, ``bf16_compile_bf16_allreduce``, ``loka_compile_default_bf16_allreduce``
  (CUDA, several ranks): ``plain_compile``, ``bf16_compile`` and ``loka_compile_default`` with the
  dense gradients' all-reduce in bf16 (``train.dense_allreduce=bf16``: PyTorch's compression hook
  through TorchRec's DDP wrapper), so that the dense comms' gain shows for every model alike;
  ``plain_compile_auto_allreduce``, ``loka_compile_default_auto_allreduce``: the same with
  ``train.dense_allreduce=auto`` (fp32 or bf16, whichever step is faster, checked in the run);
  ``plain_compile_fp8_allreduce``, ``loka_compile_default_fp8_allreduce`` (several ranks, any device):
  with ``train.dense_allreduce=fp8`` (LoKA's FP8 hook, :mod:`loka_torchrec.comms.fp8_allreduce`);
* ``loka_compile_default_export``: ``loka_compile_default`` that also exports its dense modules for
  serving at the end (``train.export_serving``) and evaluates the model served in FP8 and in high
  precision on the same held-out batches: section "Serving what training ran";
* ``bf16_probed_compile_cudagraphs`` (not in the default list): ``bf16_compile_cudagraphs`` with the
  Probe on: it learns, measures the candidates and plans at the end of its warm-up as in
  ``loka_compile``, and Dispatch's static mode keeps every GEMM in bf16: what the learning leaves
  behind in the steady state, apart from any kernel it changes;
* ``bf16_nomods_compile_cudagraphs``, ``bf16_nomods_probed_compile_cudagraphs`` (not in the default
  list): the user's model (no Mods) with LoKA on, every GEMM in bf16, fp32 comms, CUDA graphs, without
  and with the Probe: what LoKA's layers and its learning cost a model beside ``plain_compile_cudagraphs``,
  apart from any FP8 kernel; ``bf16_nomods_probed_offload_compile_cudagraphs`` and
  ``loka_nomods_compile_offload``: the probed one and ``loka_nomods_compile`` with
  ``loka.probe.offload_activations=true`` (the probe steps' saved activations in host memory), for
  the peak memory the eager probe steps set (section "Where the peak memory was set");
* ``bf16_nomods``: the plain model (``loka.enabled=false``), eager;
* ``torchao_tensorwise_compile``, ``torchao_rowwise_compile``: torchao's
  ``convert_to_float8_training`` with its own size filter (``baseline.auto_filter=true``) on the
  dense linears, ``train.compile=reduce-overhead``: the mode the faster bf16 baseline may use,
  so that FP8 is compared at the same host overhead; torchao's dynamic scaling keeps no state
  between steps, so its graphs can be captured. ``..._compile_default`` (not in the default list):
  the same with ``train.compile=default``, for when capturing fails or to separate the two effects;
* ``torchao_tensorwise``, ``torchao_rowwise``, ``torchao_rowwise_with_gw_hp``: torchao eager (not
  in the default list; torchao is meant to be compiled); ``--torchao-auto-filter`` adds its size
  filter (not for gw_hp);
* ``te``: Transformer Engine ``Linear`` + FP8 autocast, ``DelayedScaling`` (TE's default on
  H100), eager; ``te_tensorwise``: the same with ``Float8CurrentScaling`` (not in the default list);
  ``te_compile``: ``te`` with ``train.compile=default`` (Dynamo breaks the graph around TE's
  modules; Inductor fuses the rest). TE's CUDA-graph helper runs on the dense part alone
  (``benchmarks/dense_part_step.py``): the job refuses it (``baseline.cuda_graphs``);
* ``loka_compile``: Probe -> Dispatch -> FP8, Mods on, embedding all-to-all at the default
  (``auto``: fp8 or fp32 per direction, whichever the run's own timing finds faster), with
  ``train.compile=reduce-overhead``; ``loka_compile_default`` (not in the default list): with
  ``train.compile=default``; ``loka_compile_default_current`` (not in the default list): that with
  ``dispatch.forward_scaling=current`` (each FP8 forward operand scaled by its own amax, not the
  default's amax history); ``loka_compile_default_delayed_grads`` (not in the default list): that with
  ``dispatch.grad_scaling=delayed`` (each FP8 ``dy`` scaled by the amax of its layer's earlier backward
  calls, so its cast needs no reduction over ``dy`` first); ``loka_compile_default_loose_gates`` (not in the default list): that
  with the accuracy gates loosened (``dispatch.max_mere=0.5``, ``dispatch.min_grad_sqnr_db=10``),
  to measure what the gates cost in speed and save in NE; ``loka`` (not in the default list): the same, eager;
* ``loka_compile_default_replay`` (not in the default list): a plan replayed with
  ``loka.dispatch.mode=pinned``, Mods on, no Probe, compiled: the chosen plan's steady state without
  the planning steps, so that repeated pairs (A B B A) cost a full LoKA run once. The plan is
  ``--replay-plan`` (a ``dispatch_plan.json`` that a ``loka_compile_default`` run of the same recipe
  and world size wrote), else the one this call's ``loka_compile_default`` run of the same recipe and
  seed wrote (listed before the replays; a replay is skipped, with the reason, if it wrote none);
  ``loka_compile_default_replay_delayed_grads``: the same plan with ``dispatch.grad_scaling=delayed``,
  so that the pair differs in how ``dy`` is scaled alone;
* ``loka_comms_off``: ``loka`` with fp32 embedding comms set explicitly, no timing (not in the default list);
* ``loka_dmpc``: ``loka`` under TorchRec's ``DMPCollection`` with sharding groups of one rank
  (``train.sharding_group_size=1``; CUDA only; not in the default list); ``loka_dmpc2_compile_default``
  and ``bf16_dmpc2_compile``: LoKA and the same-architecture bf16 with groups of two ranks, compiled;
  ``loka_dmpc2_compile_default_replay``: a plan replayed (as ``loka_compile_default_replay``) with groups of two.

A run named ``<run>@<k>`` (``k >= 2``) is the ``k``-th repeat of ``<run>`` in the same call,
with the same configuration, seed and data, e.g. ``--runs bf16_compile_cudagraphs,loka_compile,
loka_compile@2,bf16_compile_cudagraphs@2`` (A B B A: a drift during the call weighs on both). A
repeat's speed-up is against the first run's reference, so a bf16 repeat's is the run-to-run
spread of one configuration: the size a difference must exceed to be LoKA's.

Every run gets ``train.autocast=<--autocast>`` (default bf16: GEMMs left in high precision and
the other dense ops run in bf16 under ``torch.autocast``) and its ``train.compile`` mode (eager runs
say ``none``, so that the job's default does not decide). A run whose library is not installed,
``te`` on ``--device cpu``, or a compiled run where the installed job has no ``train.compile``
option, is skipped with the reason, without launching it.

``--profile-start N --profile-steps K`` (default off) profiles steps ``N..N+K-1`` of every run
(``train.profile_start/profile_steps``; those steps are left out of the step times): the main
table gets each run's GEMM share of the kernel time and the Amdahl ceiling of the step if every
GEMM ran 2x faster, and the section "Where the step goes" gives per run and seed kernel ms per
step, the shares of GEMMs (bf16 + fp8), FP8 quantization, embeddings, communication and the
rest, and the device's idle share (``loka_job/training/profiling.py``). Put the window
after ``--window-start`` (steady state: compiled, CUDA graphs recorded, the plan made), e.g.
``--steps 400 --probe-warmup 100 --profile-start 390 --profile-steps 5``.

On CUDA, ``nvidia-smi`` samples the GPU's SM clock, power and temperature every 200 ms during every
run (``gpu_samples.csv`` in its run folder); the section "The GPU during the timed steps" gives the
samples inside each run's timed window (the job's ``timed_window_unix``): a run that draws more power
may run at a lower clock, which the kernel list alone does not show.

Usage (one H100)::

    python benchmarks/e2e_compare.py --out benchmarks/results/H100 --nproc 1 --seeds 0,1

CPU smoke run (tiny model, eager runs; what ``tests/test_e2e_compare.py`` runs)::

    python benchmarks/e2e_compare.py --device cpu --recipes dlrm --runs bf16,bf16_nomods,loka \\
        --nproc 2 --steps 8 --window-start 4 --probe-warmup 3 --out /tmp/e2e \\
        --override loka.probe.every=1 --override loka.dispatch.min_speedup=0
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple
from loka_torchrec.atomic_files import write_text_atomic

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_RECIPES = ("dlrm_large", "dhen_large", "dhen_xl", "hstu_large", "hstu_xl")
# Two speed references, per recipe and seed the faster compile mode of each that completed:
# the user's job unchanged (LoKA off: no Mods, TorchRec's own comms) + torch.compile, and the same
# architecture as LoKA's runs in bf16 (Mods on, every GEMM bf16), else eager FALLBACK_REFERENCE.
USER_JOB_REFERENCES = ("plain_compile", "plain_compile_cudagraphs")
COMPILED_REFERENCES = ("bf16_compile", "bf16_compile_cudagraphs")
# The same architecture in bf16 with LoKA's embedding comms: the step between the two references and
# LoKA's run in the split of LoKA's gain (section "Where LoKA's gain comes from").
AUTO_COMMS_REFERENCES = ("bf16_auto_comms_compile", "bf16_auto_comms_compile_cudagraphs")
# The same architecture for LoKA's runs without Mods: the user's model with LoKA on and every GEMM
# bf16 (no Probe, fp32 comms). Where it ran, those runs' "same architecture" speed-ups are against it.
NOMODS_REFERENCES = ("bf16_nomods_compile_cudagraphs",)
# The same architecture in bf16 under DMPCollection (groups of two ranks): LoKA's DMPCollection runs
# are against it, since the replicated groups' extra all-reduce is in both.
DMPC_REFERENCES = ("bf16_dmpc2_compile",)
# torchao's compiled runs with its auto filter: the library baseline a user would try first
# (section "Against the strongest baselines"); each recipe in one compile mode or the other.
TORCHAO_RECIPES = (
    ("torchao_tensorwise_compile", "torchao_tensorwise_compile_default"), ("torchao_rowwise_compile", "torchao_rowwise_compile_default"),
)  # fmt: skip
TORCHAO_COMPILED = tuple(name for recipe in TORCHAO_RECIPES for name in recipe)
# Transformer Engine in the job, compiled or eager (its CUDA-graph helper runs on the dense part alone:
# benchmarks/dense_part_step.py).
TE_RUNS = ("te_compile", "te", "te_tensorwise")
FALLBACK_REFERENCE = "bf16"
# NE differences are to the first of these that completed for the same seed (same data; the plain
# model is LoKA's architecture where LoKA runs without Mods).
NE_REFERENCES = ("bf16", "bf16_compile", "bf16_compile_cudagraphs", "plain_compile", "plain_compile_cudagraphs", "bf16_nomods")
COMPILE_MODES = ("none", "default", "reduce-overhead", "max-autotune-no-cudagraphs", "auto")


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One configuration to compare.

    Attributes:
        name: the run's name (``--runs``).
        overrides: Hydra overrides of the training job.
        compile: the job's ``train.compile`` mode (``"none"``: eager).
        library: the Python module the run needs (``None``: only this project).
        pip: how to install ``library``.
        cuda_only: the run cannot work on ``--device cpu``.
    """

    name: str
    overrides: Tuple[str, ...]
    compile: str = "none"
    library: Optional[str] = None
    pip: Optional[str] = None
    cuda_only: bool = False

    def __post_init__(self) -> None:
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"RunSpec.compile: expected one of {COMPILE_MODES}, got {self.compile!r}")


# The Mods of LoKA's runs and of the same architecture in bf16: every mod but no_bias, the one that costs
# eval NE (docs/mods.md). Each run's command in a report names the preset it ran.
MODS_OVERRIDE = "loka.mods.preset=all_but_no_bias"
# The same architecture as LoKA's runs in bf16: Mods on, every GEMM bf16, the embedding comms fixed at
# fp32 (TorchRec's own), so that it differs from LoKA's run by the FP8 GEMMs and LoKA's comms alone.
_FP32_COMMS = ("loka.comms.forward=fp32", "loka.comms.backward=fp32")
_BF16_AUTO_COMMS = ("loka.enabled=true", "loka.dispatch.mode=all-bf16", "loka.probe.enabled=false", MODS_OVERRIDE)
_BF16 = (*_BF16_AUTO_COMMS, *_FP32_COMMS)
_BF16_PROBED = ("loka.enabled=true", "loka.dispatch.mode=all-bf16", "loka.probe.enabled=true", MODS_OVERRIDE, *_FP32_COMMS)
# The user's model (no Mods) with LoKA on and every GEMM in bf16, with and without the Probe.
_BF16_NOMODS = ("loka.enabled=true", "loka.dispatch.mode=all-bf16", "loka.probe.enabled=false", "loka.mods.preset=none", *_FP32_COMMS)
_BF16_NOMODS_PROBED = ("loka.enabled=true", "loka.dispatch.mode=all-bf16", "loka.probe.enabled=true", "loka.mods.preset=none", *_FP32_COMMS)
# DDP's dense gradient all-reduce in bf16 (PyTorch's compression hook through TorchRec), for any run;
# or auto: fp32 or bf16, whichever step is faster (checked after LoKA's own step-time decisions).
_BF16_ALLREDUCE = ("train.dense_allreduce=bf16",)
_AUTO_ALLREDUCE = ("train.dense_allreduce=auto",)
_FP8_ALLREDUCE = ("train.dense_allreduce=fp8",)  # LoKA's FP8 hook (a quarter of fp32's bytes, lossy)
# Comms at the default ("auto": fp8 or fp32 per direction, from a timing of the run's all-to-all),
# so the benchmark measures what a user gets.
_LOKA = ("loka.enabled=true", "loka.probe.enabled=true", MODS_OVERRIDE)
# LoKA as a user switches it on in an existing job (LokaConfig(enabled=True)): the model unchanged.
_LOKA_NOMODS = ("loka.enabled=true", "loka.probe.enabled=true", "loka.mods.preset=none")
_PLAIN = ("loka.enabled=false",)
# A plan written by a LoKA run, loaded as it is: --replay-plan, else the plan this run wrote in the same call.
PLAN_SOURCE_RUN = "loka_compile_default"
_LOKA_REPLAY = ("loka.enabled=true", "loka.probe.enabled=false", MODS_OVERRIDE, "loka.dispatch.mode=pinned")
# The probe steps' saved activations in pinned host memory (the eager steps' peak GPU memory).
_OFFLOAD = "loka.probe.offload_activations=true"
_LOOSE_GATES = ("loka.dispatch.max_mere=0.5", "loka.dispatch.min_grad_sqnr_db=10")


def _torchao(name: str, recipe: str, compile: str = "none", auto_filter: bool = False) -> RunSpec:
    return RunSpec(
        name,
        ("loka.enabled=false", "baseline.kind=torchao", f"baseline.recipe={recipe}",
         *(["baseline.auto_filter=true"] if auto_filter else [])),
        compile=compile,
        library="torchao",
        pip="pip install torchao",
    )  # fmt: skip


def _te(name: str, recipe: str, compile: str = "none") -> RunSpec:
    return RunSpec(
        name,
        ("loka.enabled=false", "baseline.kind=te", f"baseline.recipe={recipe}"),
        compile=compile,
        library="transformer_engine",
        pip="pip install transformer-engine[pytorch]",
        cuda_only=True,
    )


RUNS: Dict[str, RunSpec] = {
    spec.name: spec
    for spec in (
        RunSpec("bf16", _BF16),
        RunSpec("bf16_compile", _BF16, compile="default"),
        RunSpec("bf16_compile_cudagraphs", _BF16, compile="reduce-overhead"),
        RunSpec("bf16_probed_compile_cudagraphs", _BF16_PROBED, compile="reduce-overhead"),
        RunSpec("bf16_nomods_compile_cudagraphs", _BF16_NOMODS, compile="reduce-overhead"),
        RunSpec("bf16_nomods_probed_compile_cudagraphs", _BF16_NOMODS_PROBED, compile="reduce-overhead"),
        RunSpec("bf16_nomods_probed_offload_compile_cudagraphs", (*_BF16_NOMODS_PROBED, _OFFLOAD), compile="reduce-overhead"),
        RunSpec("bf16_auto_comms_compile", _BF16_AUTO_COMMS, compile="default"),
        RunSpec("bf16_auto_comms_compile_cudagraphs", _BF16_AUTO_COMMS, compile="reduce-overhead"),
        RunSpec("bf16_nomods", _PLAIN),
        RunSpec("plain_compile", _PLAIN, compile="default"),
        RunSpec("plain_compile_cudagraphs", _PLAIN, compile="reduce-overhead"),
        _torchao("torchao_tensorwise_compile", "tensorwise", "reduce-overhead", auto_filter=True),
        _torchao("torchao_rowwise_compile", "rowwise", "reduce-overhead", auto_filter=True),
        _torchao("torchao_tensorwise_compile_default", "tensorwise", "default", auto_filter=True),
        _torchao("torchao_rowwise_compile_default", "rowwise", "default", auto_filter=True),
        _torchao("torchao_tensorwise", "tensorwise"),
        _torchao("torchao_rowwise", "rowwise"),
        _torchao("torchao_rowwise_with_gw_hp", "rowwise_with_gw_hp"),
        _te("te", "delayed"),
        _te("te_tensorwise", "tensorwise"),
        _te("te_compile", "delayed", "default"),
        RunSpec("loka", _LOKA),
        RunSpec("loka_compile", _LOKA, compile="reduce-overhead"),
        RunSpec("loka_compile_default", _LOKA, compile="default"),
        RunSpec("loka_nomods_compile", _LOKA_NOMODS, compile="reduce-overhead"),
        RunSpec("loka_nomods_compile_offload", (*_LOKA_NOMODS, _OFFLOAD), compile="reduce-overhead"),
        RunSpec("loka_nomods_compile_default", _LOKA_NOMODS, compile="default"),
        RunSpec("loka_compile_default_current", (*_LOKA, "loka.dispatch.forward_scaling=current"), compile="default"),
        RunSpec("loka_compile_default_delayed_grads", (*_LOKA, "loka.dispatch.grad_scaling=delayed"), compile="default"),
        # The accuracy gates loosened (MERE bound 0.5, gradient floor 10 dB): what the gates cost in
        # speed, and what they save in NE.
        RunSpec("loka_compile_default_loose_gates", (*_LOKA, *_LOOSE_GATES), compile="default"),
        # Multi-rank comparisons: LoKA with TorchRec's own fp32 embedding comms, and LoKA under
        # DMPCollection (2D sparse parallelism: sharding groups of one rank, replicated).
        RunSpec("loka_comms_off", (*_LOKA, *_FP32_COMMS)),
        RunSpec("loka_dmpc", (*_LOKA, "train.sharding_group_size=1"), cuda_only=True),
        RunSpec("loka_dmpc2_compile_default", (*_LOKA, "train.sharding_group_size=2"), compile="default", cuda_only=True),
        RunSpec("bf16_dmpc2_compile", (*_BF16, "train.sharding_group_size=2"), compile="default", cuda_only=True),
        RunSpec("loka_dmpc2_compile_default_replay", (*_LOKA_REPLAY, "train.sharding_group_size=2"), compile="default", cuda_only=True),
        # The dense all-reduce in bf16 (DDP's compression hook), for the user's job, bf16 and LoKA alike.
        RunSpec("plain_compile_bf16_allreduce", (*_PLAIN, *_BF16_ALLREDUCE), compile="default", cuda_only=True),
        RunSpec("bf16_compile_bf16_allreduce", (*_BF16, *_BF16_ALLREDUCE), compile="default", cuda_only=True),
        RunSpec("loka_compile_default_bf16_allreduce", (*_LOKA, *_BF16_ALLREDUCE), compile="default", cuda_only=True),
        RunSpec("plain_compile_auto_allreduce", (*_PLAIN, *_AUTO_ALLREDUCE), compile="default", cuda_only=True),
        RunSpec("plain_compile_fp8_allreduce", (*_PLAIN, *_FP8_ALLREDUCE), compile="default"),
        RunSpec("loka_compile_default_fp8_allreduce", (*_LOKA, *_FP8_ALLREDUCE), compile="default"),
        # LoKA's run that also exports its dense modules for serving at the end and evaluates them
        # (train.export_serving): section "Serving what training ran".
        RunSpec("loka_compile_default_export", (*_LOKA, "train.export_serving=true"), compile="default"),
        # LoKA's plan replayed (--replay-plan, else this call's loka_compile_default run's): the steady
        # state of a plan an earlier run chose, with no Probe and no planning, so that repeated pairs
        # cost one full LoKA run.
        RunSpec("loka_compile_default_replay", _LOKA_REPLAY, compile="default"),
        RunSpec("loka_compile_default_replay_delayed_grads", (*_LOKA_REPLAY, "loka.dispatch.grad_scaling=delayed"), compile="default"),
        RunSpec("loka_compile_default_auto_allreduce", (*_LOKA, *_AUTO_ALLREDUCE), compile="default", cuda_only=True),
    )
}
DEFAULT_RUNS = (
    "bf16", "bf16_compile", "bf16_compile_cudagraphs", "torchao_tensorwise_compile", "torchao_rowwise_compile", "te",
    "te_compile", "loka_compile",
)  # fmt: skip
REPEAT_SEPARATOR = "@"  # ``<run>@<k>``: the k-th run of one configuration in a call (module docstring)


def comms_check_steps() -> int:
    """Steps the check of a compressed ``auto`` comms choice takes at its defaults
    (:mod:`loka_torchrec.comms.step_check`): on several ranks a LoKA run's steady state starts after it."""
    from loka_torchrec.comms.config import CommsConfig
    from loka_torchrec.comms.step_check import CommsStepCheck

    return CommsStepCheck(block=CommsConfig().step_check_steps).total_steps


def plan_trial_steps() -> int:
    """Steps the plan trials take at their defaults, at most (:mod:`loka_torchrec.dispatch.plan_trials`):
    one step-time guard window (settling steps, then timed steps) for each candidate plan, the
    layer-checked, the ranked and the accuracy-gated one, and two for the confirmation of the
    fastest (bf16, then the candidate again)."""
    from loka_torchrec.dispatch.config import DispatchConfig
    from loka_torchrec.dispatch.step_guard import StepTimeGuard

    config, guard = DispatchConfig(), StepTimeGuard()
    return (guard.settle + config.step_guard_window) * (2 + config.ranked_trials + 2 * config.confirm_trials)


def probes(spec: RunSpec) -> bool:
    """Whether the run learns with the Probe (and plans at the end of its warm-up)."""
    return "loka.probe.enabled=true" in spec.overrides


def replays_a_plan(run: str) -> bool:
    """Whether ``run`` pins a plan an earlier LoKA run wrote (``loka_compile_default_replay``, its repeats)."""
    return _is_run(run) and "loka.dispatch.mode=pinned" in run_spec(run).overrides


def replay_plan(args: argparse.Namespace, recipe: str, seed: int) -> str:
    """The plan a replay run pins: ``--replay-plan``, else the one that this call's
    :data:`PLAN_SOURCE_RUN` run of the same recipe and seed wrote (``args.runs_root``)."""
    if args.replay_plan is not None:
        return args.replay_plan
    return os.path.join(args.runs_root, recipe, PLAN_SOURCE_RUN, f"seed{seed}", "dispatch_plan.json")


def without_mods(run: str) -> bool:
    """Whether ``run`` is LoKA on the user's model unchanged (``loka.mods.preset=none``): its same
    architecture in bf16 is :data:`NOMODS_REFERENCES`, not the Mods' ``bf16_compile*``."""
    if not _is_run(run):
        return False
    overrides = run_spec(run).overrides
    return "loka.enabled=true" in overrides and "loka.mods.preset=none" in overrides


def under_dmpc(run: str) -> bool:
    """Whether ``run`` shards with DMPCollection (a ``train.sharding_group_size`` override): its same
    architecture in bf16 is :data:`DMPC_REFERENCES`."""
    return _is_run(run) and any(o.startswith("train.sharding_group_size=") for o in run_spec(run).overrides)


def run_spec(name: str) -> RunSpec:
    """The run ``name`` of :data:`RUNS`, or a repeat of one (``<run>@<k>``, ``k >= 2``).

    Raises:
        KeyError: not a run, or not a valid repeat of one.
    """
    base, sep, repeat = name.partition(REPEAT_SEPARATOR)
    if base not in RUNS or sep and not (repeat.isdigit() and int(repeat) >= 2):
        raise KeyError(name)
    return dataclasses.replace(RUNS[base], name=name) if sep else RUNS[base]


# Runs of the hand-written CUDA-graph machinery, and what replaces each under torch.compile.
_RETIRED_RUNS = {"bf16_graphs": "bf16_compile_cudagraphs", "loka_graphs": "loka_compile", "loka_dense_graphs": "loka_compile"}
# The eager torchao runs that --torchao-auto-filter applies to (the compiled ones always filter).
_TORCHAO_FILTERABLE = ("torchao_tensorwise", "torchao_rowwise")


def _is_run(name: str) -> bool:
    try:
        run_spec(name)
    except KeyError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def job_has_compile_option() -> bool:
    """Whether the installed training job knows ``train.compile`` (its ``recipes/config.yaml``, the
    one ``-m loka_job.train`` composes); a job without it refuses the override."""
    spec = importlib.util.find_spec("loka_job.recipes")
    if spec is None or not spec.submodule_search_locations:
        return False
    from omegaconf import OmegaConf

    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, "config.yaml")
        if os.path.isfile(path):
            train = OmegaConf.load(path).get("train") or {}
            return "compile" in train
    return False


# --------------------------------------------------------------------------------------- arguments
def _names(text: str) -> List[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", default=",".join(DEFAULT_RECIPES), help="model recipes (recipes/model/*.yaml), comma-separated")
    p.add_argument("--runs", default=",".join(DEFAULT_RUNS), help=f"comma-separated subset of {', '.join(RUNS)}")
    p.add_argument("--seeds", default="0,1", help="comma-separated seeds (NE differences are paired by seed)")
    p.add_argument("--steps", type=int, default=600, help="training steps per run")
    p.add_argument(
        "--window-start",
        type=int,
        default=None,
        help="steps after this one are timed (default: the larger of steps/2 and the probe warm-up + 190, for every "
        "run so that invocations compare: a loka run's plan, then its plan trials (5 settling and 50 timed steps "
        "for each of up to 3 candidate plans), come first; with several ranks also the comms step check's steps; "
        "without loka runs, steps/2 where that would not fit)",
    )
    p.add_argument("--probe-warmup", type=int, default=200, help="loka.probe.warmup_steps of the loka run (steps)")
    p.add_argument(
        "--one-seed-runs",
        default="",
        help="comma-separated runs (also in --runs) that run with the first seed only, after all the others",
    )
    p.add_argument("--nproc", type=int, default=1, help="ranks per run (torchrun --nproc_per_node)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--autocast", default="bf16", choices=("bf16", "none"), help="train.autocast of every run")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="train.deterministic=true in every run: NE differences between runs are then the runs', not GPU atomics'",
    )
    p.add_argument(
        "--torchao-auto-filter",
        action="store_true",
        help="torchao's own size filter for the eager torchao_tensorwise, torchao_rowwise runs (the compiled ones always use it)",
    )
    p.add_argument(
        "--profile-start",
        type=int,
        default=0,
        help="profile steps N..N+K-1 of every run (train.profile_start; 0: off); those steps are not timed",
    )
    p.add_argument("--profile-steps", type=int, default=5, help="K: how many steps --profile-start profiles")
    p.add_argument("--override", action="append", default=[], help="an extra Hydra override for every run (repeatable)")
    p.add_argument(
        "--replay-plan", default=None, metavar="JSON",
        help="the dispatch_plan.json that loka_compile_default_replay runs pin (one recipe's plan); default: the plan "
        "this call's loka_compile_default run wrote, when it is listed before them",
    )  # fmt: skip
    p.add_argument("--run-timeout", type=float, default=900.0, help="seconds one run may take")
    p.add_argument("--max-seconds", type=float, default=5400.0, help="overall deadline in seconds; later runs are not started")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"), help="folder for <date>-<name>.json/.md/.png")
    p.add_argument("--runs-dir", default=None, help="folder for the runs' own outputs (default: <out>/<date>-<name>-runs)")
    p.add_argument("--name", default="e2e")
    p.add_argument(
        "--reread", default=None, metavar="JSON",
        help="rebuild an earlier call's report (its .json, .md, .png) from its runs' folders (--runs-dir, default the "
        "folder the JSON names): a run stopped after its last training step counts, with the reason; nothing is run",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.reread is not None and not os.path.isfile(args.reread):
        p.error(f"--reread: expected an earlier call's .json report, got {args.reread!r} (no such file)")
    args.recipes = _names(args.recipes)
    args.runs = _names(args.runs)
    args.one_seed_runs = _names(args.one_seed_runs)
    unknown = [r for r in args.runs + args.one_seed_runs if not _is_run(r)]
    if unknown:
        retired = [r for r in unknown if r in _RETIRED_RUNS]
        hint = f" ({', '.join(retired)}: retired with the hand-written CUDA graphs; see {', '.join(_RETIRED_RUNS[r] for r in retired)})" if retired else ""
        p.error(f"--runs: unknown run(s) {unknown}; choose from {', '.join(RUNS)} (a repeat: <run>@2, @3, ...){hint}")
    replays = [r for r in args.runs + args.one_seed_runs if replays_a_plan(r)]
    if replays and args.replay_plan is None:
        first = min(args.runs.index(r) if r in args.runs else len(args.runs) for r in replays)
        if PLAN_SOURCE_RUN not in args.runs[:first]:
            p.error(
                f"--replay-plan: required by {', '.join(replays)} (the dispatch_plan.json of an earlier LoKA run), "
                f"unless {PLAN_SOURCE_RUN} comes before them in --runs (its plan in this call is then replayed)"
            )
    if args.replay_plan is not None:
        if not os.path.isfile(args.replay_plan):
            p.error(f"--replay-plan: expected a dispatch_plan.json, got {args.replay_plan!r} (no such file)")
        if len(args.recipes) > 1 and replays:
            p.error(f"--replay-plan: one plan fits one model; got --recipes {','.join(args.recipes)}")
        args.replay_plan = os.path.abspath(args.replay_plan)
    repeated = sorted({r for r in args.runs if args.runs.count(r) > 1})
    if repeated:
        p.error(f"--runs: {', '.join(repeated)} listed twice; name a repeat <run>@2, <run>@3, ...")
    try:
        args.seeds = [int(s) for s in _names(args.seeds)]
    except ValueError:
        p.error(f"--seeds: expected comma-separated integers, got {args.seeds!r}")
    if not args.recipes or not args.runs or not args.seeds:
        p.error("--recipes, --runs and --seeds each need at least one value")
    if args.steps < 2:
        p.error(f"--steps: must be >= 2, got {args.steps}")
    if args.nproc < 1:
        p.error(f"--nproc: must be >= 1, got {args.nproc}")
    has_loka = any(probes(run_spec(r)) for r in args.runs)
    if args.window_start is None:
        # After the loka runs' plan (end of the probe's warm-up) and the plan trials' verdict (one
        # step-time guard window per candidate plan), whichever runs are listed: invocations with
        # the same --steps and --probe-warmup time the same steps, so their tables compare. Without
        # loka runs, a window that would not fit falls back to the second half.
        checks = 0
        if args.nproc > 1:  # LoKA's comms check, then the dense all-reduce's where a run has one
            checks = comms_check_steps() * (1 + any("train.dense_allreduce=auto" in run_spec(r).overrides for r in args.runs))
        args.window_start = max(args.steps // 2, args.probe_warmup + plan_trial_steps() + 25 + checks)
        if args.window_start >= args.steps and not has_loka:
            args.window_start = args.steps // 2
        elif args.window_start >= args.steps:
            p.error(
                f"--steps={args.steps}: the loka runs' timed window starts at step {args.window_start + 1}, after "
                f"the probe's warm-up ({args.probe_warmup}) and the plan trials (up to {plan_trial_steps()} steps); "
                f"give --steps > {args.window_start}, or a smaller --probe-warmup"
            )
    if not 0 < args.window_start < args.steps:
        p.error(f"--window-start: must be in [1, --steps={args.steps}), got {args.window_start}")
    if has_loka and args.window_start <= args.probe_warmup:
        p.error(
            f"--window-start={args.window_start} must be after --probe-warmup={args.probe_warmup}: "
            "the loka run plans at the end of the probe's warm-up"
        )
    if args.profile_start < 0 or args.profile_steps < 1:
        p.error(f"--profile-start / --profile-steps: must be >= 0 / >= 1, got {args.profile_start} / {args.profile_steps}")
    if args.profile_start and args.profile_start + args.profile_steps - 1 > args.steps:
        p.error(
            f"--profile-start={args.profile_start} --profile-steps={args.profile_steps}: the last profiled step "
            f"must be <= --steps={args.steps}"
        )
    return args


# --------------------------------------------------------------------------------------- one run
def _torchrun() -> List[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "torch.distributed.run"]


def run_overrides(args: argparse.Namespace, recipe: str, spec: RunSpec, seed: int) -> List[str]:
    """The Hydra overrides of one run, in order (later ones win)."""
    overrides = [f"model={recipe}", f"device={args.device}", *spec.overrides]
    # Eager runs say so too, so that the job's default mode never decides; a job that predates
    # the option gets no override for them (compiled runs are skipped there, see preflight).
    if spec.compile != "none" or job_has_compile_option():
        overrides.append(f"train.compile={spec.compile}")
    if probes(spec):  # every run with the Probe plans at the end of the same warm-up
        overrides.append(f"loka.probe.warmup_steps={args.probe_warmup}")
    if args.torchao_auto_filter and spec.name in _TORCHAO_FILTERABLE:
        overrides.append("baseline.auto_filter=true")
    if replays_a_plan(spec.name):
        overrides.append(f"loka.dispatch.plan_path={replay_plan(args, recipe, seed)}")
    overrides += [
        f"seed={seed}",
        f"train.steps={args.steps}",
        f"train.timing_start={args.window_start}",
        f"train.autocast={args.autocast}",
        "train.progress_bar=false",
        *(["train.deterministic=true"] if args.deterministic else []),
        *profile_overrides(args),
        *args.override,
    ]
    return overrides


def profile_overrides(args: argparse.Namespace) -> List[str]:
    """``train.profile_start/profile_steps`` with ``--profile-start`` (else none: the job's default, off)."""
    if not args.profile_start:
        return []
    return [f"train.profile_start={args.profile_start}", f"train.profile_steps={args.profile_steps}"]


def preflight(args: argparse.Namespace, spec: RunSpec) -> Optional[str]:
    """Why ``spec`` cannot run here (it is then skipped, not launched), or ``None``."""
    if spec.cuda_only and args.device != "cuda":
        return f"{spec.library or spec.name} runs on CUDA only (--device {args.device})"
    if spec.compile != "none" and not job_has_compile_option():
        return (
            f"train.compile={spec.compile}: the installed loka_torchrec has no train.compile option "
            "(its recipes/config.yaml predates it)"
        )
    if spec.library is not None and importlib.util.find_spec(spec.library) is None:
        return f"{spec.library} is not installed: {spec.pip}"
    return None


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop the run's process group (torchrun and its ranks), politely first."""
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


# The job's one-line errors ("error: <what> (<field>)") and the last line of a traceback.
_ERROR_LINE = re.compile(r"^\s*(error: |([A-Za-z_.]*(Error|Exception)|torch\.distributed\.\S+Error)\b).*")


def error_reason(log: str) -> Optional[str]:
    """The most telling line of a failed run's log: the last ``error: ...`` line of the job or
    ``SomethingError: ...`` line that is not torchrun's own ``ChildFailedError`` report."""
    lines = [ln.strip() for ln in log.splitlines() if _ERROR_LINE.match(ln) and "ChildFailedError" not in ln]
    return lines[-1][:500] if lines else None


def launch(args: argparse.Namespace, recipe: str, spec: RunSpec, seed: int, run_dir: str, timeout: float) -> Dict[str, Any]:
    """Run one training job; returns its record (status, reason, command, metrics)."""
    if os.path.isdir(run_dir):
        shutil.rmtree(run_dir)  # a stale summary.json must never be read as this run's
    os.makedirs(run_dir)
    cmd = [*_torchrun(), "--standalone", f"--nproc_per_node={args.nproc}", "-m", "loka_job.train"]
    cmd += run_overrides(args, recipe, spec, seed)
    env = dict(os.environ, LOKA_RUN_DIR=run_dir, PYTHONWARNINGS="ignore")
    record: Dict[str, Any] = {
        "recipe": recipe,
        "run": spec.name,
        "seed": seed,
        "command": f"LOKA_RUN_DIR={shlex.quote(run_dir)} {shlex.join(cmd)}",
        "run_dir": run_dir,
    }
    log_path = os.path.join(run_dir, "launch.log")
    t0 = time.perf_counter()
    timed_out = False
    samples_path = os.path.join(run_dir, "gpu_samples.csv")
    with open(log_path, "w") as log, gpu_sampler(samples_path, enabled=args.device == "cuda"):
        # cwd: the run's folder, so that `-m loka_job.train` is the installed project (or the
        # one on PYTHONPATH), never the source folder, which lacks loka_job.recipes/.kernels.
        proc = subprocess.Popen(cmd, cwd=run_dir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            rc = proc.returncode
    record["seconds"] = time.perf_counter() - t0
    record["returncode"] = rc
    with open(log_path, errors="replace") as f:
        text = f.read()
    status = "timeout" if timed_out else ("ok" if rc == 0 else "failed")
    reason = f"timed out after {timeout:.0f} s" if timed_out else (None if rc == 0 else error_reason(text) or f"exit status {rc}")
    record.update(read_run(run_dir, status, reason, args.steps))
    if record["status"] != "ok":
        record["log_tail"] = text[-3000:]
    return record


def read_run(run_dir: str, status: str, reason: Optional[str], steps: int) -> Dict[str, Any]:
    """A run's status, reason and metrics from its folder, given how its process ended.

    A run whose process ended badly still counts when its ``summary.json`` records every one of
    its ``steps`` training steps: the timed window is complete, and it was stopped after it (by the
    run timeout during the final evaluation, say; the job writes its summary when told to stop).
    Its reason says so. Without a complete summary, the run keeps the status it ended with.
    """
    summary_path = os.path.join(run_dir, "summary.json")
    summary = None
    if os.path.isfile(summary_path):
        with open(summary_path) as f:
            summary = json.load(f)
    if summary is None or (status != "ok" and int(summary.get("steps") or 0) < steps):
        return {"status": "failed" if status == "ok" else status, "reason": reason or "no summary.json written"}
    if status != "ok":
        reason = f"{reason}, after its last training step ({summary.get('steps')}); its summary is complete"
    out = dict(status="ok", reason=reason, **metrics_from_summary(summary))
    out["gpu_window"] = gpu_window(os.path.join(run_dir, "gpu_samples.csv"), summary.get("timed_window_unix"))
    return out


_GPU_FIELDS = ("timestamp", "clocks.sm", "power.draw", "temperature.gpu")


@contextlib.contextmanager
def gpu_sampler(path: str, enabled: bool, period_ms: int = 200):
    """Sample the GPU's SM clock, power draw and temperature into ``path`` (CSV) while the block runs.

    Uses ``nvidia-smi`` (none: nothing is sampled). The clock explains step-time differences that
    the kernels do not: the same kernels run longer at a lower clock (power or thermal limits).
    """
    smi = shutil.which("nvidia-smi") if enabled else None
    if smi is None:
        yield
        return
    with open(path, "w") as out:
        proc = subprocess.Popen(
            [smi, f"--query-gpu={','.join(_GPU_FIELDS)}", "--format=csv,noheader,nounits", f"-lms={period_ms}"],
            stdout=out, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            yield
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def gpu_window(path: str, window: Optional[Sequence[float]]) -> Optional[Dict[str, Any]]:
    """Median SM clock (MHz) and power (W), and the highest temperature (C), of the samples in
    ``path`` taken inside ``window`` (Unix times of the run's timed steps); ``None`` without either."""
    if not window or not os.path.isfile(path):
        return None
    clocks, power, temps = [], [], []
    with open(path, errors="replace") as f:
        for line in f:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) != len(_GPU_FIELDS):
                continue
            try:  # nvidia-smi's timestamp is local time
                t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                values = [float(v) for v in parts[1:]]
            except ValueError:
                continue
            if window[0] <= t <= window[1]:
                clocks.append(values[0])
                power.append(values[1])
                temps.append(values[2])
    if not clocks:
        return None
    return {"sm_clock_mhz": statistics.median(clocks), "power_w": statistics.median(power), "temperature_c_max": max(temps),
            "samples": len(clocks)}  # fmt: skip


def metrics_from_summary(s: Dict[str, Any]) -> Dict[str, Any]:
    """What the comparison keeps of a run's ``summary.json``."""
    out = {
        k: s.get(k)
        for k in (
            "median_step_ms", "p10_step_ms", "p90_step_ms", "mean_step_ms", "timed_steps", "timed_window",
            "qps", "peak_memory_gb", "peak_memory_window_gb", "eval_ne", "eval_auc", "train_ne", "teacher_eval_ne", "world_size", "autocast",
            "host_window", "peak_memory_rises",
        )
    }
    loka = s.get("loka")
    if loka:
        kernels = dict(loka.get("kernels") or {})
        by_backend: Dict[str, int] = {}
        for choice, n in kernels.items():
            backend = choice.split(":", 1)[0]
            by_backend[backend] = by_backend.get(backend, 0) + int(n)
        out["dispatch"] = {
            "summary": loka.get("plan"),
            "fp8_gemms": loka.get("fp8_gemms"),  # in force at the end (the safety valve, the guard)
            "fp8_gemms_planned": loka.get("fp8_gemms_planned", loka.get("fp8_gemms")),
            "gemms": sum(kernels.values()),
            "fp8_by_backend": {b: n for b, n in sorted(by_backend.items()) if b != "bf16"},
            "kernels": kernels,
            "converted_layers": loka.get("converted_layers"),
            "fallen_back": sorted(loka.get("fallen_back") or {}),
            "plan_file": loka.get("plan_file"),
            "layer_checks": loka.get("layer_checks") or [],
            "step_guard_verdicts": loka.get("step_guard_verdicts") or [],
            "plan_trials": loka.get("plan_trials") or [],
            "step_guard": loka.get("step_guard"),
            "seconds": loka.get("seconds"),
            "monitoring": loka.get("monitoring"),
            "planning_peak_rises": loka.get("planning_peak_rises") or [],
        }
    if loka and loka.get("comms"):
        out["comms"] = loka["comms"]  # the precisions in force and how "auto" decided them
    if s.get("dense_allreduce"):
        out["dense_allreduce"] = s["dense_allreduce"]  # DDP's gradient all-reduce: precision on the wire, bucket size
    if s.get("serving"):
        out["serving"] = s["serving"]  # train.export_serving: the programs, and eval NE served in FP8 / high precision
    if s.get("baseline"):
        out["baseline"] = s["baseline"]
    if s.get("profile"):
        out["profile"] = s["profile"]
    if s.get("compile") is not None:  # what the job reports of its torch.compile (mode, recompiles), kept as is
        out["compile"] = s["compile"]
    if s.get("probe_cost"):
        out["probe_cost"] = s["probe_cost"]
    return out


# --------------------------------------------------------------------------------------- aggregation
def _mean(values: List[float]) -> Optional[float]:
    values = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return statistics.fmean(values) if values else None


def _ok(records: List[Dict[str, Any]], recipe: str, run: str) -> Dict[int, Dict[str, Any]]:
    """The completed records of ``run`` on ``recipe``, by seed."""
    return {r["seed"]: r for r in records if r["recipe"] == recipe and r["run"] == run and r["status"] == "ok"}


def speed_references(
    records: List[Dict[str, Any]], recipe: str, runs: Sequence[str] = COMPILED_REFERENCES, fallback_run: Optional[str] = FALLBACK_REFERENCE
) -> Dict[int, Dict[str, Any]]:
    """Per seed, the record speed-ups are measured against: the faster (median step) of the
    completed ``runs`` of that seed (by default ``bf16_compile`` and ``bf16_compile_cudagraphs``),
    else ``fallback_run`` (``bf16``). Seeds with none of them are absent."""
    refs: Dict[int, Dict[str, Any]] = {}
    compiled = [_ok(records, recipe, run) for run in runs]
    fallback = _ok(records, recipe, fallback_run) if fallback_run else {}
    for seed in sorted({s for by_seed in compiled + [fallback] for s in by_seed}):
        timed = [by_seed[seed] for by_seed in compiled if by_seed.get(seed, {}).get("median_step_ms")]
        if timed:
            refs[seed] = min(timed, key=lambda r: r["median_step_ms"])
        elif fallback.get(seed, {}).get("median_step_ms"):
            refs[seed] = fallback[seed]
    return refs


def _named(refs: Dict[int, Dict[str, Any]]) -> Dict[int, Dict[str, Any]]:
    """Per seed, the run a reference is and its median step (what a report says of it), and the file
    it came from where records carry one (``combine_results.py``)."""
    return {seed: {k: r[k] for k in ("run", "median_step_ms", "source") if k in r} for seed, r in refs.items()}


def _speedup(ok: List[Dict[str, Any]], refs: Dict[int, Dict[str, Any]]) -> Optional[float]:
    """Mean reference step time over mean step time of ``ok``, both over the seeds that have a reference."""
    paired = [r for r in ok if r["seed"] in refs and r.get("median_step_ms")]
    mine = _mean([r["median_step_ms"] for r in paired])
    ref_ms = _mean([refs[r["seed"]]["median_step_ms"] for r in paired])
    return ref_ms / mine if ref_ms and mine else None


def _profile_means(ok: List[Dict[str, Any]]) -> Dict[str, Optional[float]]:
    """The GEMM share of the kernel time and the 2x-GEMM Amdahl ceiling, means over profiled seeds."""
    profiles = [r["profile"] for r in ok if r.get("profile")]
    return {
        "gemm_share": _mean([p.get("gemm_share") for p in profiles]),
        "amdahl_2x_gemm_ceiling": _mean([p.get("amdahl_2x_gemm_ceiling") for p in profiles]),
    }


def aggregate(
    records: List[Dict[str, Any]], recipes: List[str], runs: List[str], ne_references: Sequence[str] = NE_REFERENCES
) -> List[Dict[str, Any]]:
    """One row per recipe x run: means over the seeds that ran; speed-ups over the best bf16
    compile mode of the same seed (:func:`speed_references`) and over eager bf16; NE vs the first
    of ``ne_references`` that completed, paired by seed. Every row of a recipe names its per-seed
    reference in ``speed_reference``."""
    rows = []
    for recipe in recipes:
        refs = speed_references(records, recipe)
        user_refs = speed_references(records, recipe, USER_JOB_REFERENCES, None)
        nomods_refs = speed_references(records, recipe, NOMODS_REFERENCES, None)
        dmpc_refs = speed_references(records, recipe, DMPC_REFERENCES, None)
        eager = {s: r for s, r in _ok(records, recipe, FALLBACK_REFERENCE).items() if r.get("median_step_ms")}
        ne_ref: Dict[int, Dict[str, Any]] = {}
        for name in reversed(ne_references):  # the first name that completed wins
            ne_ref.update(_ok(records, recipe, name))
        reference, user_reference = _named(refs), _named(user_refs)
        nomods_reference, dmpc_reference = _named(nomods_refs), _named(dmpc_refs)
        for run in runs:
            if under_dmpc(run) and dmpc_refs:
                own_refs, own_reference, kind = dmpc_refs, dmpc_reference, "dmpc"
            elif without_mods(run) and nomods_refs:
                own_refs, own_reference, kind = nomods_refs, nomods_reference, "nomods"
            else:
                own_refs, own_reference, kind = refs, reference, "mods"
            mine = [r for r in records if r["recipe"] == recipe and r["run"] == run]
            ok = [r for r in mine if r["status"] == "ok"]
            row: Dict[str, Any] = {
                "recipe": recipe,
                "run": run,
                "compile": run_spec(run).compile if _is_run(run) else None,
                "seeds_ok": [r["seed"] for r in ok],
                "status": "ok" if ok and len(ok) == len(mine) else ("partial" if ok else (mine[0]["status"] if mine else "not_run")),
                "reasons": sorted({r["reason"] for r in mine if r.get("reason")}),
                "speed_reference": own_reference,
                "speed_reference_kind": kind,  # mods: bf16_compile*; nomods: LoKA's bf16 on the user's model; dmpc
                "user_job_reference": user_reference,
                "eager_reference": _named(eager),
            }
            for key in ("median_step_ms", "p10_step_ms", "p90_step_ms", "mean_step_ms", "qps", "eval_ne", "eval_auc"):
                row[key] = _mean([r.get(key) for r in ok])
            for key in ("peak_memory_gb", "peak_memory_window_gb"):
                mem = [r[key] for r in ok if r.get(key) is not None]
                row[key] = max(mem) if mem else None
            nes = [r["eval_ne"] for r in ok if r.get("eval_ne") is not None]
            row["ne_seed_spread_pct"] = 100 * statistics.stdev(nes) / statistics.fmean(nes) if len(nes) > 1 else None
            diffs = [
                100 * (r["eval_ne"] - ne_ref[r["seed"]]["eval_ne"]) / ne_ref[r["seed"]]["eval_ne"]
                for r in ok
                if r["seed"] in ne_ref and r.get("eval_ne") is not None and ne_ref[r["seed"]].get("eval_ne")
            ]
            row["ne_vs_bf16_pct"] = _mean(diffs)
            row["ne_vs_bf16_pct_range"] = [min(diffs), max(diffs)] if diffs else None
            row["speedup_vs_reference"] = _speedup(ok, own_refs)
            row["speedup_vs_user_job"] = _speedup(ok, user_refs)
            comms = sorted({r["comms"] for r in ok if r.get("comms")})
            row["comms"] = "; ".join(comms) if comms else None
            row["speedup_vs_bf16"] = _speedup(ok, eager)
            row.update(_profile_means(ok))
            dispatch = [r["dispatch"] for r in ok if r.get("dispatch")]
            if dispatch:
                row["dispatch"] = dispatch[0]["summary"]
                row["fp8_by_backend"] = dispatch[0]["fp8_by_backend"]
                if len({d["summary"] for d in dispatch}) > 1:
                    row["dispatch_per_seed"] = {r["seed"]: r["dispatch"]["summary"] for r in ok}
            baseline = [r["baseline"] for r in ok if r.get("baseline")]
            if baseline:
                b = baseline[0]
                row["baseline"] = (
                    f"{b['kind']}:{b['recipe']}: {b['converted_layers']} layers in FP8, "
                    f"{b['skipped_layers']} in high precision"
                )
            rows.append(row)
    return rows


def reference_words(reference: Dict[Any, Dict[str, Any]]) -> str:
    """``seed 0: `bf16_compile_cudagraphs` (8.28 ms); seed 1: ...``, or why there is none."""
    if not reference:
        return "none (not run, or did not complete): no speed-ups against it"
    return "; ".join(
        f"seed {seed}: `{ref['run']}` ({_fmt(ref['median_step_ms'], '.2f')} ms)" for seed, ref in sorted(reference.items())
    )


# --------------------------------------------------------------------------------------- reports
def _peak(row: Dict[str, Any]) -> str:
    """A run's peak GPU memory over the whole run, and over its timed window in brackets where known."""
    window = row.get("peak_memory_window_gb")
    return _fmt(row.get("peak_memory_gb"), ".2f") + (f" ({window:.2f})" if window is not None else "")


def _fmt(v: Any, spec: str = ".1f") -> str:
    return format(v, spec) if isinstance(v, (int, float)) and math.isfinite(v) else "n/a"


def gpu_section(records: List[Dict[str, Any]]) -> List[str]:
    """Each run's GPU clock, power and temperature over its timed steps (``nvidia-smi`` samples)."""
    sampled = [r for r in records if r.get("gpu_window")]
    if not sampled:
        return []
    lines = [
        "## The GPU during the timed steps",
        "",
        "`nvidia-smi` every 200 ms, samples inside each run's timed window (`gpu_samples.csv` in its run folder).",
        "",
        "| recipe | run | seed | SM clock MHz (median) | power W (median) | max temperature C | samples |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sampled:
        g = r["gpu_window"]
        lines.append(
            f"| {r['recipe']} | {r['run']} | {r['seed']} | {g['sm_clock_mhz']:.0f} | {g['power_w']:.0f} "
            f"| {g['temperature_c_max']:.0f} | {g['samples']} |"
        )
    return lines + [""]


def host_section(records: List[Dict[str, Any]]) -> List[str]:
    """What each run's host did per step of its timed window (``host_window`` in its summary), and
    its CUDA graphs at the end: where two runs with the same kernels differ in step time."""
    counted = [r for r in records if r.get("status") == "ok" and r.get("host_window")]
    if not counted:
        return []
    lines = [
        "## The host during the timed steps",
        "",
        "Per training step of the timed window (profiled steps with the profiler's own work, evaluations and "
        "checkpoints left out): time the loop waited for a batch, CPU time of the training thread and of the whole "
        "process (ms; the difference is other threads'; CUDA spins while the host waits for the GPU, so a thread that "
        "waits for its kernels counts that wait as CPU time), the training thread's "
        "context switches (voluntary / involuntary: preempted), the process's threads at the window's end, Python's "
        "garbage collections (generations 0 / 1 / 2), the CUDA allocator's calls to the driver (`cudaMalloc` / "
        "`cudaFree`) and allocation retries. CUDA graphs: at the run's end, graphs recorded / recordings after the "
        "first (`new_paths`) / re-recordings / graphs run without CUDA graphs (`loka_torchrec.compile.cuda_graph_stats`).",
        "",
        "| recipe | run | seed | batch wait ms | CPU ms: thread / process | switches | threads | GC collections "
        "| cudaMalloc / cudaFree | alloc retries | CUDA graphs: recorded / new paths / re-recorded / skipped |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in counted:
        h = r["host_window"]
        gc_cell = " / ".join(_fmt(h.get(f"gc{g}_per_step"), ".2f") for g in range(3))
        graphs = (r.get("compile") or {}).get("cuda_graphs")
        graphs_cell = " / ".join(str(graphs[k]) for k in ("graphs", "new_paths", "rerecords", "skips")) if graphs else "none"
        switches = f"{_fmt(h.get('thread_switches_voluntary_per_step'), '.1f')} / {_fmt(h.get('thread_switches_involuntary_per_step'), '.2f')}"
        lines.append(
            f"| {r['recipe']} | {r['run']} | {r['seed']} | {_fmt(h.get('data_wait_ms'), '.3f')} "
            f"| {_fmt(h.get('thread_cpu_ms'), '.2f')} / {_fmt(h.get('process_cpu_ms'), '.2f')} | {switches} "
            f"| {_fmt(h.get('threads'), '.0f')} | {gc_cell} "
            f"| {_fmt(h.get('cuda_mallocs_per_step'), '.2f')} / {_fmt(h.get('cuda_frees_per_step'), '.2f')} "
            f"| {_fmt(h.get('alloc_retries_per_step'), '.2f')} | {graphs_cell} |"
        )
    return lines + [""]


def peak_memory_section(records: List[Dict[str, Any]]) -> List[str]:
    """"Where the peak memory was set": per run, rank 0's rises of its peak GPU memory, the last being
    the work that set the whole run's peak (a probe step run eagerly, the planning step, an evaluation)."""
    rows = []
    for r in records:
        rises = r.get("peak_memory_rises") or []
        if r["status"] != "ok" or not rises:
            continue
        earlier = "; ".join(f"{x['at']} {x['gib']:.2f}" for x in rises[:-1])
        planning = _planning_rises_cell((r.get("dispatch") or {}).get("planning_peak_rises"))
        rows.append(
            f"| {r['recipe']} | {r['run']} | {r['seed']} | {rises[-1]['at']} | {rises[-1]['gib']:.2f} | {earlier or '-'} | {planning} |"
        )
    if not rows:
        return []
    return [
        "## Where the peak memory was set",
        "",
        "Rank 0's peak allocated GPU memory (GiB) after each step, evaluation and checkpoint: the work during which it "
        "last rose (where the whole run's peak was set), and its earlier rises. Planning work: inside LoKA's planning, "
        "the Probe's evaluation of a layer, the layer check or the gradient check that raised the peak, by how much "
        "(GiB) and to what, in order (rank 0; the three largest rises of the Probe's evaluations, n/a: not recorded).",
        "",
        "| recipe | run | seed | peak set at | GiB | earlier rises (GiB) | planning work that raised it |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]


def _planning_rises_cell(rises: Optional[List[Dict[str, Any]]]) -> str:
    """The planning phases that raised the peak: the checks all, the Probe's layer evaluations the
    three largest rises (there is one phase per layer), in the order they ran."""
    if rises is None:
        return "n/a"
    evaluations = sorted((x for x in rises if str(x["phase"]).startswith("probe")), key=lambda x: -x["rise_gib"])[3:]
    shown = [x for x in rises if x not in evaluations]
    cells = [f"{x['phase']} +{x['rise_gib']:.2f} to {x['gib']:.2f}" for x in shown]
    if evaluations:
        cells.append(f"{len(evaluations)} smaller evaluation rise(s), +{sum(x['rise_gib'] for x in evaluations):.2f} in all")
    return ("; ".join(cells) or "-").replace("|", "\\|")


def _host_cell(host: Optional[Dict[str, float]]) -> str:
    if not host:
        return "n/a"
    return " / ".join(f"{host[k]:.0f}" for k in ("kernel_launches_per_step", "graph_launches_per_step", "operators_per_step"))


def _ms_cell(record: Optional[Dict[str, Any]]) -> str:
    return f"{record['median_step_ms']:.2f} (`{record['run']}`)" if record else "n/a"


def _ratio(a: Optional[Dict[str, Any]], b: Optional[Dict[str, Any]], key: str = "median_step_ms") -> Optional[float]:
    """``a[key] / b[key]`` (by default the earlier step time over the later: a speed-up), where both are known."""
    if not a or not b or not a.get(key) or not b.get(key):
        return None
    return a[key] / b[key]


def gain_split_section(records: List[Dict[str, Any]], recipes: Sequence[str]) -> List[str]:
    """"Where LoKA's gain comes from": per recipe, LoKA run and seed, the step from the user's job to
    LoKA's in three moves, each the faster compile mode of its runs: the Mods (the user's job ->
    the same architecture in bf16, fp32 comms), LoKA's embedding comms (-> the same in bf16 with
    LoKA's comms) and the FP8 GEMMs (-> the LoKA run). The three ratios multiply to the whole."""
    lines: List[str] = []
    for recipe in recipes:
        user = speed_references(records, recipe, USER_JOB_REFERENCES, None)
        same = speed_references(records, recipe, COMPILED_REFERENCES, None)
        comms = speed_references(records, recipe, AUTO_COMMS_REFERENCES, None)
        loka_bf16 = speed_references(records, recipe, NOMODS_REFERENCES, None)
        loka_runs = sorted({r["run"] for r in records if r["recipe"] == recipe and _is_run(r["run"]) and probes(run_spec(r["run"]))
                            and not r["run"].startswith("bf16")})  # fmt: skip
        rows, nomods_rows = [], []
        for run in loka_runs:
            if without_mods(run) and loka_bf16:  # no Mods: the user's model with LoKA's layers in bf16, then LoKA
                for seed, loka in sorted(_ok(records, recipe, run).items()):
                    if seed not in user or not loka.get("median_step_ms"):
                        continue
                    moves = (_ratio(user.get(seed), loka_bf16.get(seed)), _ratio(loka_bf16.get(seed), loka))
                    nomods_rows.append(
                        f"| {run} | {seed} | {_ms_cell(user.get(seed))} | {_ms_cell(loka_bf16.get(seed))} | {loka['median_step_ms']:.2f} | "
                        + " | ".join(_times(m) for m in moves) + f" | {_times(_ratio(user.get(seed), loka))} |"
                    )
                continue
            for seed, loka in sorted(_ok(records, recipe, run).items()):
                if seed not in user or not loka.get("median_step_ms"):
                    continue
                moves = (_ratio(user.get(seed), same.get(seed)), _ratio(same.get(seed), comms.get(seed)), _ratio(comms.get(seed), loka))
                rows.append(
                    f"| {run} | {seed} | {_ms_cell(user.get(seed))} | {_ms_cell(same.get(seed))} | {_ms_cell(comms.get(seed))} "
                    f"| {loka['median_step_ms']:.2f} | " + " | ".join(_times(m) for m in moves)
                    + f" | {_times(_ratio(user.get(seed), loka))} |"
                )
        if rows or nomods_rows:
            lines += [f"### {recipe}", ""]
        if rows:
            lines += [
                "| LoKA run | seed | user's job ms | + Mods (bf16, fp32 comms) ms | + LoKA's comms ms | + FP8 GEMMs (LoKA) ms "
                "| Mods | comms | FP8 GEMMs | all, vs user's job |",
                "|---|---|---|---|---|---|---|---|---|---|", *rows, "",
            ]  # fmt: skip
        if nomods_rows:
            lines += [
                "LoKA without Mods, in two moves: LoKA on the user's model with every GEMM in bf16 (`bf16_nomods_compile_cudagraphs`: "
                "what LoKA's layers cost, fp32 comms), then LoKA's run (its comms and FP8 GEMMs).", "",
                "| LoKA run | seed | user's job ms | LoKA in bf16 ms | LoKA ms | LoKA's layers in bf16 | comms and FP8 GEMMs | all, vs user's job |",
                "|---|---|---|---|---|---|---|---|", *nomods_rows, "",
            ]  # fmt: skip
    if not lines:
        return []
    return [
        "## Where LoKA's gain comes from",
        "",
        "From the user's job (LoKA off) to LoKA's run in three moves, each ratio the earlier step time over the later "
        "(median ms, the faster compile mode of each; n/a where that run is not in the call): the Mods (the same "
        "architecture in bf16, embedding comms fixed at fp32), LoKA's embedding comms (`auto`), the FP8 GEMMs. "
        "The three multiply to the last column.",
        "",
        *lines,
    ]


def _baseline_cell(best: Optional[Dict[str, Any]], wanted: Sequence[Sequence[str]], ran: Sequence[str]) -> str:
    """The faster of the baseline runs that completed, and which of ``wanted`` did not run (each
    entry: the runs of which any one will do)."""
    if best is None:
        return "not run"
    missing = [group[0] for group in wanted if not any(name in ran for name in group)]
    return _ms_cell(best) + (f"; not run: `{'`, `'.join(missing)}`" if missing else "")


def strongest_baselines_section(records: List[Dict[str, Any]], recipes: Sequence[str]) -> List[str]:
    """"Against the strongest baselines": per recipe, LoKA run and seed, LoKA's step against the
    faster compile mode of the user's job, the faster of torchao's compiled runs (auto filter) and of TE's,
    with peak memory against the user's job's, and the baseline runs that were not in the call
    (a ratio against a weaker baseline than a user would run says so here)."""
    lines: List[str] = []
    for recipe in recipes:
        user = speed_references(records, recipe, USER_JOB_REFERENCES, None)
        torchao_runs = [name for name in TORCHAO_COMPILED if _ok(records, recipe, name)]
        torchao = speed_references(records, recipe, TORCHAO_COMPILED, None)
        te = speed_references(records, recipe, TE_RUNS, None)
        te_runs = [name for name in TE_RUNS if _ok(records, recipe, name)]
        loka_runs = sorted({r["run"] for r in records if r["recipe"] == recipe and r["run"].startswith("loka") and r["status"] == "ok"})
        user_runs = [name for name in USER_JOB_REFERENCES if _ok(records, recipe, name)]
        rows = []
        for run in loka_runs:
            for seed, loka in sorted(_ok(records, recipe, run).items()):
                if not loka.get("median_step_ms"):
                    continue
                mine, theirs, engine = user.get(seed), torchao.get(seed), te.get(seed)
                peak = _ratio(loka, mine, "peak_memory_gb")
                window = _ratio(loka, mine, "peak_memory_window_gb")
                rows.append(
                    f"| {run} | {seed} | {loka['median_step_ms']:.2f} | {_baseline_cell(mine, [(n,) for n in USER_JOB_REFERENCES], user_runs)} "
                    f"| {_times(_ratio(mine, loka))} | {_baseline_cell(theirs, TORCHAO_RECIPES, torchao_runs)} "
                    f"| {_times(_ratio(theirs, loka))} | {_baseline_cell(engine, [TE_RUNS[:1]], te_runs)} | {_times(_ratio(engine, loka))} "
                    f"| {_times(peak)} ({_times(window)}) |"
                )
        if rows:
            lines += [
                f"### {recipe}", "",
                "| LoKA run | seed | LoKA ms | user's job, faster mode ms | vs user's job | torchao, faster ms | vs torchao "
                "| TE, faster ms | vs TE | peak memory vs user's job, whole run (timed window) |",
                "|---|---|---|---|---|---|---|---|---|---|", *rows, "",
            ]  # fmt: skip
    if not lines:
        return []
    return [
        "## Against the strongest baselines",
        "",
        f"Each LoKA run against the faster of the user's job's compile modes (`{'`, `'.join(USER_JOB_REFERENCES)}`) and the "
        "faster of torchao's compiled runs (tensorwise and rowwise, auto filter, either compile mode) and of Transformer "
        f"Engine's (`{'`, `'.join(TE_RUNS)}`; its CUDA-graph helper runs on the dense part alone), in the same call: the "
        "baseline's median step over LoKA's (above 1: LoKA is faster), and LoKA's peak GPU memory over the user's job's "
        "(below 1: LoKA uses less). A baseline run that is not in the call is named: the ratio is then against a "
        "weaker baseline than a user may run.",
        "",
        *lines,
    ]


def repeats_section(records: List[Dict[str, Any]], recipes: Sequence[str]) -> List[str]:
    """"Repeated runs": per recipe and seed, each configuration run more than once in the call
    (``<run>``, ``<run>@2``, ...) with its step times in call order and their spread, then each
    LoKA configuration against each reference (the user's job, the same architecture in bf16)
    where either ran more than once: the ratio of their mean steps and the range of the ratios
    of every pair of their runs. A ratio that moves less than the spread of one configuration
    is not LoKA's."""
    references = (*USER_JOB_REFERENCES, *COMPILED_REFERENCES, *NOMODS_REFERENCES, *DMPC_REFERENCES)
    rows, pairs = [], []
    for recipe in recipes:
        seeds = sorted({r["seed"] for r in records if r["recipe"] == recipe})
        for seed in seeds:
            by_base: Dict[str, List[float]] = {}
            for r in records:
                if r["recipe"] == recipe and r["seed"] == seed and r["status"] == "ok" and r.get("median_step_ms"):
                    by_base.setdefault(r["run"].partition(REPEAT_SEPARATOR)[0], []).append(r["median_step_ms"])
            for base, times in by_base.items():
                if len(times) > 1:
                    spread = max(times) / min(times) - 1
                    rows.append(f"| {recipe} | {seed} | {base} | {' / '.join(f'{t:.2f}' for t in times)} | {statistics.fmean(times):.2f} | {100 * spread:.1f}% |")
            for loka in (b for b in by_base if b.startswith("loka")):
                for ref in (b for b in references if b in by_base and (b in DMPC_REFERENCES) == under_dmpc(loka)):
                    mine, theirs = by_base[loka], by_base[ref]
                    if len(mine) < 2 and len(theirs) < 2:
                        continue
                    ratios = [t / m for t in theirs for m in mine]
                    pairs.append(
                        f"| {recipe} | {seed} | {loka} ({len(mine)}) | {ref} ({len(theirs)}) "
                        f"| {_times(statistics.fmean(theirs) / statistics.fmean(mine))} | {_times(min(ratios))} - {_times(max(ratios))} |"
                    )
    if not rows:
        return []
    lines = [
        "## Repeated runs",
        "",
        "Each configuration that ran more than once in this call (`<run>`, `<run>@2`, ...): its median step of each run, "
        "in call order, their mean, and the spread (slowest over fastest, minus 1).",
        "",
        "| recipe | seed | run | ms/step, each run | mean | spread |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
    ]
    if pairs:
        lines += [
            "LoKA against each reference where either ran more than once (runs of each in brackets): the reference's mean "
            "step over LoKA's, and the range over every pair of their runs.",
            "",
            "| recipe | seed | LoKA run | reference | mean over mean | every pair |",
            "|---|---|---|---|---|---|",
            *pairs,
            "",
        ]
    return lines


def serving_section(records: List[Dict[str, Any]]) -> List[str]:
    """"Serving what training ran": per run that exported (``train.export_serving``), each dense module's
    program and what ran FP8 in it, and eval NE/AUC of the model trained, served (FP8 where it runs) and
    served in high precision, on the same held-out batches; and the served NE against the eval NE of the
    bf16 run of the same recipe and seed (the first of :data:`NE_REFERENCES` that completed), a model
    trained without LoKA."""
    exported = [r for r in records if r.get("status") == "ok" and r.get("serving")]
    if not exported:
        return []
    bf16: Dict[Tuple[str, int], Dict[str, Any]] = {}
    for recipe in {r["recipe"] for r in exported}:
        for name in reversed(NE_REFERENCES):  # the first name that completed wins
            bf16.update({(recipe, seed): ref for seed, ref in _ok(records, recipe, name).items()})
    lines = [
        "## Serving what training ran", "",
        "`train.export_serving`: each dense module as a `torch.export` program, FP8 where the run's plan had it in "
        "force at the end (`loka_torchrec.inference_modules`), checked against the served copy; eval NE (AUC) of the "
        "whole model on the run's held-out batches, trained / served in FP8 / served in high precision.", "",
        "| recipe | run | seed | module | FP8 layers | program checked | NE trained | NE served FP8 | NE served high precision "
        "| NE served FP8 vs high precision % | NE served FP8 vs the bf16 run % |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in exported:
        for name, entry in sorted(r["serving"].items()):
            if not entry.get("exported"):
                lines.append(f"| {r['recipe']} | {r['run']} | {r['seed']} | {name} | not exported: {entry.get('reason')} | | | | | | |")
                continue
            quality = entry.get("eval") or {}
            ne = {k: (quality.get(k) or {}).get("ne") for k in ("trained", "served", "served_high_precision")}
            delta = 100 * (ne["served"] - ne["served_high_precision"]) / ne["served_high_precision"] if ne["served"] and ne["served_high_precision"] else None
            ref = bf16.get((r["recipe"], r["seed"]))
            vs_bf16 = (f"{_fmt(100 * (ne['served'] - ref['eval_ne']) / ref['eval_ne'], '+.3f')} (`{ref['run']}`)"
                       if ne["served"] and ref and ref.get("eval_ne") else "n/a")  # fmt: skip
            lines.append(
                f"| {r['recipe']} | {r['run']} | {r['seed']} | {name} | {entry['summary']} | {'yes' if entry['verified'] else 'NO'} "
                f"| {_fmt(ne['trained'], '.5f')} | {_fmt(ne['served'], '.5f')} | {_fmt(ne['served_high_precision'], '.5f')} | {_fmt(delta, '+.3f')} "
                f"| {vs_bf16} |"
            )
    return lines + [""]


def comms_section(records: List[Dict[str, Any]]) -> List[str]:
    """"What the collectives cost": per profiled multi-rank run and seed, the precisions on the wire
    and the collectives' time per step by kind and phase, and the part no kernel overlapped."""
    profiled = [r for r in records if r.get("status") == "ok" and (r.get("profile") or {}).get("comms")
                and (r.get("world_size") or 1) > 1]  # fmt: skip
    if not profiled:
        return []
    lines = [
        "## What the collectives cost",
        "",
        "Rank 0's profiled steps: the embedding all-to-all (TorchRec's input distribution of the next batch, "
        "started outside the step's forward, and the embeddings' forward and backward exchange) and DDP's dense "
        "all-reduce, ms per step of collective kernels; exposed: the time a collective ran while no other kernel did "
        "(what the step waited on; a late peer shows here too), and its share of the profiled wall time. Embedding "
        "comms: the all-to-all precisions (forward, backward; TorchRec's own fp32 where LoKA is off); dense: the "
        "compression hook DDP runs on the gradients (read from the DDP module) and its bucket size.",
        "",
        "| recipe | run | seed | embedding comms | dense all-reduce | all-to-all fwd / bwd / outside | all-reduce | other "
        "| exposed: all-to-all / all-reduce / all | exposed % of wall |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in profiled:
        c, p = r["profile"]["comms"], r["profile"]
        per, exposed = c["ms_per_step"], c["exposed_ms_per_step"]
        dense = r.get("dense_allreduce") or {}
        hooks = ", ".join(dense.get("comm_hooks") or []) or "fp32 (no hook)"
        if dense.get("auto"):
            verdict = dense["auto"].get("verdict")
            hooks = f"auto: {dense['auto']['in_force']}" + (
                f" ({dense['auto']['candidate']} {verdict['chosen_ms']:.2f} vs fp32 {verdict['fp32_ms']:.2f} ms)" if verdict else " (not checked)"
            )
        bucket = f"{dense['bucket_cap_mb']:g} MiB" if dense.get("bucket_cap_mb") else "n/a"
        a2a = " / ".join(_fmt(per["all_to_all"][phase], ".2f") for phase in ("forward", "backward", "outside"))
        lines.append(
            f"| {r['recipe']} | {r['run']} | {r['seed']} | {r.get('comms') or 'fp32 (TorchRec)'} "
            f"| {hooks}, {bucket} | {a2a} "
            f"| {_fmt(sum(per['all_reduce'].values()), '.2f')} | {_fmt(sum(per['other'].values()), '.2f')} "
            f"| {_fmt(exposed['all_to_all'], '.2f')} / {_fmt(exposed['all_reduce'], '.2f')} / {_fmt(exposed['all'], '.2f')} "
            f"| {_fmt(100 * exposed['all'] / p['wall_ms_per_step'] if p.get('wall_ms_per_step') else None, '.1f')} |"
        )
    return lines + [""]


def profile_section(records: List[Dict[str, Any]]) -> List[str]:
    """"Where the step goes": one row per profiled run and seed (``--profile-start``), else no lines.

    Shares are % of the summed kernel time (rank 0's); "other" is the rest (elementwise ops,
    attention, copies); idle is % of the wall time with no kernel running.
    """
    profiled = [r for r in records if r.get("status") == "ok" and r.get("profile")]
    if not profiled:
        return []
    first = profiled[0]["profile"]
    lines = [
        "## Where the step goes",
        "",
        f"`torch.profiler` over steps {first['steps'][0]}..{first['steps'][1]} of each run ({first['source']}, rank 0; "
        "these steps are left out of the step times above). Shares are % of the summed kernel time; GEMM = bf16 + "
        "fp8; other = elementwise, attention, copies; idle = % of the wall time with no kernel running. "
        "2x-GEMM ceiling: the step's speed-up if every GEMM ran 2x faster, `1 / (1 - f + f/2)` with f the GEMM "
        "share of the kernel time (of the wall time in brackets). Host: what the host did per step (a step "
        "that replays CUDA graphs launches few kernels itself). Per-rank details: `rank<r>/profile.json`.",
        "",
        "| recipe | run | seed | wall ms/step | kernel ms/step | GEMM % (bf16 + fp8) | quantize % | embedding % | comms % | other % | idle % | 2x-GEMM ceiling | host: kernel launches / graph launches / operators per step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in profiled:
        p = r["profile"]
        pct = {c: 100 * v for c, v in p["shares"].items()}
        gemm = pct["gemm_bf16"] + pct["gemm_fp8"]
        other = 100 - gemm - pct["fp8_quantize"] - pct["embedding"] - pct["comms"] if p["kernel_ms_per_step"] > 0 else 0.0
        lines.append(
            f"| {r['recipe']} | {r['run']} | {r['seed']} | {_fmt(p['wall_ms_per_step'], '.2f')} | {_fmt(p['kernel_ms_per_step'], '.2f')} "
            f"| {gemm:.1f} ({pct['gemm_bf16']:.1f} + {pct['gemm_fp8']:.1f}) | {pct['fp8_quantize']:.1f} | {pct['embedding']:.1f} "
            f"| {pct['comms']:.1f} | {other:.1f} | {100 * p['idle_share']:.1f} "
            f"| {_fmt(p['amdahl_2x_gemm_ceiling'], '.3f')}x ({_fmt(p.get('amdahl_2x_gemm_ceiling_wall'), '.3f')}x) "
            f"| {_host_cell(p.get('host'))} |"
        )
    tops = [r for r in profiled if r["profile"].get("top_kernels")]
    if tops:
        lines += ["", "The largest kernels of each profiled run (ms per step, category, name cut at 60 characters):", ""]
        for r in tops:
            top = "; ".join(
                f"{k['ms_per_step']:.2f} {k['category']} `{k['name'][:60]}`" for k in r["profile"]["top_kernels"][:6]
            )
            lines.append(f"- {r['recipe']} {r['run']} seed {r['seed']}: {top}")
    return lines + [""]


def loka_section(records: List[Dict[str, Any]]) -> List[str]:
    """"What LoKA decided": per LoKA run and seed, the layer check, the step-time guard and the Probe's cost."""
    runs = [
        r for r in records
        if r.get("status") == "ok" and r.get("dispatch") and r["run"].startswith("loka")
    ]  # fmt: skip
    if not runs:
        return []
    lines = [
        "## What LoKA decided, and what the Probe cost",
        "",
        "Layer check: FP8 layers timed whole (fwd + bwd) against bf16 right after the plan, kept / checked "
        "(`loka.dispatch.layer_check_reps`). Guard: the step-time guard's verdict, median step in bf16 before the "
        "plan vs with the plan (`loka.dispatch.step_guard_window`); compiled, each candidate plan's median in turn "
        "(plan trials: layer-checked, the best-ranked layers the check sent back (`layer-ranked K/N`), then "
        "accuracy-gated), the fastest one's confirmation against bf16 run next to it (`loka.dispatch.confirm_trials`) "
        "and the one kept. Probe cost: the probe steps' extra time over "
        "nearby plain steps, as a share of this run's step time, and projected for a 100k-step run at the run's "
        "cadence (the warm-up probe steps stand in for monitoring steps the run did not reach; monitoring every N "
        "steps: the interval `loka.probe.monitor_budget` sets for that extra). Plan seconds: host time of the "
        "planning step on rank 0, measuring errors / timing candidates / the layer check.",
        "",
        "| recipe | run | seed | FP8 GEMMs at the end | layer check kept / checked | guard: bf16 -> plan ms | "
        "probe steps extra ms (warm-up, monitoring, plan) | monitoring every N steps | plan seconds (errors, speeds, "
        "layer check) | probe share of this run | projected share, 100k steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        d = r["dispatch"]
        checks = d.get("layer_checks") or []
        kept = sum(1 for c in checks if c.get("kept_fp8"))
        verdicts = d.get("step_guard_verdicts") or []
        guard = "none"
        trials = d.get("plan_trials") or []
        if trials:  # compiled: each candidate plan's median, then the one kept
            tried = [t for t in trials if t.get("event") == "plan_trial"]
            chosen = next((t.get("chosen") for t in trials if t.get("event") == "plan_selected"), "?")
            confirmed = "".join(
                f"; confirmed next to bf16: {t.get('candidate')} {_fmt(t.get('fp8_ms'), '.2f')} vs bf16 {_fmt(t.get('bf16_ms'), '.2f')}"
                for t in trials if t.get("event") == "plan_confirmation"
            )
            guard = f"{_fmt(tried[0].get('bf16_ms'), '.2f')} -> " + ", ".join(
                f"{t.get('candidate')} ({t.get('fp8_gemms')} FP8) {_fmt(t.get('fp8_ms'), '.2f')}" for t in tried
            ) + f"{confirmed}; kept {chosen or 'bf16'}"
        elif verdicts:
            v = verdicts[-1]
            guard = f"{_fmt(v.get('bf16_ms'), '.2f')} -> {_fmt(v.get('fp8_ms'), '.2f')} ({'kept' if v.get('keep_fp8') else 'back to bf16'})"
        cost = r.get("probe_cost") or {}
        measured = cost.get("measured_share")
        projected = cost.get("projected_share")
        secs = d.get("seconds") or {}
        probe_s, dispatch_s = secs.get("probe") or {}, secs.get("dispatch") or {}
        plan_s = "-"
        if probe_s or dispatch_s:
            plan_s = ", ".join(
                _fmt(v, ".1f") for v in (probe_s.get("evaluate_error"), probe_s.get("evaluate_speed"), dispatch_s.get("layer_check"))
            )
        lines.append(
            f"| {r['recipe']} | {r['run']} | {r['seed']} | {d.get('fp8_gemms')}/{d.get('gemms')} | {kept} / {len(checks)} | {guard} "
            f"| {_fmt(cost.get('warmup_extra_ms'), '.1f')}, {_fmt(cost.get('monitoring_extra_ms'), '.1f')}, {_fmt(cost.get('plan_extra_ms'), '.0f')} "
            f"| {_fmt(cost.get('monitoring_interval'), 'd')} | {plan_s} "
            f"| {_fmt(None if measured is None else 100 * measured, '.2f')}% | {_fmt(None if projected is None else 100 * projected, '.2f')}% |"
        )
    return lines + [""]


def _timing_words(overrides: Sequence[str], device: str) -> str:
    """How the runs' step times were taken (``train.step_sync``, ``train.data_workers``), in words."""
    if "train.step_sync=true" in overrides:
        timing = "CUDA-synchronized after each step"
    else:
        timing = "host-clock intervals between step ends, the GPU synchronized before and after the window"
    workers = [o.split("=", 1)[1] for o in overrides if o.startswith("train.data_workers=")]
    in_loop = workers[-1] == "0" if workers else device == "cpu"  # the job's default: workers on CUDA only
    made = "batches made in the loop" if in_loop else "batches made by loader workers"
    return f"{timing}, {made}"


def to_markdown(meta: Dict[str, Any], rows: List[Dict[str, Any]], records: List[Dict[str, Any]]) -> str:
    a = meta["settings"]
    profiled = any(r.get("gemm_share") is not None for r in rows)
    lines = [
        f"# End-to-end comparison, {meta['date']}",
        "",
        f"- device: {meta['device']} ({a['nproc']} rank(s) per run, `--device {a['device']}`)",
        f"- versions: {', '.join(f'{k} {v}' for k, v in meta['versions'].items() if v)}",
        f"- driver: `{meta['command']}`",
        f"- each run: {a['steps']} steps, step time over steps {a['window_start'] + 1}..{a['steps']} "
        f"(median, p10/p90 and mean of per-step times; the mean counts the Probe's monitoring steps, {_timing_words(a.get('override') or [], a['device'])}; rank 0), "
        f"`train.autocast={a['autocast']}`, seeds {', '.join(map(str, a['seeds']))}"
        + (", deterministic kernels (`train.deterministic=true`)" if a.get("deterministic") else ""),
    ]
    if meta.get("reread"):
        lines.append(f"- reread on {meta['reread']['date']} from the runs' folders (`--reread`): runs stopped after their last step count")
    lines += [
        "- compile: each run's `train.compile` mode (none: eager; default: Inductor; reduce-overhead: Inductor "
        "and CUDA graphs), the dense modules compiled, the embeddings eager",
        "- speed-ups: a reference's step time over the run's, mean over the seeds both completed, against three "
        f"references named under each recipe: the user's job (`{'` or `'.join(USER_JOB_REFERENCES)}`, the faster: the "
        "model unchanged, LoKA off, TorchRec's own comms, compiled), the same architecture in bf16 (the faster of "
        f"`{'` and `'.join(COMPILED_REFERENCES)}`, `{FALLBACK_REFERENCE}` if neither completed: Mods on, every GEMM "
        f"bf16, embedding comms fixed at fp32; for LoKA's runs without Mods `{NOMODS_REFERENCES[0]}` where it ran: "
        f"the user's model with LoKA on, every GEMM bf16), and eager `{FALLBACK_REFERENCE}`",
        "- comms: the embedding all-to-all precisions in force (forward, backward) and how `auto` chose them "
        "(LoKA's runs; the others run TorchRec's own fp32 comms)",
        f"- NE vs bf16: relative difference of the final eval NE to the first of `{'`, `'.join(NE_REFERENCES)}` "
        "that completed for the same seed, "
        "mean over seeds [min, max]; NE spread: the run's own seed-to-seed std, % of its mean NE",
        "- FP8: for LoKA runs the Dispatch plan (GEMMs in FP8 of all, by kernel), for baselines the layers converted",
    ]
    if profiled:
        lines.append(
            "- GEMM %: GEMMs' share of the profiled steps' kernel time; 2x ceiling: the step's speed-up if every "
            "GEMM ran 2x faster (section \"Where the step goes\")"
        )
    lines += [f"- total: {meta['seconds']:.0f} s", ""]
    extra_head = " GEMM % | 2x ceiling |" if profiled else ""
    for recipe in a["recipes"]:
        mine = [r for r in rows if r["recipe"] == recipe]
        by_kind: Dict[str, Dict[Any, Dict[str, Any]]] = {}  # each reference kind's (aggregate) first row's
        for r in mine:
            by_kind.setdefault(r["speed_reference_kind"], r["speed_reference"])
        reference = by_kind.get("mods", by_kind.get("nomods", {}))
        nomods, dmpc = by_kind.get("nomods"), by_kind.get("dmpc")
        user_reference = mine[0].get("user_job_reference", {}) if mine else {}
        replayed = sorted({(r["seed"], r["replay_plan"]) for r in records if r["recipe"] == recipe and r.get("replay_plan")})
        lines += [
            f"## {recipe}",
            "",
            f"User's job: {reference_words(user_reference)}. Same architecture in bf16: {reference_words(reference)}."
            + (f" For LoKA's runs without Mods (the user's model): {reference_words(nomods)}." if nomods else "")
            + (f" For the runs under DMPCollection (groups of two ranks): {reference_words(dmpc)}." if dmpc else "")
            + "".join(f" The replay runs of seed {seed} pinned `{plan}`." for seed, plan in replayed),
            "",
            "| run | compile | status | step ms median [p10, p90], mean | vs user's job + compile | vs same-arch bf16 + compile "
            "| vs eager bf16 | QPS | peak GiB (timed window) | eval NE | eval AUC | NE vs bf16 % [min, max] | NE spread % | FP8 | comms |" + extra_head,
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if profiled else ""),
        ]
        for r in mine:
            rng = r["ne_vs_bf16_pct_range"]
            ne_diff = f"{_fmt(r['ne_vs_bf16_pct'], '+.2f')}" + (f" [{rng[0]:+.2f}, {rng[1]:+.2f}]" if rng and len(r["seeds_ok"]) > 1 else "")
            fp8 = r.get("dispatch") or r.get("baseline") or "-"
            line = (
                f"| {r['run']} | {r.get('compile') or '?'} | {r['status']} | {_fmt(r['median_step_ms'], '.2f')} "
                f"[{_fmt(r['p10_step_ms'], '.2f')}, {_fmt(r['p90_step_ms'], '.2f')}], {_fmt(r['mean_step_ms'], '.2f')} "
                f"| {_times(r.get('speedup_vs_user_job'))} | {_times(r.get('speedup_vs_reference'))} | {_times(r.get('speedup_vs_bf16'))} "
                f"| {_fmt(r['qps'], '.0f')} | {_peak(r)} | {_fmt(r['eval_ne'], '.5f')} | {_fmt(r['eval_auc'], '.4f')} "
                f"| {ne_diff} | {_fmt(r['ne_seed_spread_pct'], '.3f')} | {fp8} | {r.get('comms') or ('n/a' if r.get('dispatch') else 'fp32 (TorchRec)')} |"
            )
            if profiled:
                share = r.get("gemm_share")
                line += f" {_fmt(None if share is None else 100 * share, '.1f')} | {_times(r.get('amdahl_2x_gemm_ceiling'))} |"
            lines.append(line)
        lines.append("")
    not_ok = [r for r in records if r["status"] != "ok"]
    if not_ok:
        lines += ["## Runs that did not complete", "", "| recipe | run | seed | status | reason |", "|---|---|---|---|---|"]
        for r in not_ok:
            reason = str(r.get("reason") or "").replace("|", "\\|")
            lines.append(f"| {r['recipe']} | {r['run']} | {r['seed']} | {r['status']} | {reason} |")
        lines.append("")
    lines += strongest_baselines_section(records, a["recipes"])
    lines += repeats_section(records, a["recipes"])
    lines += gain_split_section(records, a["recipes"])
    lines += comms_section(records)
    lines += serving_section(records)
    lines += profile_section(records)
    lines += gpu_section(records)
    lines += host_section(records)
    lines += peak_memory_section(records)
    lines += loka_section(records)
    lines += ["## Commands", "", "```"]
    lines += [r["command"] for r in records if r.get("command")]
    lines += ["```", ""]
    return "\n".join(lines)


def _times(v: Optional[float]) -> str:
    """A speed-up as ``1.234x``, or ``n/a``."""
    return f"{_fmt(v, '.3f')}x" if isinstance(v, (int, float)) and math.isfinite(v) else "n/a"


def plot(path: str, rows: List[Dict[str, Any]], recipes: List[str]) -> Optional[str]:
    """Step time (median, p10-p90 bars) and NE vs bf16 per run and recipe; returns why not, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"matplotlib is not installed ({exc}): pip install matplotlib"
    fig, axes = plt.subplots(2, len(recipes), figsize=(4.5 * len(recipes) + 1, 7), squeeze=False)
    for col, recipe in enumerate(recipes):
        mine = [r for r in rows if r["recipe"] == recipe]
        names = [r["run"] for r in mine]
        x = list(range(len(mine)))
        med = [r["median_step_ms"] if r["median_step_ms"] is not None else 0.0 for r in mine]
        lo = [max(0.0, m - (r["p10_step_ms"] or m)) for m, r in zip(med, mine)]
        hi = [max(0.0, (r["p90_step_ms"] or m) - m) for m, r in zip(med, mine)]
        ax = axes[0][col]
        ax.bar(x, med, yerr=[lo, hi], capsize=3, color=["C0" if r["median_step_ms"] is not None else "lightgray" for r in mine])
        ax.set_title(recipe)
        ax.set_ylabel("step time, ms (median, p10-p90)")
        ax.set_xticks(x, names, rotation=45, ha="right", fontsize=8)
        ax = axes[1][col]
        ne = [r["ne_vs_bf16_pct"] if r["ne_vs_bf16_pct"] is not None else 0.0 for r in mine]
        err_lo = [max(0.0, n - r["ne_vs_bf16_pct_range"][0]) if r["ne_vs_bf16_pct_range"] else 0.0 for n, r in zip(ne, mine)]
        err_hi = [max(0.0, r["ne_vs_bf16_pct_range"][1] - n) if r["ne_vs_bf16_pct_range"] else 0.0 for n, r in zip(ne, mine)]
        ax.bar(x, ne, yerr=[err_lo, err_hi], capsize=3, color="C1")
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_ylabel("eval NE vs bf16, % (seed min-max)")
        ax.set_xticks(x, names, rotation=45, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def _device_name(device: str) -> str:
    if device == "cuda":
        try:
            import torch

            if torch.cuda.is_available():
                return torch.cuda.get_device_name(0)
            return "cuda requested, but torch sees no CUDA device"
        except Exception as exc:  # the report still gets written
            return f"unknown ({type(exc).__name__}: {exc})"
    return f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def _versions() -> Dict[str, Optional[str]]:
    """Installed versions (package metadata; nothing heavy is imported)."""
    versions: Dict[str, Optional[str]] = {"python": platform.python_version()}
    for label, dists in (
        ("torch", ("torch",)),
        ("torchrec", ("torchrec",)),
        ("fbgemm_gpu", ("fbgemm-gpu", "fbgemm-gpu-cpu", "fbgemm_gpu")),
        ("torchao", ("torchao",)),
        ("transformer_engine", ("transformer-engine", "transformer_engine", "transformer-engine-cu12", "transformer_engine_torch")),
        ("loka_torchrec", ("loka-torchrec",)),
    ):
        versions[label] = None
        for dist in dists:
            try:
                versions[label] = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        if commit.returncode == 0:
            versions["git"] = commit.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return versions



# --------------------------------------------------------------------------------------- main
def run_order(args: argparse.Namespace) -> List[Tuple[int, str, str]]:
    """``(seed, recipe, run)`` in launch order: every recipe and run of the first seed before the
    second; the ``--one-seed-runs`` last, with the first seed only (a deadline cuts those first)."""
    repeated = [r for r in args.runs if r not in args.one_seed_runs]
    order = [(seed, recipe, name) for seed in args.seeds for recipe in args.recipes for name in repeated]
    order += [(args.seeds[0], recipe, name) for recipe in args.recipes for name in args.runs if name in args.one_seed_runs]
    return order


def reread_report(json_path: str, runs_dir: Optional[str]) -> int:
    """``--reread``: read each run of an earlier call again from its folder (:func:`read_run`), and
    write that call's report again in place. Runs that completed keep their records."""
    with open(json_path) as f:
        result = json.load(f)
    missing = [k for k in ("settings", "runs", "runs_dir", "date", "device", "versions", "command") if k not in result]
    if missing:
        raise SystemExit(f"--reread: {json_path} is not an e2e_compare report (it lacks {', '.join(missing)})")
    settings = result["settings"]
    runs_dir = os.path.abspath(runs_dir or result["runs_dir"])
    records = result["runs"]
    for r in records:
        run_dir = os.path.join(runs_dir, r["recipe"], r["run"], f"seed{r['seed']}")
        if r["status"] in ("timeout", "failed") and os.path.isdir(run_dir):
            r.update(read_run(run_dir, r["status"], r.get("reason"), int(settings["steps"])))
            print(f"[e2e] reread {r['recipe']} / {r['run']} / seed {r['seed']}: {r['status']} ({r.get('reason')})", flush=True)
    base = json_path[: -len(".json")] if json_path.endswith(".json") else json_path
    meta = {k: v for k, v in result.items() if k not in ("table", "runs", "plot", "plot_skipped")}
    meta["reread"] = {"runs_dir": runs_dir, "date": datetime.date.today().isoformat()}
    write_report(base, meta, records, settings["recipes"], settings["runs"])
    print(f"[e2e] rewrote {base}.json, {base}.md", flush=True)
    return 0


def write_report(base: str, meta: Dict[str, Any], records: List[Dict[str, Any]], recipes: Sequence[str], runs: Sequence[str]) -> None:
    """``<base>.png``, ``<base>.json`` and ``<base>.md`` of ``records`` (each file replaced whole)."""
    rows = aggregate(records, list(recipes), list(runs))
    result = dict(meta, table=rows, runs=records)
    problem = plot(base + ".png", rows, list(recipes)) if records else "no runs"
    result["plot"] = None if problem else base + ".png"
    if problem:
        result["plot_skipped"] = problem
    write_text_atomic(base + ".json", json.dumps(result, indent=1, default=str))
    write_text_atomic(base + ".md", to_markdown(meta, rows, records))


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.reread:
        return reread_report(args.reread, args.runs_dir)
    start = time.perf_counter()
    deadline = start + args.max_seconds
    today = datetime.date.today().isoformat()
    os.makedirs(args.out, exist_ok=True)  # the plot is written before the .json and .md
    base = os.path.join(args.out, f"{today}-{args.name}")
    runs_dir = os.path.abspath(args.runs_dir or f"{base}-runs")
    args.runs_root = runs_dir  # where a replay run finds the plan of this call's LoKA run
    argv_list = list(argv) if argv is not None else sys.argv[1:]
    meta: Dict[str, Any] = {
        "date": today,
        "device": _device_name(args.device),
        "command": shlex.join([os.path.relpath(os.path.abspath(__file__), ROOT), *argv_list]),
        "versions": _versions(),
        "settings": {
            k: getattr(args, k)
            for k in (
                "recipes", "runs", "seeds", "steps", "window_start", "probe_warmup", "nproc", "device", "autocast",
                "torchao_auto_filter", "override", "run_timeout", "max_seconds", "profile_start", "profile_steps",
                "one_seed_runs", "deterministic",
            )
        },
        "runs_dir": runs_dir,
        "run_overrides": {name: [*run_spec(name).overrides, f"train.compile={run_spec(name).compile}"] for name in args.runs},
        "speed_reference": f"per recipe and seed the faster of {', '.join(COMPILED_REFERENCES)}, else {FALLBACK_REFERENCE}",
        "ne_reference": list(NE_REFERENCES),
    }
    records: List[Dict[str, Any]] = []

    def write_reports() -> None:
        meta["seconds"] = time.perf_counter() - start
        write_report(base, meta, records, args.recipes, args.runs)

    for seed, recipe, name in run_order(args):
        spec = run_spec(name)
        run_dir = os.path.join(runs_dir, recipe, name, f"seed{seed}")
        base_record = {"recipe": recipe, "run": name, "seed": seed, "run_dir": run_dir}
        reason = preflight(args, spec)
        if replays_a_plan(name):
            base_record["replay_plan"] = replay_plan(args, recipe, seed)
            if reason is None and not os.path.isfile(base_record["replay_plan"]):
                reason = f"no plan to replay: this call's {PLAN_SOURCE_RUN} run of {recipe}, seed {seed}, wrote none"
        left = deadline - time.perf_counter()
        if reason is not None:
            record = dict(base_record, status="skipped", reason=reason)
        elif left < 30:
            record = dict(base_record, status="not_run", reason=f"overall deadline (--max-seconds={args.max_seconds:.0f}) reached")
        else:
            print(f"[e2e] {recipe} / {name} / seed {seed} ...", flush=True)
            record = launch(args, recipe, spec, seed, run_dir, timeout=min(args.run_timeout, left))
            if "replay_plan" in base_record:
                record["replay_plan"] = base_record["replay_plan"]
        print(
            f"[e2e] {recipe} / {name} / seed {seed}: {record['status']}"
            + (f" ({record['reason']})" if record.get("reason") else "")
            + (
                f", {_fmt(record.get('median_step_ms'), '.2f')} ms/step, eval NE {_fmt(record.get('eval_ne'), '.5f')}"
                if record["status"] == "ok"
                else ""
            ),
            flush=True,
        )
        records.append(record)
        write_reports()  # after every run: a killed driver still leaves its results
    print(f"[e2e] wrote {base}.json, {base}.md, {base}.png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
