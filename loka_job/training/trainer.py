"""The reference training job: TorchRec DMP + TrainPipelineSparseDist, with LoKA by one flag.

``Trainer.__init__`` reads as the list of set-up steps; ``Trainer.fit`` as the loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import statistics
import time
from typing import Any, Callable, ContextManager, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from loka_job.baselines import BaselineConfig
from loka_torchrec.compile import (
    compile_dense, cuda_graph_stats, dense_modules, eager, end_compiled_step, resolve_compile_mode, uses_cuda_graphs,
    wants_static_shapes,
)
from loka_torchrec.prepare import prepare
from loka_torchrec.atomic_files import write_json_atomic
from loka_torchrec.config import LokaConfig
from loka_job.training.checkpoint import resume_checkpoint, save_checkpoint, verify_checkpoint
from loka_job.training.dense_optimizer import dense_adagrad, dense_optimizer_kind
from loka_job.training.distributed import DistContext
from loka_job.training.feature_ids import FeatureIdCheck
from loka_job.training.host_window import HostWindow, TimedBatches
from loka_job.training.memory_trend import MemoryTrend
from loka_job.training.peak_memory import PeakMemoryTrace
from loka_job.training.nonfinite import NonFiniteSteps
from loka_job.training.peer_watchdog import END_OF_RUN, PeerWatchdog
from loka_job.training.preemption import StopSignal
from loka_job.training.profiling import StepProfiler, profile_summary
from loka_job.training.dense_allreduce import DenseAllreduceCheck, register_hooks as register_allreduce_hooks
from loka_job.training.serving_export import (
    captured_inputs, export_serving, high_precision_copies, serving_copies, swapped, write_serving,
)  # fmt: skip
from loka_job.training.sharding import dense_allreduce_in_force
from loka_torchrec.inference import INPUT_SCALINGS

__all__ = ["TrainConfig", "Trainer", "ClickTrainModule", "check_baseline_in_job", "check_baseline_vs_loka", "step_time_stats"]

logger = logging.getLogger("loka_job.train")

AUTOCAST_DTYPES = {"none": None, "bf16": torch.bfloat16}  # train.autocast -> torch.autocast dtype
DENSE_ALLREDUCE_PRECISIONS = ("fp32", "bf16", "fp16", "fp8", "auto")  # train.dense_allreduce


def check_baseline_vs_loka(baseline: BaselineConfig, loka: LokaConfig) -> None:
    """A baseline library and LoKA both convert the dense layers: refuse the two together."""
    if baseline.kind != "none" and loka.enabled:
        raise ValueError(
            f"baseline.kind={baseline.kind} cannot run with loka.enabled=true: a baseline is another "
            "library's FP8 training on the plain model; add loka.enabled=false (or baseline.kind=none)"
        )


def check_baseline_in_job(baseline: BaselineConfig) -> None:
    """Refuse TE's CUDA graphs (``baseline.cuda_graphs``) in the training job.

    Under ``DistributedModelParallel`` the dense parameters are wrapped by DDP, which makes their
    gradient accumulators on the default stream; TE's ``make_graphed_callables`` captures the
    backward on a side stream, where accumulating into those parameters makes the legacy stream
    wait on the capture, which CUDA refuses (``cudaErrorStreamCaptureImplicit``). The graphs run
    on the dense part alone (``benchmarks/dense_part_step.py``, runs ``te*_graphed``).
    """
    if baseline.cuda_graphs:
        raise ValueError(
            "baseline.cuda_graphs=true: TE's CUDA graphs cannot capture the backward of DDP-wrapped parameters in "
            "this DistributedModelParallel job; use baseline.cuda_graphs=false (train.compile=default compiles "
            "around TE's modules)"
        )


def step_time_stats(seconds: List[float]) -> Dict[str, float]:
    """Median, p10, p90 and mean of step times, in milliseconds (NaN without any step).

    Percentiles interpolate linearly between order statistics (``statistics.quantiles``,
    inclusive method); one step gives the same value for all four.
    """
    if not seconds:
        nan = float("nan")
        return {"median_step_ms": nan, "p10_step_ms": nan, "p90_step_ms": nan, "mean_step_ms": nan}
    ms = [1e3 * s for s in seconds]
    deciles = statistics.quantiles(ms, n=10, method="inclusive") if len(ms) > 1 else [ms[0]] * 9
    return {
        "median_step_ms": statistics.median(ms),
        "p10_step_ms": deciles[0],
        "p90_step_ms": deciles[8],
        "mean_step_ms": statistics.fmean(ms),
    }


def enable_determinism() -> None:
    """Deterministic kernels from here on (``train.deterministic``): call before CUDA is used.

    Sets ``CUBLAS_WORKSPACE_CONFIG`` (cuBLAS needs it for reproducible GEMMs; an existing value is
    kept), ``torch.use_deterministic_algorithms(True, warn_only=True)`` and cuDNN's deterministic
    mode without autotuning.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Loop settings (``train.*`` in the recipes).

    Attributes:
        steps: the last step (the step counter continues on resume).
        lr, embedding_lr: dense Adagrad and fused row-wise Adagrad learning rates.
        fused_optimizer: the dense Adagrad's update in one pass over the parameters per step
            instead of one per elementwise operation (:func:`~loka_job.training.dense_optimizer.dense_adagrad`): PyTorch's fused
            Adagrad, or where this PyTorch has none for the device and the job compiles
            (``compile``), the step compiled by Inductor. Same update.
        log_every, eval_every, checkpoint_every: cadences in steps (0: never / at the end).
        resume: a run dir or checkpoint folder to resume from.
        progress_bar: tqdm on rank 0.
        autocast: ``none`` or ``bf16``: run the model's forward (train and eval) under
            ``torch.autocast(device_type, dtype=torch.bfloat16)``, so that GEMMs left in high
            precision compute in bf16 (the loss is computed in fp32 outside).
        timing_start: steps numbered above this one are timed for the summary's step-time
            statistics; 0 skips the first ``min(5, steps_this_run // 4)`` steps of the run.
        profile_start, profile_steps: profile steps ``profile_start .. profile_start +
            profile_steps - 1`` (numbered from 1, as the logs count) with ``torch.profiler`` and
            write where their time went, by kernel category, to ``rank<r>/profile.json``
            (:mod:`loka_job.training.profiling`); 0: off. Profiled steps run slower, so they
            are left out of the step-time statistics and the step-time guard.
        profile_trace: with profiling, also write the Chrome trace ``rank<r>/profile_trace.json``
            (large).
        profile_host_stacks: with profiling, also sample the training thread's Python stack over
            the profiled steps: ``rank<r>/host_stacks.txt``, the host's milliseconds per step by
            function (what makes a host-bound step slower, which kernel profiles do not show).
        sharding_group_size: ``None``: plain ``DistributedModelParallel`` (tables sharded over all
            ranks). An int: TorchRec's ``DMPCollection`` (2D sparse parallelism, CUDA only): tables
            sharded over groups of this many ranks, replicated across the ``world_size //
            sharding_group_size`` groups (:func:`loka_job.training.sharding.shard_model`).
        dense_allreduce: what DDP sends in the dense gradients' all-reduce: ``fp32`` (default:
            the gradients as they are), ``bf16`` or ``fp16`` (PyTorch's compression hooks, which
            TorchRec's ``DefaultDataParallelWrapper`` registers: half the bytes on the wire, the
            sum rounded to 16 bits before it is averaged), ``fp8`` (a quarter of the bytes, the
            values rounded to FP8 twice: :mod:`loka_torchrec.comms.fp8_allreduce`; lossy, so only
            when asked, never chosen by ``auto``), or ``auto``: fp32 or compressed (bf16
            on CUDA, fp16 elsewhere), whichever makes the training step faster, checked in the step
            once LoKA needs no step times (:mod:`loka_job.training.dense_allreduce`; blocks of
            ``dense_allreduce_check_steps``). Independent of LoKA: it changes the user's job and
            LoKA's alike, and reports say which ran.
        dense_allreduce_check_steps: with ``dense_allreduce=auto``, step times per block of the check
            (4 blocks, each after 2 settling steps).
        ddp_bucket_cap_mb: DDP's gradient bucket size in MiB (TorchRec's default 25): smaller
            buckets start the all-reduce earlier in the backward, larger ones send fewer messages.
        sync_every: with ``sharding_group_size``, average the embedding replicas (weights and
            the fused optimizer's state, ``DMPCollection.sync``) every this many steps; the train
            pipeline does it after the backward, where the fused optimizer has already updated
            the tables. Above 1 the replicas drift apart in between (less all-reduce traffic), and
            they are synced before each evaluation.
        data_workers: worker processes that make train batches ahead of the loop
            (:mod:`loka_job.training.prefetch`; batches come in the same order as without
            them, in pinned memory on CUDA). ``None``: 0 on a CPU, on CUDA half of the rank's
            share of the host's cores, 2 to 8 (:func:`~loka_job.training.prefetch.resolve_workers`);
            0 makes each batch in the loop, where its time lands in the step.
        reuse_batches: 0 (default): a new batch every step. ``N > 0``: the first ``N`` batches are
            made once and then cycled (:func:`~loka_job.training.prefetch.reused_batches`), for
            speed benchmarks of models whose batches take longer to make than to train on; the
            model then trains on ``N`` batches only, so its NE is not a normal run's.
        step_sync: ``torch.cuda.synchronize`` at the end of every step, so that each step's time
            holds exactly its own GPU work. It also stops the host from queueing the next step
            while the GPU still runs this one, which a training job never does, so step times
            then add host and GPU time instead of overlapping them. ``False`` (the default): a
            step's time is the interval between two step ends on the host clock, which over a
            window of steps is the loop's real throughput (the GPU is synchronized once before
            the window, and whenever the job itself reads a value back). No effect on a CPU.
        compile: ``torch.compile`` of the model's dense modules (:mod:`loka_torchrec.compile`):
            ``auto`` (``reduce-overhead``, Inductor with CUDA graphs, on CUDA; eager on a CPU),
            ``none``, ``default``, ``reduce-overhead`` or ``max-autotune-no-cudagraphs``. The
            embedding tables stay eager. With LoKA, its layers compile with the rest
            (``dispatch.compiled`` is set), and the steps that need eager hooks (the Probe's,
            and those before a random-evidence plan) run eagerly.
        deterministic: run PyTorch's deterministic kernels where they exist
            (:func:`enable_determinism`), so that two runs of one configuration and seed give the
            same numbers and an NE difference between two configurations is theirs, not the
            GPU's atomics. Kernels without a deterministic version (some of FBGEMM's) warn once and
            run as usual. Slower; for comparisons, not for production.
        max_nonfinite_steps: a step whose loss is inf or NaN (on any rank) is skipped, neither its
            backward nor its optimizer step runs, and counted (``nonfinite_steps`` in the summary);
            this many consecutive ones stop the run with
            :class:`~loka_job.training.nonfinite.NonFiniteLossError` (a non-zero exit naming
            the step, the safety valve's first layer and the last good checkpoint).
        peer_timeout_s: the peer watchdog's bound in seconds
            (:mod:`~loka_job.training.peer_watchdog`): a rank that has waited this long for its
            peers names those that did not arrive (stopped, hung or gone) and ends the job with one
            line. Below the process group's 600 s, which would end it without naming anyone; above
            the longest gap between two steps that is not the same on every rank. 0: no watchdog.
        export_serving: at the end (after the final evaluation), write each dense module as a
            ``torch.export`` program for serving, FP8 where LoKA runs it then
            (:mod:`loka_job.training.serving_export`), to ``RUN_DIR/serving/``.
        serving_input_scaling: ``dynamic`` or ``static`` input scales of the exported FP8 layers
            (:func:`loka_torchrec.inference_modules`).
        serving_rows: the rows of a serving batch (0: off). Given, each layer training runs in FP8 is
            timed forward only at that many rows against high precision (rank 0; every rank takes its
            verdicts) and is exported in FP8 only where it is faster there.
        require_verified_checkpoints: refuse to resume from a checkpoint file whose size and
            SHA-256 ``meta.json`` does not record (format 1); ``False``: load it with a warning
            naming it, after the checks that need no record (zip CRC-32s, keys, shapes, dtypes).
    """

    steps: int = 200
    lr: float = 0.05
    embedding_lr: float = 0.05
    fused_optimizer: bool = True
    log_every: int = 10
    eval_every: int = 0
    checkpoint_every: int = 0
    resume: Optional[str] = None
    progress_bar: bool = True
    autocast: str = "none"
    timing_start: int = 0
    profile_start: int = 0
    profile_steps: int = 5
    profile_trace: bool = False
    profile_host_stacks: bool = False
    sharding_group_size: Optional[int] = None
    dense_allreduce: str = "fp32"
    dense_allreduce_check_steps: int = 10
    ddp_bucket_cap_mb: int = 25
    sync_every: int = 1
    deterministic: bool = False
    data_workers: Optional[int] = None
    reuse_batches: int = 0
    step_sync: bool = False
    max_nonfinite_steps: int = 10
    compile: str = "auto"
    peer_timeout_s: float = 300.0
    require_verified_checkpoints: bool = False
    export_serving: bool = False
    serving_input_scaling: str = "dynamic"
    serving_rows: int = 0

    def __post_init__(self) -> None:
        from loka_torchrec.compile import COMPILE_MODES

        if self.compile not in COMPILE_MODES:
            raise ValueError(f"train.compile: expected one of {', '.join(COMPILE_MODES)}, got {self.compile!r}")
        # Types first, so that a wrong type is named as itself and not as a failed comparison.
        for name in ("steps", "log_every", "eval_every", "checkpoint_every", "timing_start", "profile_start",
                     "profile_steps", "max_nonfinite_steps", "reuse_batches"):  # fmt: skip
            value = getattr(self, name)
            if type(value) is not int:
                raise ValueError(f"train.{name}: expected an int, got {value!r}")
        for name in ("lr", "embedding_lr"):
            value = getattr(self, name)
            if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"train.{name}: expected a finite number > 0, got {value!r}")
        if self.resume is not None and not isinstance(self.resume, str):
            raise ValueError(f"train.resume: expected null or a path, got {self.resume!r}")
        for name in ("steps", "log_every", "max_nonfinite_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("deterministic", "step_sync", "progress_bar", "profile_trace", "profile_host_stacks", "fused_optimizer",
                     "require_verified_checkpoints", "export_serving"):  # fmt: skip
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"train.{name}: expected true or false, got {getattr(self, name)!r}")
        if self.data_workers is not None and (type(self.data_workers) is not int or self.data_workers < 0):
            raise ValueError(
                f"train.data_workers: expected null (the default: 0 on a CPU, 2 to 8 on CUDA) or an int >= 0, got {self.data_workers!r}"
            )
        timeout = self.peer_timeout_s
        if type(timeout) not in (int, float) or not math.isfinite(timeout) or timeout < 0:
            raise ValueError(f"train.peer_timeout_s: expected a number of seconds >= 0 (0: no watchdog), got {timeout!r}")
        if type(self.serving_rows) is not int or self.serving_rows < 0:
            raise ValueError(f"train.serving_rows: expected the rows of a serving batch, an int >= 0 (0: off), got {self.serving_rows!r}")
        if self.serving_input_scaling not in INPUT_SCALINGS:
            raise ValueError(
                f"train.serving_input_scaling: expected one of {', '.join(INPUT_SCALINGS)}, got {self.serving_input_scaling!r}"
            )
        if self.dense_allreduce not in DENSE_ALLREDUCE_PRECISIONS:
            raise ValueError(
                f"train.dense_allreduce: expected one of {', '.join(DENSE_ALLREDUCE_PRECISIONS)}, got {self.dense_allreduce!r}"
            )
        if type(self.dense_allreduce_check_steps) is not int or self.dense_allreduce_check_steps < 1:
            raise ValueError(
                f"train.dense_allreduce_check_steps: expected an int >= 1 (steps per block), got {self.dense_allreduce_check_steps!r}"
            )
        if type(self.ddp_bucket_cap_mb) is not int or self.ddp_bucket_cap_mb < 1:
            raise ValueError(f"train.ddp_bucket_cap_mb: expected an int >= 1 (MiB), got {self.ddp_bucket_cap_mb!r}")
        if self.autocast not in AUTOCAST_DTYPES:
            raise ValueError(f"train.autocast: expected one of {', '.join(AUTOCAST_DTYPES)}, got {self.autocast!r}")
        for name, allow_null in (("sharding_group_size", True), ("sync_every", False)):
            value = getattr(self, name)
            if not (value is None and allow_null) and (type(value) is not int or value < 1):
                expected = "null or an int >= 1 (ranks per sharding group)" if allow_null else "an int >= 1"
                raise ValueError(f"train.{name}: expected {expected}, got {value!r}")
        if self.timing_start < 0 or self.timing_start >= self.steps:
            raise ValueError(
                f"train.timing_start: must be >= 0 and < train.steps={self.steps}, got {self.timing_start}"
            )
        for name in ("eval_every", "checkpoint_every", "reuse_batches"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name}: must be >= 0, got {getattr(self, name)}")
        if self.resume is not None and not os.path.exists(self.resume):
            raise ValueError(f"train.resume: {self.resume!r} does not exist")
        if self.profile_start < 0:
            raise ValueError(f"train.profile_start: must be >= 0 (0: no profiling), got {self.profile_start}")
        if self.profile_steps < 1:
            raise ValueError(f"train.profile_steps: must be >= 1, got {self.profile_steps}")
        if self.profile_start and self.profile_start + self.profile_steps - 1 > self.steps:
            raise ValueError(
                f"train.profile_start + train.profile_steps - 1: the last profiled step must be <= "
                f"train.steps={self.steps}, got {self.profile_start} + {self.profile_steps} - 1"
            )


class ClickTrainModule(nn.Module):
    """``batch -> (loss, (loss, logits, labels))``: the contract of TorchRec's train pipelines.

    Args:
        model: ``(dense_features, sparse_features) -> logits``.
        autocast_dtype: run ``model`` under ``torch.autocast(device_type)`` with this dtype
            (``None``: off); the loss is computed in fp32 outside it.
        device_type: ``"cuda"`` or ``"cpu"``, the model's (a plain string: TorchRec's pipeline
            traces this forward with ``torch.fx``, where tensor attributes are proxies).
        forward_context: a factory of one more context ``model`` runs in, a fresh one per call
            (a baseline's, e.g. Transformer Engine's FP8 autocast).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        autocast_dtype: Optional[torch.dtype] = None,
        forward_context: Optional[Callable[[], ContextManager]] = None,
        device_type: str = "cpu",
    ) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = nn.BCEWithLogitsLoss()
        self.autocast_dtype = autocast_dtype
        self.forward_context = forward_context
        self.device_type = device_type

    def forward(self, batch):
        dense = batch.dense_features
        with contextlib.ExitStack() as stack:
            if self.autocast_dtype is not None:
                stack.enter_context(torch.autocast(self.device_type, dtype=self.autocast_dtype))
            if self.forward_context is not None:
                stack.enter_context(self.forward_context())
            logits = self.model(dense, batch.sparse_features)
        loss = self.loss_fn(logits.float(), batch.labels.float())
        return loss, (loss.detach(), logits.detach(), batch.labels.detach())


