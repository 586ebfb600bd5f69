"""``python -m loka_job.train``: the Hydra + torchrun training job.

Examples::

    # 2 CPU ranks, synthetic data, the default recipe (TorchRec DLRM, LoKA on)
    torchrun --nproc_per_node=2 -m loka_job.train
    # 8 GPUs, a large DHEN-style model
    torchrun --nproc_per_node=8 -m loka_job.train model=dhen_large device=cuda
    # the same job without LoKA
    torchrun --nproc_per_node=2 -m loka_job.train loka.enabled=false
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Dict

from loka_job.training.console import ProgressBarConsoleHandler
from loka_job.training.distributed import exit_process, init_distributed, pipeline_in_flight, shutdown_distributed

__all__ = ["main", "run"]

logger = logging.getLogger("loka_job.train")


def run(cfg: Dict[str, Any], run_dir: str) -> Dict[str, Any]:
    """Train with a resolved recipe (a plain dict) and return the summary (rank 0's is printed)."""
    import torch
    import torch.distributed as dist

    from loka_job.baselines import BaselineConfig
    from loka_torchrec.config import LokaConfig
    from loka_job.models import build_model
    from loka_job.training.data import make_data
    from loka_job.training.sharding import check_sharding_group_size
    from loka_job.training.trainer import (
        TrainConfig, Trainer, check_baseline_in_job, check_baseline_vs_loka, enable_determinism,
    )  # fmt: skip

    # Validate everything the user typed before any process-group work.
    model_cfg = dict(cfg.get("model") or {})
    model_name = model_cfg.pop("name", None)
    train_cfg = TrainConfig(**dict(cfg.get("train") or {}))
    loka_cfg = LokaConfig.from_dict(cfg.get("loka") or {})
    baseline_cfg = BaselineConfig.from_dict(cfg.get("baseline") or {})
    check_baseline_vs_loka(baseline_cfg, loka_cfg)
    check_baseline_in_job(baseline_cfg)
    data_cfg = dict(cfg.get("data") or {})

    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # TorchRec's deprecation notices
    if train_cfg.deterministic:
        enable_determinism()  # before anything touches CUDA
    ctx = init_distributed(str(cfg.get("device", "auto")))
    try:
        # What needs the world size and device: checked before the data and the model are built.
        check_sharding_group_size(train_cfg.sharding_group_size, world_size=ctx.world_size, device=ctx.device)
        run_dir = _shared_run_dir(run_dir)
        _setup_logging(run_dir, ctx.rank)
        seed = int(cfg.get("seed", 0))
        torch.manual_seed(seed)
        data = make_data(data_cfg, rank=ctx.rank, world_size=ctx.world_size, seed=seed)
        model = build_model(model_name, model_cfg, data.spec, ctx.device)
        trainer = Trainer(
            ctx,
            model,
            train_data=data.train,
            eval_data=data.eval,
            train_config=train_cfg,
            loka_config=loka_cfg,
            run_dir=run_dir,
            batch_size=data.batch_size,
            baseline_config=baseline_cfg,
            teacher_ne=data.teacher_ne,
            train_split=data.train_split,
        )
        summary = trainer.fit()
        # The pipeline's input all-to-alls of the batches it prefetched, a barrier, the group.
        shutdown_distributed(pending=pipeline_in_flight(trainer.pipeline))
        if ctx.is_main:
            print(format_summary(summary), flush=True)
        return summary
    finally:
        if dist.is_initialized():  # after an error: no barrier (a peer may be gone)
            dist.destroy_process_group()


def format_summary(s: Dict[str, Any]) -> str:
    def f(v, spec=".4f"):
        return format(v, spec) if isinstance(v, (int, float)) and v is not None else "n/a"

    lines = [
        "",
        "==== loka-torchrec run summary ====",
        f"steps            {s['steps']} ({s['steps_this_run']} this run, {s['world_size']} rank(s) on {s['device']})",
        f"step time        {f(s['median_step_ms'], '.1f')} ms median (p10 {f(s.get('p10_step_ms'), '.1f')}, "
        f"p90 {f(s.get('p90_step_ms'), '.1f')}, {s.get('timed_steps', 'n/a')} steps timed)    "
        f"QPS {f(s['qps'], '.0f')} samples/s",
        f"train NE / AUC   {f(s['train_ne'])} / {f(s['train_auc'])}   (last logging window)",
        f"eval  NE / AUC   {f(s['eval_ne'])} / {f(s['eval_auc'])}   (teacher's own NE: {f(s.get('teacher_eval_ne'))})",
    ]
    if s.get("data_workers"):
        lines.append(f"data             train batches made by {s['data_workers']} loader worker process(es)")
    if s.get("peak_memory_gb") is not None:
        lines.append(f"peak GPU memory  {f(s['peak_memory_gb'], '.2f')} GiB (max over ranks)")
    if s.get("autocast", "none") != "none":
        lines.append(f"autocast         {s['autocast']} (dense forward)")
    compiled = s.get("compile") or {}
    if compiled.get("mode", "none") != "none":
        lines.append(
            f"torch.compile    mode {compiled['mode']}{', static shapes' if compiled.get('shapes') == 'static' else ''}: "
            f"{', '.join(compiled['modules'])}; {compiled['graphs']} graph(s), "
            f"{compiled['graph_breaks']} graph break(s)"
        )
    graphs = compiled.get("cuda_graphs")
    if graphs:
        lines.append(
            f"CUDA graphs      {graphs['graphs']} recorded, {graphs['rerecords']} re-recorded, "
            f"{graphs['skips']} graph(s) run without (TORCH_LOGS=cudagraphs says why)"
        )
    host = s.get("host_window")
    if host:
        cpu = ""
        if host.get("thread_cpu_ms") is not None:
            cpu = f", {f(host['thread_cpu_ms'], '.2f')} ms CPU on the training thread, {f(host['process_cpu_ms'], '.2f')} ms in the process"
        lines.append(f"host per step    {f(host['data_wait_ms'], '.2f')} ms waiting for batches{cpu} (timed steps)")
    if compiled.get("dense_optimizer"):
        note = " (PyTorch's Optimizer.step breaks its graph once, on purpose)" if compiled["dense_optimizer"] == "step compiled" else ""
        lines.append(f"dense Adagrad    {compiled['dense_optimizer']}{note}")
    if s.get("sharding_group_size") is not None:
        lines.append(
            f"2D sharding      DMPCollection: tables sharded over groups of {s['sharding_group_size']} rank(s), "
            f"{s['world_size'] // s['sharding_group_size']} replica(s) synced every {s['sync_every']} step(s)"
        )
    baseline = s.get("baseline")
    loka = s.get("loka")
    if baseline:
        lines.append(
            f"baseline         {baseline['kind']}:{baseline['recipe']}: {baseline['converted_layers']} layers in FP8, "
            f"{baseline['skipped_layers']} left in high precision"
        )
    if loka:
        lines.append(f"LoKA             {loka['converted_layers']} layers converted; {loka['plan']}")
        lines.append(f"dispatch plan    {loka['plan_file']}")
        if loka.get("forward_scaling"):
            lines.append(f"FP8 scaling      forward inputs and weights: {loka['forward_scaling']}; gradients: current")
        if loka.get("comms"):
            lines.append(f"embedding comms  {loka['comms']}")
        checks = loka.get("layer_checks") or []
        if checks:
            kept = sum(1 for c in checks if c.get("kept_fp8"))
            lines.append(
                f"layer check      kept FP8 in {kept} of {len(checks)} planned FP8 layers (fwd+bwd timed against bf16; "
                f"events in dispatch_events.jsonl)"
            )
        if loka.get("step_guard"):
            lines.append(f"step-time guard  {loka['step_guard'].removeprefix('step-time guard ')}")
        if loka.get("fallen_back"):
            lines.append(f"safety valve     in bf16 now: {sorted(loka['fallen_back'])}")
    elif not baseline:
        lines.append("LoKA             off (loka.enabled=false)")
    cost = s.get("probe_cost")
    if cost and cost.get("measured_share") is not None:
        projected = cost.get("projected_share")
        lines.append(
            f"probe cost       {cost['extra_seconds']:.1f} s extra, {100 * cost['measured_share']:.2f}% of this run's step time"
            + (f"; projected {100 * projected:.2f}% of a {cost['horizon_steps']:,}-step run" if projected is not None else "")
            + (f", monitoring every {cost['monitoring_interval']:,} steps" if cost.get("monitoring_interval") else "")
            + (", monitoring paused (no layer runs FP8)" if cost.get("monitoring_paused") else "")
        )
    profile = s.get("profile")
    if profile:
        shares = profile["shares"]
        lines.append(
            f"profile          steps {profile['steps'][0]}..{profile['steps'][1]}: {f(profile['kernel_ms_per_step'], '.2f')} ms/step "
            f"of {profile['source']} in {f(profile['wall_ms_per_step'], '.2f')} ms wall; GEMM {100 * profile['gemm_share']:.1f}% "
            f"(fp8 {100 * shares['gemm_fp8']:.1f}%), quantize {100 * shares['fp8_quantize']:.1f}%, "
            f"idle {100 * profile['idle_share']:.1f}%; 2x-GEMM ceiling {profile['amdahl_2x_gemm_ceiling']:.3f}x ({profile['file']})"
        )
    lines.append(f"logs             {s['run_dir']} (summary.json, rank*/metrics.jsonl, rank*/train.log)")
    return "\n".join(lines)


def _shared_run_dir(run_dir: str) -> str:
    """Every rank uses rank 0's run dir (Hydra may time-stamp each rank's a second apart)."""
    import torch.distributed as dist

    holder = [os.path.abspath(run_dir)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(holder, src=0)
    os.makedirs(holder[0], exist_ok=True)
    return holder[0]


def _setup_logging(run_dir: str, rank: int) -> None:
    rank_dir = os.path.join(run_dir, f"rank{rank}")
    os.makedirs(rank_dir, exist_ok=True)
    handler = logging.FileHandler(os.path.join(rank_dir, "train.log"))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    console = ProgressBarConsoleHandler(sys.stderr)  # above the progress bar, not inside its line
    console.setLevel(logging.WARNING)
    # The library's loggers and the job's own, into one file per rank (warnings to rank 0's console).
    for package in ("loka_torchrec", "loka_job"):
        root = logging.getLogger(package)
        # Hydra's logging set-up disables loggers that existed before it ran: enable ours again.
        for name, item in logging.Logger.manager.loggerDict.items():
            if name.startswith(package) and isinstance(item, logging.Logger):
                item.disabled = False
        root.setLevel(logging.INFO)
        root.addHandler(handler)
        root.propagate = False
        if rank == 0:
            root.addHandler(console)


def main() -> None:
    """Hydra entry point (config dir: the installed ``recipes/``)."""
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    @hydra.main(config_path="pkg://loka_job.recipes", config_name="config", version_base=None)
    def _app(cfg) -> None:
        resolved = OmegaConf.to_container(cfg, resolve=True)
        run(resolved, HydraConfig.get().runtime.output_dir)

    _app()
    # Only after a run that succeeded (Hydra exits on an error): end without interpreter
    # teardown, where gloo's worker threads could abort the process (loka_job/training/distributed.py).
    exit_process(0)


if __name__ == "__main__":
    main()
