"""``python -m loka_job.train``: the Hydra + torchrun training job.

Examples::

    # 2 CPU ranks, synthetic data, the default recipe (TorchRec DLRM, LoKA on)
    torchrun --nproc_per_node=2 -m loka_job.train
    # 8 GPUs, a large DHEN-style model
    torchrun --nproc_per_node=8 -m loka_job.train model=dhen_large device=cuda
    # the same job without LoKA
    torchrun --nproc_per_node=2 -m loka_job.train loka.enabled=false

How it ends (``docs/reliability.md``): exit status 0 after the last step; :data:`EXIT_PREEMPTED`
(75) after a SIGTERM, with a final checkpoint and the summary; :data:`EXIT_ERROR` (1) after an
error. An expected error (a bad override, a missing resume path, a run dir in use, a checkpoint of
another model, a feature id outside its table, a peer that stopped answering) is one line on
stderr, ``error: <what> (<field>)``, printed by rank 0 (by the rank concerned, for a rank's own
batch or peers), its traceback in the rank's ``train.log``; anything else keeps its traceback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

from loka_job.training.console import ProgressBarConsoleHandler
from loka_job.training.distributed import exit_process, init_distributed, pipeline_in_flight, shutdown_distributed
from loka_job.training.errors import EXIT_ERROR, EXIT_PREEMPTED, ConfigError, JobError, error_line, peer_gone_error

__all__ = ["main", "run"]

logger = logging.getLogger("loka_job.train")




def run(cfg: Dict[str, Any], run_dir: str) -> Dict[str, Any]:
    """Train with a resolved recipe (a plain dict) and return the summary (rank 0's is printed).

    Set-up errors of the configuration (``ValueError``, ``TypeError``) are raised as
    :class:`~loka_job.training.errors.ConfigError` with the same message; a SIGTERM stops the run
    after the step in progress (the summary's ``preempted``); the run dir is locked for the run.
    """
    import torch
    import torch.distributed as dist

    from loka_job.baselines import BaselineConfig
    from loka_torchrec.config import LokaConfig
    from loka_job.models import build_model
    from loka_job.training.data import make_data
    from loka_job.training.preemption import StopSignal
    from loka_job.training.sharding import check_sharding_group_size
    from loka_job.training.trainer import (
        TrainConfig, Trainer, check_baseline_in_job, check_baseline_vs_loka, enable_determinism,
    )  # fmt: skip

    # Validate everything the user typed before any process-group work.
    with _config_errors():
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
    # From here a SIGTERM (preemption) stops the run after a step rather than killing it mid-step.
    stop_signal = StopSignal()
    if threading.current_thread() is threading.main_thread():
        stop_signal.install()
    lock = watchdog = None
    try:
        with _config_errors():
            ctx = init_distributed(str(cfg.get("device", "auto")))
            # What needs the world size and device: checked before the data and the model are built.
            check_sharding_group_size(train_cfg.sharding_group_size, world_size=ctx.world_size, device=ctx.device)
        run_dir, lock = _shared_run_dir(run_dir)  # one job per run dir: a second one is refused here
        _setup_logging(run_dir, ctx.rank)
        if lock is not None and lock.took_over:
            logger.warning("%s", lock.took_over)
        watchdog = _start_watchdog(ctx, train_cfg.peer_timeout_s)
        seed = int(cfg.get("seed", 0))
        torch.manual_seed(seed)
        with _config_errors():
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
                checkpoint_config=_checkpoint_config(model_name, model_cfg, data.spec, cfg.get("loka") or {}, loka_cfg),
                stop_signal=stop_signal,
                watchdog=watchdog,
            )
        summary = trainer.fit()
        # The pipeline's input all-to-alls of the batches it prefetched, a barrier, the group.
        shutdown_distributed(pending=pipeline_in_flight(trainer.pipeline))
        if watchdog is not None:
            watchdog.stop()  # past the last barrier: a peer that ends now is done, not hung
        if ctx.is_main:
            print(format_summary(summary), flush=True)
        return summary
    except BaseException as exc:
        if _log_file_handler is not None:  # the traceback into the rank's train.log (not its console)
            logger.error("the run ends: %s", error_line(exc), exc_info=exc, extra={"console": False})
        raise
    finally:
        if watchdog is not None:
            watchdog.stop()
        if lock is not None:
            lock.release()
        stop_signal.uninstall()
        if dist.is_initialized():  # after an error: no barrier (a peer may be gone)
            dist.destroy_process_group()


@contextlib.contextmanager
def _config_errors() -> Iterator[None]:
    """``ValueError`` and ``TypeError`` of the set-up as :class:`ConfigError` (same message), so
    that the entry point prints them as one line; the job's own errors pass as they are."""
    try:
        yield
    except JobError:
        raise
    except (ValueError, TypeError) as exc:
        raise ConfigError(str(exc)) from exc


def _checkpoint_config(model_name: str, model_cfg: Dict[str, Any], spec, loka_options: Dict[str, Any], loka_cfg) -> Dict[str, Any]:
    """What a checkpoint's state depends on beyond its tensors' shapes, recorded in ``meta.json``
    and compared on resume: the model and its options, the tables, and LoKA's model mods when any
    is on (they change the state's keys; LoKA on or off alone does not)."""
    mods_on = bool(loka_cfg.enabled and loka_cfg.mods.enabled)
    tables = {t.name: {"feature": t.feature, "rows": t.num_embeddings, "dim": t.embedding_dim} for t in spec.tables}
    return {
        "model": {"name": model_name, **model_cfg},
        "tables": tables,
        "loka": {"mods": dict(loka_options.get("mods") or {}) if mods_on else "none"},
    }


def _start_watchdog(ctx, timeout_s: float):
    """The peer watchdog (``train.peer_timeout_s``; none for one rank or 0), started now, so that it
    covers the set-up too."""
    from loka_job.training.peer_watchdog import PeerWatchdog

    if ctx.world_size < 2 or not timeout_s:
        return None
    watchdog = PeerWatchdog(ctx.rank, ctx.world_size, timeout_s=timeout_s, on_timeout=_peer_timeout)
    watchdog.start()
    return watchdog


def _peer_timeout(message: str, missing: List[int]) -> None:
    """The watchdog found peers that did not arrive: one line (``train.log``; stderr on the
    lowest rank that is still alive), then end the process. The main thread is blocked in a
    collective with those peers, where no exception can reach it."""
    line = error_line(JobError(message, field="train.peer_timeout_s"))
    logger.error("%s", line, extra={"console": False})
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if rank == min(set(range(world_size)) - set(missing), default=rank):
        print(line, file=sys.stderr, flush=True)
    exit_process(EXIT_ERROR)


def auto_allreduce_words(auto) -> str:
    """``train.dense_allreduce=auto``'s state in words: the precision in force and how it was decided."""
    verdict = auto.get("verdict")
    if verdict:
        return (f"{auto['in_force']} in force ({auto['candidate']} step {verdict['chosen_ms']:.2f} ms vs fp32 "
                f"{verdict['fp32_ms']:.2f} ms, {verdict['steps_per_arm']} steps each)")  # fmt: skip
    if auto.get("started"):
        return f"being checked ({auto['candidate']} vs fp32), {auto['in_force']} now"
    return f"fp32 until checked against {auto['candidate']} (after LoKA's decisions)"


def format_summary(s: Dict[str, Any]) -> str:
    def f(v, spec=".4f"):
        return format(v, spec) if isinstance(v, (int, float)) and v is not None else "n/a"

    lines = [
        "",
        "==== loka-torchrec run summary ====",
        f"steps            {s['steps']} ({s['steps_this_run']} this run, {s['world_size']} rank(s) on {s['device']})",
        (f"step time        {f(s['median_step_ms'], '.1f')} ms median (p10 {f(s.get('p10_step_ms'), '.1f')}, "
         f"p90 {f(s.get('p90_step_ms'), '.1f')}, {s.get('timed_steps', 'n/a')} steps timed)    "
         f"QPS {f(s['qps'], '.0f')} samples/s") if s.get("steps_this_run") != 0 else
        "step time        no step ran (resumed at the last step: evaluation, and export if asked, only)",
        f"train NE / AUC   {f(s['train_ne'])} / {f(s['train_auc'])}   (last logging window)",
        f"eval  NE / AUC   {f(s['eval_ne'])} / {f(s['eval_auc'])}   (teacher's own NE: {f(s.get('teacher_eval_ne'))})",
    ]
    if s.get("data_workers"):
        lines.append(f"data             train batches made by {s['data_workers']} loader worker process(es)")
    if s.get("peak_memory_gb") is not None:
        window = s.get("peak_memory_window_gb")
        lines.append(f"peak GPU memory  {f(s['peak_memory_gb'], '.2f')} GiB (max over ranks)"
                     + (f", {window:.2f} GiB in the timed window" if window is not None else ""))  # fmt: skip
        rises = s.get("peak_memory_rises") or []
        if rises:
            lines.append(f"peak set at      {rises[-1]['at']} on rank 0 ({rises[-1]['gib']:.2f} GiB; "
                         f"{len(rises)} rise(s) in the run summary's peak_memory_rises)")  # fmt: skip
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
    dense_allreduce = s.get("dense_allreduce")
    if dense_allreduce and dense_allreduce.get("ddp") and s.get("world_size", 1) > 1:
        hooks = ", ".join(dense_allreduce["comm_hooks"]) or "no hook: fp32"
        auto = dense_allreduce.get("auto")
        if auto:
            hooks += f": auto, {auto_allreduce_words(auto)}"
        lines.append(f"dense all-reduce DDP ({hooks}), buckets of {dense_allreduce['bucket_cap_mb']:g} MiB")
    comms = (s.get("profile") or {}).get("comms")
    if comms and s.get("world_size", 1) > 1:
        per = comms["ms_per_step"]
        lines.append(
            f"collectives      all-to-all {sum(per['all_to_all'].values()):.2f} ms/step (forward {per['all_to_all']['forward']:.2f}, "
            f"backward {per['all_to_all']['backward']:.2f}), all-reduce {sum(per['all_reduce'].values()):.2f}; "
            f"exposed {comms['exposed_ms_per_step']['all']:.2f} ms/step (profiled steps, rank 0)"
        )
    for name, entry in (s.get("serving") or {}).items():
        if entry.get("exported"):
            sizes = "any batch size" if entry["batch"] == "dynamic" else f"batch fixed: {entry.get('batch_fixed_because')}"
            check = ("checked: the program gives the served model's output at " + " and ".join(map(str, entry["checked_batches"]))
                     + f" rows ({sizes})") if entry["verified"] else "MISMATCH against the served model"
            lines.append(f"serving          {entry['file']}: {entry['summary']}; {check}")
        else:
            lines.append(f"serving          {name} not exported: {entry['reason']}")
    quality = next((e["eval"] for e in (s.get("serving") or {}).values() if e.get("eval")), None)
    if quality:
        ne = {k: v.get("ne") for k, v in quality.items()}
        lines.append(
            f"serving eval NE  {f(ne['served'], '.5f')} served (FP8 where it runs) vs {f(ne['served_high_precision'], '.5f')} "
            f"in high precision vs {f(ne['trained'], '.5f')} trained, same eval data"
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
            grads = loka.get("grad_scaling", "current")
            events = loka.get("grad_scaling_events") or {}
            if grads == "delayed":
                grads += (
                    f" ({events.get('saturated', 0)} of {events.get('calls', 0)} backward calls saturated, "
                    f"{events.get('nonfinite', 0)} non-finite)"
                )
            lines.append(f"FP8 scaling      forward inputs and weights: {loka['forward_scaling']}; gradients: {grads}")
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
    if s.get("preempted"):
        lines.append(f"preempted        {s['preempted']['line']}")
    lines.append(f"logs             {s['run_dir']} (summary.json, rank*/metrics.jsonl, rank*/train.log)")
    return "\n".join(lines)


def _shared_run_dir(run_dir: str) -> Tuple[str, Optional[Any]]:
    """Every rank uses rank 0's run dir (Hydra may time-stamp each rank's a second apart), which
    rank 0 locks for this job: ``(run dir, rank 0's lock or None)``. A run dir that another job
    holds is refused on every rank together (:class:`~loka_job.training.run_dir_lock.RunDirLocked`)."""
    import torch.distributed as dist

    from loka_job.training.run_dir_lock import RunDirLocked, lock_run_dir

    lock = None
    holder = [os.path.abspath(run_dir), None]  # the run dir, and why it is refused
    if not dist.is_initialized() or dist.get_rank() == 0:
        os.makedirs(holder[0], exist_ok=True)
        try:
            lock = lock_run_dir(holder[0])
        except RunDirLocked as exc:
            holder[1] = str(exc)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(holder, src=0)
    if holder[1] is not None:
        raise RunDirLocked(holder[1], field="hydra.run.dir")
    os.makedirs(holder[0], exist_ok=True)
    return holder[0], lock


_log_file_handler: Optional[logging.Handler] = None  # this rank's train.log, once set up


def _setup_logging(run_dir: str, rank: int) -> None:
    global _log_file_handler
    rank_dir = os.path.join(run_dir, f"rank{rank}")
    os.makedirs(rank_dir, exist_ok=True)
    handler = logging.FileHandler(os.path.join(rank_dir, "train.log"))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    _log_file_handler = handler
    console = ProgressBarConsoleHandler(sys.stderr)  # above the progress bar, not inside its line
    console.setLevel(logging.WARNING)
    console.addFilter(lambda record: getattr(record, "console", True))  # records for the file only
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
    """Hydra entry point (config dir: the installed ``recipes/``); see the module docstring for
    how it ends."""
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    user_wants_tracebacks = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra re-raises its own errors (a bad override): reported below
    outcome: Dict[str, Any] = {"code": 0, "error": None}

    @hydra.main(config_path="pkg://loka_job.recipes", config_name="config", version_base=None)
    def _app(cfg) -> None:
        resolved = OmegaConf.to_container(cfg, resolve=True)
        try:  # the run's errors are kept from Hydra, which would print its own lines about them
            summary = run(resolved, HydraConfig.get().runtime.output_dir)
        except Exception as exc:
            outcome["error"] = exc
            return
        outcome["code"] = EXIT_PREEMPTED if summary.get("preempted") else 0

    try:
        _app()
    except Exception as exc:
        outcome["error"] = exc
    if outcome["error"] is not None:
        outcome["code"] = _report(outcome["error"], traceback_too=user_wants_tracebacks)
    # End without interpreter teardown, where gloo's worker threads could abort the process
    # (loka_job/training/distributed.py).
    exit_process(outcome["code"])


SILENT_RANK_GRACE_S = 30.0
"""How long a rank that leaves an every-rank error for rank 0 to print waits before it ends itself."""


def _report(exc: Exception, *, traceback_too: bool) -> int:
    """Print ``exc`` the way the module docstring says; returns the exit status."""
    import traceback

    from hydra.errors import HydraException

    rank = int(os.environ.get("RANK", "0"))
    if isinstance(exc, HydraException):  # composition and override errors: the same on every rank
        exc = ConfigError(_hydra_message(exc), field=_hydra_field(exc))
    elif not isinstance(exc, JobError):
        exc = peer_gone_error(exc, rank=rank) or exc
    if not isinstance(exc, JobError):
        traceback.print_exception(exc)
        return EXIT_ERROR
    if rank == 0 or not exc.every_rank:
        print(error_line(exc), file=sys.stderr, flush=True)
        if traceback_too:
            traceback.print_exception(exc)
    else:
        # Rank 0 prints this error; a rank that ended first would have torchrun stop rank 0 before
        # its line is out. Wait (bounded) for rank 0 to end the job instead.
        time.sleep(SILENT_RANK_GRACE_S)
    return EXIT_ERROR


def _hydra_message(exc: Exception) -> str:
    """One line from a Hydra error: its first line, the override it could not parse, the options
    of a config group that has no such option, the OmegaConf error beneath it and Hydra's advice."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    message = lines[0].rstrip(".") if lines else type(exc).__name__
    override = getattr(exc, "override", None)
    if override:
        message = f"cannot parse the override {override!r}: {message}"
    options = getattr(exc, "options", None)
    if options:
        message += f"; the options are {', '.join(options)}"
    cause = exc.__cause__
    if cause is not None and str(cause).strip():
        message += f": {str(cause).strip().splitlines()[0]}"
    advice = next((line for line in lines[1:] if line.startswith("To append")), None)
    if advice:
        message += f"; {advice[0].lower()}{advice[1:]}"
    return message


def _hydra_field(exc: Exception) -> Optional[str]:
    """The config key or group a Hydra error is about, where it says."""
    import re

    override = getattr(exc, "override", None)
    if override:
        return override.split("=", 1)[0].lstrip("+~")
    missing = getattr(exc, "missing_cfg_file", None)
    if missing:
        return os.path.dirname(missing) or missing
    quoted = re.search(r"'([+~]?[A-Za-z_][\w.]*)'", str(exc))
    return quoted.group(1).lstrip("+~") if quoted else None


if __name__ == "__main__":
    main()
