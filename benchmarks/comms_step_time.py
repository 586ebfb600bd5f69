"""Step time of TorchRec's DLRM under DistributedModelParallel with different embedding comms.

The set-up of the baseline measurements (shared/measurements.md, section 3): 26 tables x 200k
rows x dim 128, table-wise sharded, B = 8192 per rank, dense arch 13-512-256-128, over arch
1024-1024-512-256-1, ``TrainPipelineSparseDist``, Adagrad (fused exact Adagrad for the tables,
``torch.optim.Adagrad`` for the dense part). Every comms variant gets the same sharding plan
and the same batches; the step time is the median over steps 20 to 60 (each step synchronized).

Comms variants (``--comms``):

* ``fp32``: no qcomms;
* ``torchrec_bf16``: TorchRec's BF16 codecs, both directions;
* ``torchrec_fp8``: TorchRec's FP8 (FBGEMM HFP8) forward, BF16 backward;
* ``loka_fp8``: this project's FP8 (E4M3, fp32 row scales) forward, BF16 backward;
* ``loka_fp8_bwd_fp8``: loka FP8 forward, E5M2 backward.

Usage (2 GPUs; add ``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1`` for the
network-bound regime)::

    torchrun --nproc_per_node=2 benchmarks/comms_step_time.py --out benchmarks/results/comms_nvlink

Tiny CPU check (gloo)::

    torchrun --nproc_per_node=2 benchmarks/comms_step_time.py --device cpu --num-tables 4 \\
        --rows 1000 --dim 16 --batch 64 --dense-arch 32,16 --over-arch 32,1 \\
        --steps 12 --first-step 4 --comms fp32,loka_fp8 --out /tmp/comms_cpu
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import logging
import os
import statistics
import sys
import time
from typing import Dict, List

import torch
import torch.distributed as dist
from loka_job.training.distributed import exit_process, pipeline_in_flight, shutdown_distributed
from loka_torchrec.atomic_files import write_text_atomic

VARIANTS = ("fp32", "torchrec_bf16", "torchrec_fp8", "loka_fp8", "loka_fp8_bwd_fp8")


def _ints(text: str) -> List[int]:
    return [int(v) for v in text.split(",") if v]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="DLRM step time with different embedding comms")
    p.add_argument("--comms", default=",".join(VARIANTS), help=f"comma-separated subset of {VARIANTS}")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--num-tables", type=int, default=26)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=8192, help="per-rank batch size")
    p.add_argument("--dense-in", type=int, default=13)
    p.add_argument("--dense-arch", type=_ints, default=[512, 256, 128])
    p.add_argument("--over-arch", type=_ints, default=[1024, 1024, 512, 256, 1])
    p.add_argument("--steps", type=int, default=60, help="steps per variant")
    p.add_argument("--first-step", type=int, default=20, help="first timed step (earlier ones warm up)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--distinct-batches", type=int, default=8, help="pre-generated batches, cycled")
    p.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="after the timed steps, profile this many more per variant (torch.profiler, kernel categories; 0: off)",
    )
    p.add_argument("--out", required=True, help="directory for results.json and results.md")
    args = p.parse_args(argv)
    unknown = [c for c in args.comms.split(",") if c not in VARIANTS]
    if unknown:
        p.error(f"--comms: unknown variants {unknown}; choose from {VARIANTS}")
    if args.dense_arch[-1] != args.dim:
        p.error(f"--dense-arch must end with the embedding dim {args.dim}, got {args.dense_arch}")
    if args.over_arch[-1] != 1:
        p.error(f"--over-arch must end with 1, got {args.over_arch}")
    if not 0 <= args.first_step < args.steps:
        p.error("--first-step must be in [0, --steps)")
    return args


def _sharders(variant: str, fused_params: Dict):
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry

    from loka_torchrec import comms

    if variant == "fp32":
        return [EmbeddingBagCollectionSharder(fused_params=fused_params)]
    if variant.startswith("torchrec_"):
        forward = CommType.BF16 if variant == "torchrec_bf16" else CommType.FP8
        registry = get_qcomm_codecs_registry(QCommsConfig(forward_precision=forward, backward_precision=CommType.BF16))
        return [EmbeddingBagCollectionSharder(fused_params=fused_params, qcomm_codecs_registry=registry)]
    backward = "fp8" if variant == "loka_fp8_bwd_fp8" else "bf16"
    return comms.sharders(comms.CommsConfig(forward="fp8", backward=backward), fused_params=fused_params)[:1]


def _model(args, device):
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.models.dlrm import DLRM, DLRMTrain

    tables = [
        EmbeddingBagConfig(name=f"t_{i}", embedding_dim=args.dim, num_embeddings=args.rows, feature_names=[f"cat_{i}"])
        for i in range(args.num_tables)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    dlrm = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=args.dense_in,
        dense_arch_layer_sizes=args.dense_arch,
        over_arch_layer_sizes=args.over_arch,
        dense_device=device,
    )
    return DLRMTrain(dlrm)


def _plan(args, model, device, pg):
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    constraints = {f"t_{i}": ParameterConstraints(sharding_types=["table_wise"]) for i in range(args.num_tables)}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=dist.get_world_size(), compute_device=device.type),
        batch_size=args.batch,
        constraints=constraints,
    )
    # One plan for every variant, so table placement cannot differ between them.
    return planner.collective_plan(model, [EmbeddingBagCollectionSharder()], pg)


def _batches(args, rank, device):
    from torchrec.datasets.random import RandomRecDataset

    dataset = RandomRecDataset(
        keys=[f"cat_{i}" for i in range(args.num_tables)],
        batch_size=args.batch,
        hash_size=args.rows,
        ids_per_feature=1,
        num_dense=args.dense_in,
        manual_seed=1000 + rank,
        num_generated_batches=args.distinct_batches,
    )
    return list(itertools.islice(iter(dataset), args.distinct_batches))


def run_variant(variant: str, args, device, plan, batches) -> Dict:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    fused = {"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": args.lr}
    sharders = _sharders(variant, fused)
    model = _model(args, device)
    dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=sharders)
    dense = [p for n, p in dmp.named_parameters() if "embedding_bags" not in n and p.requires_grad]
    optimizer = torch.optim.Adagrad(dense, lr=args.lr)
    pipeline = TrainPipelineSparseDist(dmp, optimizer, device)
    data = itertools.cycle(batches)
    times = []
    for step in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        pipeline.progress(data)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    timed = sorted(times[args.first_step :])
    profile = _profile_steps(variant, args, device, pipeline, data) if args.profile_steps > 0 else None
    bound = list(getattr(sharders[0], "bound_registries", {}).values())  # loka: the per-module codecs
    registry = bound[0] if bound else sharders[0].qcomm_codecs_registry
    codec = registry.get("POOLED_EMBEDDINGS_ALL_TO_ALL") if registry else None
    result = {
        "variant": variant,
        "median_ms": 1e3 * statistics.median(timed),
        "p10_ms": 1e3 * timed[len(timed) // 10],
        "p90_ms": 1e3 * timed[(9 * len(timed)) // 10],
        "steps_timed": len(timed),
        "codec_forward": repr(codec.forward) if codec else None,
        "codec_backward": repr(codec.backward) if codec else None,
        "profile": profile,
    }
    for request in pipeline_in_flight(pipeline):  # the prefetched batches' input all-to-alls
        request.wait()
    del pipeline, optimizer, dmp
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def _profile_steps(variant: str, args, device, pipeline, data) -> Dict:
    """``--profile-steps`` more steps under ``torch.profiler``: where this variant's step goes.

    The kernels are sorted into the training job's categories
    (:mod:`loka_job.training.profiling`): NCCL time is ``comms``, this project's codec
    kernels are ``fp8_quantize``; wall time minus busy time is the host's share.
    """
    from loka_job.training.profiling import StepProfiler, profile_summary

    out_dir = os.path.join(args.out, f"profile-{variant}-rank{dist.get_rank()}")
    os.makedirs(out_dir, exist_ok=True)
    profiler = StepProfiler(1, args.profile_steps, device=device, out_dir=out_dir)
    for step in range(1, args.profile_steps + 1):
        profiler.before_step(step)
        pipeline.progress(data)
        profiler.after_step(step)
    report = profiler.finish()
    return profile_summary(report) if report else None


def _markdown(meta: Dict, results: List[Dict]) -> str:
    by = {r["variant"]: r for r in results if "error" not in r}
    ref_bf16 = by.get("torchrec_bf16", {}).get("median_ms")
    ref_fp32 = by.get("fp32", {}).get("median_ms")
    lines = [
        f"Device: {meta['device_name']} x {meta['world_size']}; {meta['date']}; torch {meta['torch']}, "
        f"torchrec {meta['torchrec']}; NCCL env: {meta['nccl_env'] or 'default'}",
        f"Command: `{meta['command']}`",
        f"Shape: {meta['shape']}",
        "",
        "| comms | median ms/step | p10 | p90 | vs TorchRec BF16 | vs fp32 |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['variant']} | fails: {r['error']} | | | | |")
            continue
        vs_bf16 = f"{r['median_ms'] / ref_bf16:.3f}x" if ref_bf16 else "-"
        vs_fp32 = f"{r['median_ms'] / ref_fp32:.3f}x" if ref_fp32 else "-"
        lines.append(
            f"| {r['variant']} | {r['median_ms']:.2f} | {r['p10_ms']:.2f} | {r['p90_ms']:.2f} | {vs_bf16} | {vs_fp32} |"
        )
    profiled = [r for r in results if r.get("profile")]
    if profiled:
        lines += [
            "",
            "Where a step goes (`--profile-steps`, rank 0, after the timed steps): ms per step of wall time, of kernels "
            "(CUDA kernels; CPU operators on a CPU), and the kernels' shares (comms = NCCL; codec = this project's encode/decode kernels; "
            "other = everything else, TorchRec's own casts included); idle = wall time with no kernel running.",
            "",
            "| comms | wall ms | kernel ms | comms % | codec % | embedding % | GEMM % | other % | idle % |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in profiled:
            p = r["profile"]
            sh = {k: 100 * v for k, v in p["shares"].items()}
            gemm = sh.get("gemm_bf16", 0) + sh.get("gemm_fp8", 0)
            other = 100 - sh.get("comms", 0) - sh.get("fp8_quantize", 0) - sh.get("embedding", 0) - gemm
            lines.append(
                f"| {r['variant']} | {p['wall_ms_per_step']:.2f} | {p['kernel_ms_per_step']:.2f} | {sh.get('comms', 0):.1f} "
                f"| {sh.get('fp8_quantize', 0):.1f} | {sh.get('embedding', 0):.1f} | {gemm:.1f} | {other:.1f} "
                f"| {100 * p['idle_share']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA GPU is visible; use --device cpu for a small check")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend)
    rank = dist.get_rank()
    pg = dist.group.WORLD
    torch.manual_seed(0)
    plan = _plan(args, _model(args, device), device, pg)
    batches = _batches(args, rank, device)
    results = []
    for variant in args.comms.split(","):
        dist.barrier()
        try:
            results.append(run_variant(variant, args, device, plan, batches))
        except Exception as e:  # e.g. TorchRec's FP8 codec on CPU: every rank fails the same way
            results.append({"variant": variant, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"})
        if rank == 0:
            r = results[-1]
            print(f"{variant}: " + (f"{r['median_ms']:.2f} ms/step" if "error" not in r else f"fails: {r['error']}"), flush=True)
    # Every rank's steps are synchronized by the collectives; report rank 0's clock.
    if rank == 0:
        import torchrec

        meta = {
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (gloo)",
            "world_size": dist.get_world_size(),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "torchrec": getattr(torchrec, "__version__", "unknown"),
            "nccl_env": " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")),
            "command": "torchrun --nproc_per_node=%d benchmarks/comms_step_time.py %s"
            % (dist.get_world_size(), " ".join(argv if argv is not None else sys.argv[1:])),
            "shape": (
                f"{args.num_tables} tables x {args.rows} x {args.dim}, B={args.batch}/rank, dense {args.dense_in}-"
                f"{'-'.join(map(str, args.dense_arch))}, over {'-'.join(map(str, args.over_arch))}, "
                f"median over steps {args.first_step}-{args.steps}"
            ),
        }
        os.makedirs(args.out, exist_ok=True)
        write_text_atomic(os.path.join(args.out, "results.json"), json.dumps({"meta": meta, "results": results}, indent=1))
        table = _markdown(meta, results)
        write_text_atomic(os.path.join(args.out, "results.md"), table)
        print(table)
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    # No interpreter teardown, where gloo's worker threads could abort the rank (loka_job/training/distributed.py).
    exit_process(main())