class Trainer:
    """Build everything for one run (see the module docstring).

    Args:
        ctx: the process group context.
        model: the unsharded model (embedding tables on ``meta``).
        train_data, eval_data: callables ``(start_batch) -> iterator of Batch``.
        train_config: loop settings.
        loka_config: LoKA settings; ``enabled=False`` trains the plain model.
        run_dir: the run's output folder (same on every rank).
        batch_size: per-rank batch size (for QPS and the planner).
        baseline_config: another library's FP8 training on the dense layers
            (:mod:`loka_job.baselines`); only with ``loka_config.enabled=False``.
        teacher_ne: the best NE reachable on the eval split (reported next to the run's own), if known.
        train_split: the train split with random access by batch index, for ``train.data_workers``
            (:class:`~loka_job.training.prefetch.RandomAccessSplit`); ``None``: batches come
            from ``train_data``, made in the loop.
        checkpoint_config: what the state depends on beyond the model's own shapes (model name
            and options, tables, LoKA's mods), JSON: recorded in each checkpoint's ``meta.json``
            and checked against the checkpoint on resume.
        stop_signal: SIGTERM's handler (:mod:`~loka_job.training.preemption`): a signal on any
            rank stops every rank after the same step, with a final checkpoint and a summary.
        watchdog: told each step this rank finishes (:mod:`~loka_job.training.peer_watchdog`).
    """

    def __init__(
        self,
        ctx: DistContext,
        model: nn.Module,
        *,
        train_data,
        eval_data,
        train_config: TrainConfig,
        loka_config: LokaConfig,
        run_dir: str,
        batch_size: int,
        baseline_config: Optional[BaselineConfig] = None,
        teacher_ne: Optional[float] = None,
        train_split=None,
        checkpoint_config: Optional[Dict[str, Any]] = None,
        stop_signal: Optional[StopSignal] = None,
        watchdog: Optional[PeerWatchdog] = None,
    ) -> None:
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
        from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
        from torchrec.optim.optimizers import in_backward_optimizer_filter

        from loka_job.training.metrics import BinaryClassificationMetrics
        from loka_job.training.sharding import SYNC_INTERVAL_ARG, default_sharders, shard_model

        self.ctx, self.cfg, self.loka_cfg, self.run_dir = ctx, train_config, loka_config, run_dir
        self.batch_size = batch_size
        self.teacher_ne = teacher_ne
        self.train_data, self.eval_data, self.train_split = train_data, eval_data, train_split
        self.checkpoint_config, self.stop_signal, self.watchdog = checkpoint_config, stop_signal, watchdog
        self.rank_dir = os.path.join(run_dir, f"rank{ctx.rank}")
        os.makedirs(self.rank_dir, exist_ok=True)
        baseline_config = baseline_config or BaselineConfig()
        check_baseline_vs_loka(baseline_config, loka_config)
        self.compile_mode = resolve_compile_mode(train_config.compile, ctx.device)
        check_baseline_in_job(baseline_config)
        # 1. LoKA, as any TorchRec job turns it on (loka_torchrec.prepare): mods, conversion, Probe,
        #    Dispatch and the compile of the dense modules, on the unsharded model before DMP wraps it.
        self.loka = None
        if loka_config.enabled:
            self.loka = prepare(
                model, loka_config, run_dir=run_dir, compile=train_config.compile, device=ctx.device, batch_size=batch_size
            )
            self.loka_cfg = self.loka.config
            if ctx.is_main:
                logger.info("%s", self.loka)
        # 1b. Or a baseline: another library's FP8 on the dense layers, same place in the set-up.
        self.baseline = None
        if baseline_config.kind != "none":
            from loka_job.baselines import apply_baseline

            self.baseline = apply_baseline(model, baseline_config)
            if ctx.is_main:
                logger.info("%s", self.baseline)
        # 1c. Without LoKA, torch.compile of the dense modules here (in place: names and
        #     state_dict keys unchanged).
        self.compiled_modules: List[str] = [] if self.loka is None else self.loka.compiled_modules
        self.compile_static_shapes = wants_static_shapes(model)  # as compile_dense decides it
        if self.compile_mode is not None and self.loka is None:
            # Transformer Engine's modules do not trace whole: let Dynamo break the graph around them.
            fullgraph = baseline_config.kind != "te"
            self.compiled_modules = compile_dense(model, self.compile_mode, fullgraph=fullgraph)
        # 1d. The tables' sizes, for the check of every batch's ids before the lookup.
        self.feature_ids = FeatureIdCheck.of_model(model)
        # 2. Sharders: LoKA's, with its embedding comm codecs; TorchRec's own without LoKA.
        sharders = default_sharders() if self.loka is None else self.loka.sharders()
        # 3. Shard with TorchRec's planner and DMP (DMPCollection with train.sharding_group_size);
        #    fused row-wise Adagrad for embeddings.
        self.module = ClickTrainModule(
            model,
            autocast_dtype=AUTOCAST_DTYPES[train_config.autocast],
            forward_context=None if self.baseline is None else self.baseline.forward_context,
            device_type=ctx.device.type,
        )
        self.model, self.sharding_plan = shard_model(
            self.module,
            device=ctx.device,
            world_size=ctx.world_size,
            local_world_size=ctx.local_world_size,
            batch_size=batch_size,
            embedding_lr=train_config.embedding_lr,
            sharders=sharders,
            sharding_group_size=train_config.sharding_group_size,
            # auto and fp8 register their own hook on TorchRec's DDP module below
            dense_allreduce="fp32" if train_config.dense_allreduce in ("auto", "fp8") else train_config.dense_allreduce,
            ddp_bucket_cap_mb=train_config.ddp_bucket_cap_mb,
        )
        self.dense_check = self._dense_allreduce_check(train_config)
        # 4. Dense optimizer + the fused embedding optimizer behind one interface.
        def make_dense_optimizer(params) -> torch.optim.Adagrad:
            self.dense_optimizer = dense_adagrad(
                params, lr=train_config.lr, fused=train_config.fused_optimizer, compiled=self.compile_mode is not None
            )
            return self.dense_optimizer

        dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(self.model.named_parameters())), make_dense_optimizer)
        self.optimizer = CombinedOptimizer([self.model.fused_optimizer, dense])
        # 5. The pipeline overlaps input distribution with compute; under DMPCollection it also
        #    syncs the embedding replicas every train.sync_every steps (after the backward).
        replica_sync = {}
        if train_config.sharding_group_size is not None:
            replica_sync = {SYNC_INTERVAL_ARG: train_config.sync_every}
        self.pipeline = TrainPipelineSparseDist(
            self.model, self.optimizer, ctx.device, execute_all_batches=True, **replica_sync
        )
        # 6. Every rank runs the same plan before the first step.
        self.probe = None if self.loka is None else self.loka.probe
        if self.loka is not None:
            self.loka.start()
        # 7. Metrics, and the state resumed from a checkpoint.
        self.train_metrics = BinaryClassificationMetrics(ctx.device)
        self.eval_metrics = BinaryClassificationMetrics(ctx.device)
        self.start_step = 0
        self.history: list = []
        self.nonfinite = NonFiniteSteps(train_config.max_nonfinite_steps)  # skipped steps (resumed too)
        self.memory_trend = MemoryTrend()  # GPU memory that grows at every step: warned once
        self._peak_before_window: Optional[int] = None  # the run's peak memory before the timed window
        self.peak_trace = PeakMemoryTrace()  # where that peak was set: a step, an evaluation, a checkpoint
        self.last_checkpoint: Optional[str] = None
        if train_config.resume:
            self._resume(train_config.resume)
        # 8. The "auto" comms precisions, from a short timing of the all-to-all (restored on resume;
        #    logged by the library).
        if self.loka is not None:
            self.loka.decide_comms()

    # ------------------------------------------------------------------ set-up helpers
    def _step_profiler(self) -> Optional[StepProfiler]:
        """The profiler of ``train.profile_start``'s window, or ``None`` (off, or a resumed run past it)."""
        cfg = self.cfg
        if not cfg.profile_start:
            return None
        if cfg.profile_start <= self.start_step:
            logger.warning("train.profile_start=%d: the run resumes at step %d, after it; nothing is profiled",
                           cfg.profile_start, self.start_step)  # fmt: skip
            return None
        return StepProfiler(
            cfg.profile_start, cfg.profile_steps, device=self.ctx.device, out_dir=self.rank_dir, export_trace=cfg.profile_trace,
            host_stacks=cfg.profile_host_stacks,
        )

    # ------------------------------------------------------------------ loop
    def fit(self) -> Dict[str, Any]:
        """Train to ``train.steps``, evaluate, and return (rank 0: also write) the summary.

        Step times: each step is timed from its start to its end, after a
        ``torch.cuda.synchronize`` on CUDA (so a step's time includes its GPU work, not only the
        host's launch time; the label check of the metrics syncs every step anyway). The summary
        gives median, p10, p90 and mean over the timed window (``train.timing_start``), rank 0's.

        Profiling (``train.profile_start``): steps ``profile_start .. profile_start +
        profile_steps - 1`` run under ``torch.profiler``; they are not timed (neither for the
        statistics nor for the step-time guard), and rank 0's breakdown is the summary's
        ``profile`` (every rank's in ``rank<r>/profile.json``).
        """
        cfg = self.cfg
        batches = TimedBatches(self._train_batches())
        bar = None
        if self.ctx.is_main and cfg.progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=cfg.steps, initial=self.start_step, desc="train", unit="step", dynamic_ncols=True)
        step_times = []
        timed_steps: List[int] = []
        step = self.start_step
        cuda = self.ctx.device.type == "cuda"
        self.model.train()
        if cuda:
            torch.cuda.synchronize(self.ctx.device)
        profiler = self._step_profiler()
        # One all-reduce per step decides, on every rank alike, whether to skip it (non-finite loss)
        # and whether to stop after it (a SIGTERM on any rank).
        stop_requested = None if self.stop_signal is None else lambda: self.stop_signal.requested
        self.nonfinite.install(self.pipeline, stop_requested=stop_requested)
        wall0 = time.perf_counter()
        last_end = wall0  # without train.step_sync a step's time runs from the previous step's end
        # The timed window: steps after first_timed (train.timing_start, or past a few warm-up steps).
        first_timed = cfg.timing_start or self.start_step + min(5, (cfg.steps - self.start_step) // 4)
        window_clock: Dict[str, float] = {}  # Unix times of the timed window's synchronized ends
        # the host's counters over the same window, profiled steps, evaluations and checkpoints left out
        host_window = HostWindow(batches, self.ctx.device)
        profiled_in_window = 0  # profiled steps since the host window left them out
        clock_restarted = False  # other work (eval, checkpoint) ran since the previous step ended
        while step < cfg.steps:
            if profiler is not None:
                if profiler.covers(step + 1):
                    host_window.leave_out()  # the profiled steps and the profiler's own work after them
                profiler.before_step(step + 1)
            t0 = time.perf_counter() if cfg.step_sync else last_end
            eager_step = cuda and self.loka is not None and self.loka.eager_at(step + 1)  # for the peak trace
            # LoKA drives each step as any job's loop does (Loka.step): eager probe steps, plans, the
            # step-time guard (a profiled step, or one after an evaluation or checkpoint, is not timed).
            timed = not clock_restarted and (profiler is None or not profiler.covers(step + 1))
            try:
                with self.loka.step(step + 1, timed=timed) if self.loka is not None else contextlib.nullcontext():
                    loss, logits, labels = self.pipeline.progress(batches)
            except StopIteration:
                break
            step += 1
            clock_restarted = False
            if not self._skipped_nonfinite(step):
                self.train_metrics.update(logits, labels)
            if self.loka is None and uses_cuda_graphs(self.compile_mode):
                end_compiled_step()  # Loka.step does it when LoKA is on
            self._show_plan_if_new(bar)
            if cuda and (cfg.step_sync or step in (first_timed, cfg.steps)):
                torch.cuda.synchronize(self.ctx.device)  # every step, or around the timed window
            if cuda and step == first_timed:  # from here the peak is the steady state's (plans, checks, compiles done)
                self._peak_before_window = torch.cuda.max_memory_allocated(self.ctx.device)
                torch.cuda.reset_peak_memory_stats(self.ctx.device)
            if step in (first_timed, cfg.steps):
                window_clock["start" if step == first_timed else "end"] = time.time()
                if step == first_timed:
                    host_window.open()
                else:
                    host_window.close(steps=cfg.steps - first_timed)
            last_end = time.perf_counter()
            seconds = last_end - t0
            profiled = profiler is not None and profiler.after_step(step)
            if profiled:  # a profiled step is slower: not timed; nor is the profiler's own work after it
                last_end, clock_restarted = self._restart_step_clock(), True
                profiled_in_window += host_window.is_open
                if not profiler.covers(step + 1):
                    host_window.take_back(steps=profiled_in_window)
                    profiled_in_window = 0
            else:
                step_times.append(seconds)
                timed_steps.append(step)
            if self.dense_check is not None:  # the same steps on every rank: LoKA's decisions are agreed
                ready = self.loka is None or self.loka.step_times_free()
                self.dense_check.observe(step, None if profiled or not timed else 1e3 * seconds, ready=ready)
            allocated_gib = torch.cuda.memory_allocated(self.ctx.device) / 2**30 if cuda else None  # host-side: no sync
            self._trace_peak(lambda: self._step_label(step, eager_step))
            if allocated_gib is not None:
                growing = self.memory_trend.observe(step, allocated_gib)
                if growing is not None:
                    logger.warning("train: %s", growing)
            if step % cfg.log_every == 0 or step == cfg.steps:
                record = {"step": step, "loss": float(loss), **{f"train/{k}": v for k, v in self.train_metrics.compute().items()}}
                recent = sorted(step_times[-cfg.log_every:])  # empty when every step so far was profiled
                record["step_time_ms"] = 1e3 * recent[len(recent) // 2] if recent else float("nan")
                if allocated_gib is not None:  # its peak is in the run summary
                    record["gpu_mem_gib"] = allocated_gib
                self._log(record)
                self.train_metrics.reset()
                if bar is not None:
                    bar.set_postfix(loss=f"{record['loss']:.4f}", ne=f"{record.get('train/ne', float('nan')):.4f}")
            if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
                host_window.leave_out()
                self._log({"step": step, **{f"eval/{k}": v for k, v in self.evaluate().items()}})
                last_end, clock_restarted = self._restart_step_clock(), True
                self._trace_peak(lambda: f"evaluation after step {step}")
                host_window.take_back()
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and not self.nonfinite.consecutive:
                host_window.leave_out()
                self.save(step)  # never in a streak of non-finite steps: a checkpoint is a good state
                last_end, clock_restarted = self._restart_step_clock(), True
                self._trace_peak(lambda: f"checkpoint after step {step}")
                host_window.take_back()
            if bar is not None:
                bar.update(1)
            if self.watchdog is not None:
                self.watchdog.reached(step)
            if self.nonfinite.stop_agreed:
                break  # every rank agreed in this step's all-reduce: all stop after it
        train_seconds = time.perf_counter() - wall0
        profile = profiler.finish() if profiler is not None else None  # stops a window the data cut short
        if bar is not None:
            bar.close()
        if self.watchdog is not None:
            self.watchdog.reached(END_OF_RUN)
        # Preempted before the last step: a final checkpoint, no final evaluation (the time left is short).
        preempted = self._stop_for_preemption(step) if self.nonfinite.stop_agreed and step < cfg.steps else None
        final_eval = {} if preempted else self.evaluate(export=cfg.export_serving)
        self._trace_peak(lambda: "the final evaluation" + (" and the serving export" if cfg.export_serving else ""))
        if final_eval:
            self._log({"step": step, **{f"eval/{k}": v for k, v in final_eval.items()}})
        if self.probe is not None:
            self.probe.close()
        steps_run = step - self.start_step
        window = [i for i, n in enumerate(timed_steps) if n > first_timed]
        timed = [step_times[i] for i in window]
        stats = step_time_stats(timed)
        global_batch = self.batch_size * self.ctx.world_size
        last_train = next((r for r in reversed(self.history) if "train/ne" in r), {})
        summary = {
            "steps": step,
            "steps_this_run": steps_run,
            "resumed_from": self.start_step,
            "world_size": self.ctx.world_size,
            "device": str(self.ctx.device),
            **stats,
            "timed_steps": len(timed),
            "timed_window": [timed_steps[window[0]], timed_steps[window[-1]]] if window else None,
            # Unix times bounding the window, to match with device samples
            "timed_window_unix": [window_clock["start"], window_clock["end"]] if len(window_clock) == 2 else None,
            # per training step of that window (profiled steps, evaluations, checkpoints left out):
            # waiting for batches, CPU time, GC collections, CUDA allocator calls
            "host_window": host_window.per_step,
            "qps": 1e3 * global_batch / stats["median_step_ms"] if timed else float("nan"),
            "qps_mean": 1e3 * global_batch / stats["mean_step_ms"] if timed else float("nan"),
            "train_seconds": train_seconds,
            **self._peak_memory_gb(),
            # rank 0's: each rise of its peak and what ran then (the last: where the whole run's was set)
            "peak_memory_rises": self.peak_trace.rises if cuda else None,
            "autocast": cfg.autocast,
            "sharding_group_size": cfg.sharding_group_size,
            "dense_allreduce": {
                "precision": cfg.dense_allreduce, "bucket_cap_mb": cfg.ddp_bucket_cap_mb, **dense_allreduce_in_force(self.model),
                **({} if self.dense_check is None else {"auto": self.dense_check.summary()}),
            },  # fmt: skip
            "sync_every": cfg.sync_every if cfg.sharding_group_size is not None else None,
            "deterministic": cfg.deterministic,
            "compile": self._compile_summary(),
            "step_sync": cfg.step_sync,
            "data_workers": self._data_workers,
            "reuse_batches": self.cfg.reuse_batches,
            "nonfinite_steps": list(self.nonfinite.skipped),
            "train_ne": last_train.get("train/ne"),
            "train_auc": last_train.get("train/auc"),
            "eval_ne": final_eval.get("ne"),
            "eval_auc": final_eval.get("auc"),
            "eval_loss": final_eval.get("loss"),
            "teacher_eval_ne": self.teacher_ne,
            "run_dir": self.run_dir,
            "loka": self._loka_summary(),
            "baseline": None if self.baseline is None else self.baseline.summary(),
            "profile": None if profile is None else profile_summary(profile),
            "serving": getattr(self, "serving", None),
            "probe_cost": self._probe_cost(timed_steps, step_times),
            "preempted": preempted,
        }
        if self.ctx.is_main:
            write_json_atomic(os.path.join(self.run_dir, "summary.json"), summary, default=str)
        if preempted:  # the one line, after the summary is on disk
            logger.warning("train: %s", preempted["line"])
        return summary

    def _stop_for_preemption(self, step: int) -> Dict[str, Any]:
        """After the step every rank agreed to stop at: write and verify the final checkpoint
        (where ``train.checkpoint_every`` is set and the run is not in a streak of non-finite
        steps), and return the summary's ``preempted`` record with its one line."""
        signal_name = self.stop_signal.received if self.stop_signal is not None else None
        signal_name = signal_name or "SIGTERM on another rank"
        folder, problems = None, []
        if not self.cfg.checkpoint_every:
            where = "no checkpoint written (train.checkpoint_every=0): this run cannot be resumed from here"
        elif self.nonfinite.consecutive:
            folder = self.last_checkpoint
            where = f"no checkpoint written during non-finite steps; the last good one is {folder}"
        else:
            if self.last_checkpoint is None or not self.last_checkpoint.endswith(f"step_{step:06d}"):
                self.save(step)
            folder = self.last_checkpoint
            problems = verify_checkpoint(folder, rank=self.ctx.rank, world_size=self.ctx.world_size)
            if problems:
                where = f"checkpoint {folder} FAILED its verification ({'; '.join(problems)}): resume falls back to an older one"
            else:
                where = f"checkpoint {folder} written and verified; resume with train.resume={self.run_dir}"
        line = f"{signal_name}: stopped after step {step} of {self.cfg.steps}; {where}"
        return {"signal": signal_name, "step": step, "checkpoint": folder, "checkpoint_problems": problems, "line": line}

    def _skipped_nonfinite(self, step: int) -> bool:
        """Whether ``step`` was skipped for a non-finite loss (:mod:`~loka_job.training.nonfinite`);
        raises :class:`~loka_job.training.nonfinite.NonFiniteLossError` once too many were in a row."""
        if not self.nonfinite.after_step(step):
            return False
        logger.warning("step %d: the loss is not finite; the step is skipped (%d in a row, stop at %d)",
                       step, self.nonfinite.consecutive, self.nonfinite.limit)  # fmt: skip
        if self.nonfinite.exhausted:
            valve = None
            if self.loka is not None:
                first = next((e for e in self.loka.dispatcher.events if e.get("event") == "fallback"), None)
                valve = None if first is None else f"{first['layer']} at step {first['step']} ({first['reason']})"
            if self.probe is not None:
                self.probe.close()  # its logs end readable
            raise self.nonfinite.error(step, first_valve=valve, last_checkpoint=self.last_checkpoint)
        return True

    def _train_batches(self):
        """This rank's train batches from the resumed step on, made by ``train.data_workers``
        loader processes where the data has random access (else in the loop)."""
        from loka_job.training.prefetch import resolve_workers, reused_batches, train_batches

        workers = resolve_workers(self.cfg.data_workers, self.ctx.device, local_world_size=self.ctx.local_world_size)
        self._data_workers = workers if self.train_split is not None else 0
        if workers and self.train_split is not None:
            batches = train_batches(
                self.train_split, self.start_step, workers=workers, pin_memory=self.ctx.device.type == "cuda"
            )
        else:
            if workers and self.cfg.data_workers:
                logger.warning("train.data_workers=%d: this data has no random access; batches are made in the loop", workers)
            batches = iter(self.train_data(self.start_step))
        # Ids past a table's end or negative: one line naming the feature, before FBGEMM sees them.
        batches = self.feature_ids.checked(batches, split="train", first_batch=self.start_step, rank=self.ctx.rank)
        if self.cfg.reuse_batches:
            logger.info("train.reuse_batches=%d: these first batches are made now, then cycled", self.cfg.reuse_batches)
            return reused_batches(batches, self.cfg.reuse_batches)
        return batches

    def _restart_step_clock(self) -> float:
        """After work that is not a training step (eval, checkpoint, profiler set-up): drain the GPU
        and start the next step's clock now."""
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        return time.perf_counter()

    def _probe_cost(self, steps: List[int], seconds: List[float]) -> Optional[Dict[str, Any]]:
        """The Probe's extra time in this run, from its own step times (:mod:`loka_torchrec.probe.cost`)."""
        if self.probe is None or not getattr(self.probe, "enabled", False):
            return None
        from loka_torchrec.probe.cost import probe_cost

        return probe_cost(
            {n: 1e3 * t for n, t in zip(steps, seconds)}, self.probe.config,
            monitoring_steps=self.probe.monitoring_steps, monitoring_paused=self.probe.monitoring_paused,
        )

    @torch.no_grad()
    def evaluate(self, *, export: bool = False) -> Dict[str, float]:
        """NE and AUC over the eval data. ``export`` (``train.export_serving``): the first batch also
        keeps the dense modules' inputs (run eagerly), rank 0 exports their serving copies, and the
        eval data runs twice more, with the serving copies and with high-precision copies swapped in
        (:mod:`loka_job.training.serving_export`); the metrics returned are the trained model's."""
        # The pipeline rewrote the sharded modules' forward; give the model its own forward back
        # for evaluation (in-flight train batches are kept) and re-attach afterwards.
        self.pipeline.detach()
        if self.cfg.sharding_group_size is not None and self.cfg.sync_every > 1:
            self.model.sync()  # DMPCollection: every replica evaluates the same (averaged) tables
        self.model.eval()
        dense = {name: self.module.model.get_submodule(name) for name in dense_modules(self.module.model)} if export else {}
        metrics, captured = self._eval_pass(capture=dense)
        if export:
            probe = self.loka.probe if self.loka is not None else None
            served = serving_copies(dense, self.cfg.serving_input_scaling, probe,  # every rank: the passes below are collective
                                    serving_rows=self.cfg.serving_rows or None)  # fmt: skip
            if self.ctx.is_main:
                self.serving = export_serving(served, captured, self.run_dir, input_scaling=self.cfg.serving_input_scaling)
            with torch.no_grad(), swapped(self.module.model, {name: copy_ for name, (copy_, _) in served.items()}):
                served_metrics, _ = self._eval_pass()
            with torch.no_grad(), swapped(self.module.model, high_precision_copies(dense)):
                high_metrics, _ = self._eval_pass()
            if self.ctx.is_main:
                quality = {"trained": metrics, "served": served_metrics, "served_high_precision": high_metrics}
                for entry in self.serving.values():
                    entry["eval"] = quality  # the whole model's, with every dense module swapped at once
                write_serving(self.run_dir, self.serving)
        self.model.train()
        self.pipeline.attach(self.model)
        return metrics

    def _eval_pass(self, capture: Optional[Dict[str, nn.Module]] = None):
        """``(metrics, captured inputs)`` of one pass over the eval data; with ``capture``, the first
        batch runs eagerly and keeps those modules' inputs."""
        self.eval_metrics.reset()
        captured: Dict[str, Any] = {}
        batches = self.feature_ids.checked(self.eval_data(0), split="eval", first_batch=0, rank=self.ctx.rank)
        for i, batch in enumerate(batches):
            batch = batch.to(self.ctx.device)
            keep = captured_inputs(capture) if capture and i == 0 else contextlib.nullcontext({})
            with keep as kept, (eager() if capture and i == 0 else contextlib.nullcontext()):
                _, (_, logits, labels) = self.model(batch)
            captured.update(kept)
            self.eval_metrics.update(logits, labels)
        return self.eval_metrics.compute(), captured

    def _show_plan_if_new(self, bar) -> None:
        """Print the dispatch plan table on rank 0 whenever the plan changes."""
        if self.loka is None or not self.ctx.is_main:
            return
        plan = self.loka.dispatcher.plan  # a new plan is a new object: no hashing on every step
        if plan is getattr(self, "_shown_plan", None) or plan.mode == "policy" and plan.step == 0:
            return
        self._shown_plan = plan
        text = plan.table()
        (bar.write if bar is not None else print)(text)

    def _dense_allreduce_check(self, cfg: TrainConfig) -> Optional[DenseAllreduceCheck]:
        """The job's own hook on TorchRec's DDP module for ``train.dense_allreduce`` (fp8, auto:
        :func:`loka_job.training.dense_allreduce.register_hooks`), and ``auto``'s check (``None``
        otherwise, or where no DDP all-reduces anything: one rank, no dense parameters)."""
        ddp = getattr(self.model, "_dmp_wrapped_module", None)
        if self.ctx.world_size == 1 or not isinstance(ddp, DistributedDataParallel):
            return None
        return register_allreduce_hooks(ddp, cfg.dense_allreduce, self.ctx.device, check_steps=cfg.dense_allreduce_check_steps)

    # ------------------------------------------------------------------ state
    def state(self, step: int) -> Dict[str, Any]:
        """This rank's checkpoint: model, optimizers, history and every decision of the run so far
        (dispatch plan, step-time guard, safety valve, the Probe's state, the comms precisions)."""
        state = {
            "step": step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "history": self.history,
            "nonfinite": self.nonfinite.state_dict(),
        }
        if self.loka is not None:
            state["loka"] = self.loka.state_dict()
        if self.dense_check is not None:
            state["dense_allreduce_check"] = self.dense_check.state_dict()
        return state

    def save(self, step: int) -> str:
        folder = save_checkpoint(
            self.run_dir, step, self.state(step), rank=self.ctx.rank, world_size=self.ctx.world_size, config=self.checkpoint_config
        )
        self.last_checkpoint = folder
        if self.ctx.is_main:
            logger.info("checkpoint written: %s", folder)
        return folder

    def _resume(self, path: str) -> None:
        """Load the newest checkpoint every rank reads intact (all ranks agree first; a damaged or
        incomplete newer one is a warning naming it) and restore every decision it holds. A
        checkpoint of another model, other tables or another world size is refused first."""
        folder, state, skipped = resume_checkpoint(
            path, rank=self.ctx.rank, world_size=self.ctx.world_size, map_location=str(self.ctx.device),
            config=self.checkpoint_config, model_state=self.model.state_dict(),
            require_verified=self.cfg.require_verified_checkpoints,
        )  # fmt: skip
        if self.ctx.is_main:
            for line in skipped:
                logger.warning("train.resume: %s; falling back to an older checkpoint", line)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.start_step = int(state["step"])
        self.last_checkpoint = folder
        self.history = list(state.get("history", []))
        if "nonfinite" in state:
            self.nonfinite.load_state_dict(state["nonfinite"])
        if self.dense_check is not None and state.get("dense_allreduce_check"):
            self.dense_check.load_state_dict(state["dense_allreduce_check"])
        if self.loka is not None and "loka" in state:
            saved = state["loka"]
            comms = dataclasses.asdict(self.loka_cfg.comms)
            if saved.get("comms") is not None and saved["comms"] != comms and self.ctx.is_main:
                logger.warning("train.resume: the checkpoint ran loka.comms=%s; this run has %s", saved["comms"], comms)
            # Plan, valve, guard (dispatch_plan.json rewritten); the Probe's state, so a planned run
            # is not re-planned from scratch.
            self.loka.load_state_dict(saved, step=self.start_step)
        elif self.probe is not None:
            self.probe.resume_at(self.start_step + 1)  # the loop's next step
        if self.ctx.is_main:
            logger.info("resumed from %s at step %d", folder, self.start_step)

    # ------------------------------------------------------------------ logs
    def _log(self, record: Dict[str, Any]) -> None:
        self.history.append(record)
        with open(os.path.join(self.rank_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
        logger.info("%s", " ".join(f"{k}={v:.5g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()))

    def _trace_peak(self, label: Callable[[], str]) -> None:
        """Note the device's peak memory after the work ``label()`` names (called only where the peak rose)."""
        if self.ctx.device.type != "cuda":
            return
        peak = torch.cuda.max_memory_allocated(self.ctx.device)  # a host-side counter: no sync
        if peak > self.peak_trace.peak:
            self.peak_trace.observe(label(), peak)

    def _step_label(self, step: int, eager: bool) -> str:
        """Training step ``step`` for the peak trace: whether its compiled modules ran eagerly (a probe
        step) and whether a plan was made at its end."""
        planned = self.loka is not None and self.loka.dispatcher.plan.step == step
        return (f"step {step}" + (" (compiled modules eager: a probe step)" if eager else "")
                + (" (a plan made at its end)" if planned else ""))  # fmt: skip

    def _peak_memory_gb(self) -> Dict[str, Optional[float]]:
        """Peak GPU memory allocated by PyTorch (``torch.cuda.max_memory_allocated``), in GiB, the
        largest over ranks: over the whole run (``peak_memory_gb``) and over the timed window alone
        (``peak_memory_window_gb``: the steady state, after LoKA's plans, checks and compiles, whose
        transient peaks the whole run's includes); ``None`` off CUDA. A collective: every rank calls it."""
        if self.ctx.device.type != "cuda":
            return {"peak_memory_gb": None, "peak_memory_window_gb": None}
        window = float(torch.cuda.max_memory_allocated(self.ctx.device))
        before = self._peak_before_window
        peaks = torch.tensor([max(window, before or 0.0), window], device=self.ctx.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        run, window = (float(v) / 2**30 for v in peaks.tolist())
        return {"peak_memory_gb": run, "peak_memory_window_gb": window if before is not None else None}

    def _compile_summary(self) -> Dict[str, Any]:
        """The compile mode, the compiled modules, Dynamo's counters of this process (graphs
        compiled, graph breaks by reason) and what the CUDA graphs did: a graph break, a recompile
        or a CUDA graph recorded every step shows here."""
        from torch._dynamo.utils import counters

        breaks = {str(reason): int(n) for reason, n in counters["graph_break"].items()}
        return {
            "mode": self.compile_mode or "none",
            "modules": list(self.compiled_modules),
            "shapes": "static" if self.compile_static_shapes else "dynamic once a dim changes",
            "graphs": int(counters["stats"].get("unique_graphs", 0)),
            "graph_breaks": sum(breaks.values()),
            "dense_optimizer": dense_optimizer_kind(self.dense_optimizer),
            "graph_break_reasons": dict(sorted(breaks.items(), key=lambda kv: -kv[1])[:5]),
            "cuda_graphs": cuda_graph_stats(self.ctx.device),
        }

    def _loka_summary(self) -> Optional[Dict[str, Any]]:
        if self.loka is None:
            return None
        plan = self.loka.dispatcher.plan
        in_force = self.loka.dispatcher.in_force()
        return {
            "converted_layers": len(self.loka.report.converted),
            "skipped_layers": len(self.loka.report.skipped),
            "plan": plan.summary(in_force),  # planned and in force
            "fp8_gemms": in_force.fp8_gemm_count(),  # what runs at the end of the run
            "fp8_gemms_planned": plan.fp8_gemm_count(),
            "gemms": sum(plan.counts().values()),
            "kernels": plan.counts(),  # planned
            "kernels_in_force": in_force.counts(),
            "held_in_bf16": {name: {"by": by, "reason": reason} for name, (by, reason) in sorted(in_force.held.items())},
            "never_ran": dict(plan.never_ran),  # converted sites that did not run (not counted above)
            "coverage": dict(plan.coverage),  # share of linear multiply-adds per row that Dispatch manages
            "plan_file": os.path.join(self.run_dir, "dispatch_plan.json"),
            "forward_scaling": self.loka.dispatcher.forward_scaling,  # what scales the FP8 forward operands
            "grad_scaling": self.loka.dispatcher.grad_scaling,  # what scales the FP8 dy operands
            # backward calls whose dy saturated against its delayed amax, or held inf/NaN (rank 0's layers)
            "grad_scaling_events": self.loka.dispatcher.grad_scaling_events(),
            "fallen_back": self.loka.dispatcher.fallen_back,
            "step_guard": self.loka.dispatcher.step_guard_reason,
            # What the checks after planning saw (rank 0 records them): layer timings, guard verdicts.
            "layer_checks": [e for e in self.loka.dispatcher.events if e.get("event") == "layer_check"],
            "step_guard_verdicts": [e for e in self.loka.dispatcher.events if e.get("event") == "step_guard"],
            # compiled: the candidate plans the step judged, and the one kept (loka_torchrec.dispatch.plan_trials)
            "plan_trials": [e for e in self.loka.dispatcher.events
                            if e.get("event") in ("plan_trial", "plan_confirmation", "plan_selected")],
            # Where planning time went (host seconds, this rank): the Probe's parts and Dispatch's.
            "seconds": {
                "probe": dict(self.probe.seconds) if self.probe is not None else None,
                "dispatch": dict(self.loka.dispatcher.seconds),
            },
            # The planning work that raised this rank's peak GPU memory (loka_torchrec.peak_rises), in order.
            "planning_peak_rises": [
                *(self.probe.peak_rises.rises if self.probe is not None else []), *self.loka.dispatcher.peak_rises.rises,
            ],
            "monitoring": self.probe.cadence.summary() if self.probe is not None else None,
            "comms": self.loka.comms_summary(),
            "comms_choice": None if self.loka.comms_choice is None else self.loka.comms_choice.to_dict(),
        }
