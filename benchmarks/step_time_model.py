"""A step-time model for more GPUs than were measured: 8 GPUs of one host, and nodes joined by sockets.

Input: ``e2e_compare.py`` results of multi-GPU runs with a profile (``--profile-start``): per run the
median step, and rank 0's collective kernel time per step and its exposed part (the time a
collective ran while no other kernel did), for the embedding all-to-all and DDP's dense all-reduce.
The per-GPU batch is fixed across world sizes (TorchRec's data parallelism), so a rank's compute
does not change with ``N``; what changes is what each rank sends:

* all-to-all (pooled embeddings, forward and backward): a rank keeps ``1/N`` of its payload ``P``
  (``batch x tables x dim`` values) and sends the rest: ``2 P (N - 1) / N`` bytes a step;
* all-reduce (ring, DDP's dense gradients ``G`` bytes): ``2 G (N - 1) / N`` bytes a rank.

From one measured world size ``N0`` the model takes each collective's effective bandwidth
(bytes over its kernel time; the kernel time includes waiting for the slowest peer, so this is a
lower bound) and the step's other time (``step - exposed``). At ``N`` it predicts each collective's
time from its bytes, and the exposed time two ways, which bound the prediction:

* ``overlap kept`` (optimistic): the exposed share of each collective stays what it was at ``N0``;
* ``added exposed`` (conservative): the compute that hid the collective at ``N0`` hides no more,
  so all of the added time is exposed.

Across nodes (``--nodes``), each rank's traffic to the other nodes goes over sockets at the
bandwidth measured in a sockets run (``--sockets``: NCCL over TCP on one host, the stand-in for the
network): the all-to-all's ``(N - g) / N`` share to the other nodes, and the whole ring all-reduce
(a ring across nodes runs at its slowest link). Where the run's embedding comms were ``auto``, the
socket regime uses the FP8 all-to-all's time ratio measured in the sockets run (``auto`` chose FP8
there), because a job would choose it there too.

The model is checked against the measurements before it predicts: fitted at each measured world size,
it predicts the others (``## Check``). Payload and gradient bytes come from the recipe (the model
built on the ``meta`` device). Usage::

    python benchmarks/step_time_model.py --out benchmarks/results/H200/2026-11-28-step-time-model-dhen-xl \\
        --network-gbps 50 --all-reduce bf16,fp8 \\
        --sockets benchmarks/results/H200/2026-11-27-e2e-dlrm-large-4gpu-sockets-gain-split.json \\
        benchmarks/results/H200/2026-11-27-e2e-dhen-xl-2gpu-nvlink-baselines.json \\
        benchmarks/results/H200/2026-11-27-e2e-dhen-xl-4gpu-nvlink-baselines.json

Writes ``<out>.md`` and ``<out>.json``. Needs no GPU (the numbers come from the files).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from combine_results import load_records  # noqa: E402  (the same reading of e2e results)

COLLECTIVES = ("all_to_all", "all_reduce")
FP32_BYTES = 4
ALL_REDUCE_BYTES = {"bf16": 0.5, "fp8": (1 + 4 / 256) / 4}
"""Bytes on the wire of a compressed dense all-reduce, as a share of fp32's: PyTorch's bf16 hook, and
LoKA's FP8 hook (a byte a value plus an fp32 scale per 256 values; its encode and decode time is not modelled)."""


# --------------------------------------------------------------------------------------- bytes
def ring_all_reduce_bytes(grad_bytes: float, world: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``grad_bytes``: ``2 G (N - 1) / N``."""
    return 2.0 * grad_bytes * (world - 1) / world


def all_to_all_bytes(payload_bytes: float, world: int) -> float:
    """Bytes one rank sends in a step's forward and backward all-to-all of its pooled embeddings."""
    return 2.0 * payload_bytes * (world - 1) / world


@dataclasses.dataclass(frozen=True)
class Payload:
    """What one rank moves, from the recipe: pooled embeddings and dense gradients, in bytes (fp32)."""

    recipe: str
    embeddings: float
    gradients: float
    dense_params: int

    @classmethod
    @functools.lru_cache(maxsize=None)
    def of(cls, recipe: str) -> "Payload":
        """The recipe's payload: ``batch x tables x dim`` fp32 values, and its dense modules' parameters
        (built on the ``meta`` device, nothing allocated) as fp32 gradients."""
        import torch
        from hydra import compose, initialize_config_module
        from omegaconf import OmegaConf

        from loka_job.models import build_model
        from loka_job.training.data import make_data
        from loka_torchrec.compile import dense_modules

        with initialize_config_module(config_module="loka_job.recipes", version_base=None):
            cfg = compose(config_name="config", overrides=[f"model={recipe}"])
        data_cfg = OmegaConf.to_container(cfg.data, resolve=True)
        model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
        data = make_data(data_cfg, rank=0, world_size=1, seed=0)
        model = build_model(model_cfg.pop("name"), model_cfg, data.spec, torch.device("meta"))
        params = sum(p.numel() for name in dense_modules(model) for p in model.get_submodule(name).parameters())
        if "num_tables" not in data_cfg:
            raise ValueError(f"recipe {recipe}: its data is {data_cfg.get('kind', '?')} features, without num_tables; "
                             "the model sizes the all-to-all of pooled-embedding recipes only")  # fmt: skip
        embeddings = float(data_cfg["batch_size"] * data_cfg["num_tables"] * data_cfg["embedding_dim"] * FP32_BYTES)
        return cls(recipe, embeddings, float(params * FP32_BYTES), int(params))


# ----------------------------------------------------------------------------------- measured
@dataclasses.dataclass(frozen=True)
class Measured:
    """One profiled run at one world size: its median step and rank 0's collectives (ms a step)."""

    recipe: str
    run: str
    world: int
    step_ms: float
    kernel_ms: Dict[str, float]
    exposed_ms: Dict[str, float]
    fp8_all_to_all: bool
    auto_comms: bool
    source: str

    @classmethod
    def of(cls, record: Dict[str, Any]) -> "Measured":
        name = f"{record.get('recipe')}:{record.get('run')} ({record.get('source')})"
        comms = (record.get("profile") or {}).get("comms")
        if not comms:
            raise ValueError(f"{name}: no collectives in its profile (run e2e_compare.py with --profile-start)")
        world = int(record.get("world_size") or 1)
        if world < 2:
            raise ValueError(f"{name}: world_size {world}: the model needs a multi-GPU run")
        per = comms["ms_per_step"]
        return cls(
            recipe=record["recipe"], run=record["run"], world=world, step_ms=float(record["median_step_ms"]),
            kernel_ms={c: float(sum(per[c].values())) for c in COLLECTIVES},
            exposed_ms={c: float(comms["exposed_ms_per_step"][c]) for c in COLLECTIVES},
            fp8_all_to_all="forward fp8" in str(record.get("comms") or ""),
            auto_comms="(auto" in str(record.get("comms") or ""),
            source=str(record.get("source")),
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class InterNode:
    """Per-rank bandwidths (bytes/ms) of the link between nodes, and the FP8 all-to-all's time as a
    share of fp32's over it (``None``: not known; the all-to-all is then costed at fp32)."""

    all_to_all: float
    all_reduce: float
    fp8_all_to_all_ratio: Optional[float]
    label: str
    source: str

    @classmethod
    def of_sockets_run(cls, records: Sequence[Dict[str, Any]]) -> "InterNode":
        """From the runs of one sockets file: bandwidths from its runs with fp32 embedding comms,
        the FP8 ratio from the median of its FP8 runs over the median of its fp32 runs."""
        measured = [Measured.of(r) for r in records if (r.get("profile") or {}).get("comms")]
        fp32 = [m for m in measured if not m.fp8_all_to_all]
        if not fp32:
            raise ValueError("--sockets: the file has no profiled run with fp32 embedding comms")
        payload = Payload.of(fp32[0].recipe)
        a2a = statistics.median(all_to_all_bytes(payload.embeddings, m.world) / m.kernel_ms["all_to_all"] for m in fp32)
        ar = statistics.median(ring_all_reduce_bytes(payload.gradients, m.world) / m.kernel_ms["all_reduce"] for m in fp32)
        fp8 = [m.kernel_ms["all_to_all"] for m in measured if m.fp8_all_to_all]
        ratio = statistics.median(fp8) / statistics.median(m.kernel_ms["all_to_all"] for m in fp32) if fp8 else None
        return cls(a2a, ar, ratio, "sockets", f"sockets, measured in `{fp32[0].source}`")

    @classmethod
    def given(cls, gb_per_s: float, fp8_all_to_all_ratio: Optional[float]) -> "InterNode":
        """A network of ``gb_per_s`` GB/s a rank for both collectives (``--network-gbps``)."""
        if not gb_per_s > 0:
            raise ValueError(f"--network-gbps: expected a bandwidth > 0, got {gb_per_s!r}")
        return cls(gb_per_s * 1e6, gb_per_s * 1e6, fp8_all_to_all_ratio, f"{gb_per_s:g} GB/s", f"{gb_per_s:g} GB/s a rank, given")


# ------------------------------------------------------------------------------------- model
@dataclasses.dataclass(frozen=True)
class Prediction:
    """A predicted step (ms): ``low`` (overlap kept) .. ``high`` (added time exposed), and each collective's time."""

    world: int
    nodes: int
    low_ms: float
    high_ms: float
    kernel_ms: Dict[str, float]


def predict(
    m: Measured, payload: Payload, world: int, *, nodes: int = 1, link: Optional[InterNode] = None, all_reduce_bytes: float = 1.0
) -> Prediction:
    """``m``'s step at ``world`` ranks on ``nodes`` nodes (module docstring); ``all_reduce_bytes``: the
    dense all-reduce's bytes as a share of the measured run's (a compressed all-reduce; the
    bandwidths stay those fitted on the measured bytes).

    Raises:
        ValueError: ``world`` is not a multiple of ``nodes``, or ``nodes > 1`` without the ``link`` between them.
    """
    if world < 2 or nodes < 1 or world % nodes:
        raise ValueError(f"world {world}, nodes {nodes}: expected world >= 2, a multiple of nodes >= 1")
    if nodes > 1 and link is None:
        raise ValueError("nodes > 1 needs the bandwidth between them (--sockets or --network-gbps)")
    per_node = world // nodes
    bw = {
        "all_to_all": all_to_all_bytes(payload.embeddings, m.world) / m.kernel_ms["all_to_all"],
        "all_reduce": ring_all_reduce_bytes(payload.gradients, m.world) / m.kernel_ms["all_reduce"],
    }
    grad_bytes = payload.gradients * all_reduce_bytes
    if nodes == 1:
        kernel = {
            "all_to_all": all_to_all_bytes(payload.embeddings, world) / bw["all_to_all"],
            "all_reduce": ring_all_reduce_bytes(grad_bytes, world) / bw["all_reduce"],
        }
    else:
        local, remote = (per_node - 1) / world, (world - per_node) / world
        fp8 = link.fp8_all_to_all_ratio if m.auto_comms else None  # auto would choose FP8 there, as it did over sockets
        remote_ms = 2.0 * payload.embeddings * remote / link.all_to_all * (fp8 if fp8 else 1.0)
        kernel = {
            "all_to_all": 2.0 * payload.embeddings * local / bw["all_to_all"] + remote_ms,
            "all_reduce": ring_all_reduce_bytes(grad_bytes, world) / min(bw["all_reduce"], link.all_reduce),
        }
    other = m.step_ms - sum(m.exposed_ms.values())
    # Overlap kept: each collective's exposed share as measured, but no more hidden than the rest of
    # the step lasts (a collective overlaps the step's other work, not itself).
    kept = max(
        sum(m.exposed_ms[c] / m.kernel_ms[c] * kernel[c] if m.kernel_ms[c] > 0 else 0.0 for c in COLLECTIVES),
        sum(kernel.values()) - other,
    )
    added = sum(m.exposed_ms[c] + max(0.0, kernel[c] - m.kernel_ms[c]) for c in COLLECTIVES)
    low, high = other + min(kept, added), other + max(kept, added)
    return Prediction(world, nodes, low, high, kernel)


# ------------------------------------------------------------------------------------ report
def check_rows(measured: Sequence[Measured]) -> List[Dict[str, Any]]:
    """Each run fitted at each measured world size and predicting the others of the same recipe and run."""
    rows = []
    for fit in measured:
        payload = Payload.of(fit.recipe)
        for target in measured:
            if (target.recipe, target.run) != (fit.recipe, fit.run) or target.world == fit.world:
                continue
            p = predict(fit, payload, target.world)
            inside = p.low_ms <= target.step_ms <= p.high_ms
            miss = 0.0 if inside else min(abs(target.step_ms - p.low_ms), abs(target.step_ms - p.high_ms)) / target.step_ms
            rows.append({"recipe": fit.recipe, "run": fit.run, "fitted_at": fit.world, "world": target.world, "measured_ms": target.step_ms,
                         "low_ms": p.low_ms, "high_ms": p.high_ms, "inside": inside, "miss_pct": 100 * miss})  # fmt: skip
    return rows


def prediction_rows(
    measured: Sequence[Measured], targets: Sequence[Tuple[int, int]], links: Sequence[InterNode], *, all_reduce: Sequence[str] = ()
) -> List[Dict[str, Any]]:
    """Each run, fitted at its largest measured world size, at each ``(world, nodes)`` target (over
    each inter-node ``link`` where ``nodes > 1``); across nodes also with its dense gradients
    all-reduced in each precision of ``all_reduce`` (``train.dense_allreduce``; :data:`ALL_REDUCE_BYTES`)."""
    largest: Dict[Tuple[str, str], Measured] = {}
    for m in measured:
        key = (m.recipe, m.run)
        if key not in largest or m.world > largest[key].world:
            largest[key] = m
    rows = []
    for m in largest.values():
        payload = Payload.of(m.recipe)
        rows.append({"recipe": m.recipe, "run": m.run, "world": m.world, "nodes": 1, "link": "one host (measured)",
                     "measured_ms": m.step_ms, "low_ms": m.step_ms, "high_ms": m.step_ms, "kernel_ms": m.kernel_ms})  # fmt: skip
        for world, nodes in targets:
            for link in (links if nodes > 1 else [None]):
                variants = [(m.run, 1.0)]
                if nodes > 1:
                    variants += [(f"{m.run} + {precision} all-reduce", ALL_REDUCE_BYTES[precision]) for precision in all_reduce]
                for run, share in variants:
                    p = predict(m, payload, world, nodes=nodes, link=link, all_reduce_bytes=share)
                    rows.append({"recipe": m.recipe, "run": run, "world": world, "nodes": nodes,
                                 "link": "one host" if link is None else link.label, "measured_ms": None,
                                 "low_ms": p.low_ms, "high_ms": p.high_ms, "kernel_ms": p.kernel_ms})  # fmt: skip
    return rows


def to_markdown(check: List[Dict[str, Any]], rows: List[Dict[str, Any]], links: Sequence[InterNode], payloads: Dict[str, Payload],
                command: str) -> str:  # fmt: skip
    lines = [
        "# Step-time model: predicted steps at more GPUs than measured",
        "",
        "What is predicted, not measured: the model of `benchmarks/step_time_model.py` (its docstring), fitted on the "
        "measured runs named below. A prediction is a range, from 'overlap kept' (each collective's exposed share as "
        "measured, no more hidden than the rest of the step lasts) to 'added exposed' (all added collective time exposed).",
        "",
        "Payloads (per rank, fp32): " + "; ".join(
            f"`{p.recipe}` embeddings {p.embeddings / 2**20:.0f} MiB a direction, dense gradients {p.gradients / 2**30:.2f} GiB "
            f"({p.dense_params / 1e6:.1f} M parameters)" for p in payloads.values()),
        "",
    ]
    for link in links:
        ratio = "not known (costed at fp32)" if link.fp8_all_to_all_ratio is None else f"{link.fp8_all_to_all_ratio:.2f}x of fp32's time"
        lines += [f"Between nodes ({link.source}): all-to-all {link.all_to_all / 1e6:.2f} GB/s a rank, ring all-reduce "
                  f"{link.all_reduce / 1e6:.2f} GB/s a rank; an `auto` run's FP8 all-to-all {ratio}.", ""]  # fmt: skip
    lines += [
        "## Check: fitted at one measured world size, predicting another",
        "",
        "| recipe | run | fitted at | predicted for | measured ms | predicted ms | inside | off by |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in check:
        lines.append(f"| {r['recipe']} | {r['run']} | {r['fitted_at']} GPUs | {r['world']} GPUs | {r['measured_ms']:.2f} "
                     f"| {r['low_ms']:.2f} .. {r['high_ms']:.2f} | {'yes' if r['inside'] else 'no'} | {r['miss_pct']:.1f}% |")  # fmt: skip
    lines += [
        "",
        "## Predictions (fitted at the largest measured world size)",
        "",
        "`+ bf16 all-reduce`, `+ fp8 all-reduce`: the same run with its dense gradients all-reduced in bf16 or FP8 "
        "(`train.dense_allreduce=bf16|fp8`: half, about a quarter of the bytes; the FP8 hook's encode and decode time is not "
        "modelled). Ratios are against the first run of the same recipe, world size and link (optimistic with optimistic, "
        "conservative with conservative).",
        "",
        "| recipe | run | GPUs | nodes | between nodes | step ms | all-to-all ms | all-reduce ms | vs the first run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    groups: Dict[Tuple[str, int, int, str], List[Dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["recipe"], r["world"], r["nodes"], r["link"]), []).append(r)
    for (recipe, world, nodes, link), group in groups.items():
        first = group[0]
        for r in group:
            step = f"{r['measured_ms']:.2f} (measured)" if r["measured_ms"] is not None else f"{r['low_ms']:.1f} .. {r['high_ms']:.1f}"
            ratio = "1.00x" if r is first else f"{first['low_ms'] / r['low_ms']:.3f}x .. {first['high_ms'] / r['high_ms']:.3f}x"
            lines.append(f"| {recipe} | {r['run']} | {world} | {nodes} | {link if nodes > 1 else 'one host'} | {step} "
                         f"| {r['kernel_ms']['all_to_all']:.1f} | {r['kernel_ms']['all_reduce']:.1f} | {ratio} |")  # fmt: skip
    lines += ["", "## Command", "", "```", command, "```", ""]
    return "\n".join(lines)


def parse_targets(text: str) -> List[Tuple[int, int]]:
    """``"8,2x4"`` -> ``[(8, 1), (8, 2)]``: a world size on one node, or ``<nodes>x<GPUs per node>``."""
    out = []
    for item in text.split(","):
        item = item.strip()
        try:
            nodes, per = item.split("x") if "x" in item else ("1", item)
            out.append((int(nodes) * int(per), int(nodes)))
        except ValueError:
            raise ValueError(f"--targets: expected N or <nodes>x<GPUs per node>, got {item!r}") from None
    return out


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="e2e_compare.py results of profiled multi-GPU runs (one host, NVLink)")
    p.add_argument("--sockets", help="an e2e_compare.py result of profiled runs over sockets (the inter-node stand-in)")
    p.add_argument("--network-gbps", type=float, action="append", default=[],
                   help="also predict across nodes joined by this many GB/s a rank (repeatable)")
    p.add_argument("--targets", default="8,2x4,4x4", help="world sizes to predict: N (one host) or <nodes>x<GPUs per node>")
    p.add_argument("--runs", default="", help="comma-separated runs to model (default: every profiled one)")
    p.add_argument("--all-reduce", default="", help="across nodes, also predict each run with its dense all-reduce in these "
                   f"precisions (comma-separated: {', '.join(ALL_REDUCE_BYTES)})")
    p.add_argument("--out", required=True, help="output path without extension (.md and .json are written)")
    args = p.parse_args(argv)
    wanted = [r for r in args.runs.split(",") if r]
    # Each file on its own: the same run at other world sizes is another measurement, not a repeat.
    records = [r for path in args.files for r in load_records([path])
               if (r.get("profile") or {}).get("comms") and (not wanted or r["run"] in wanted)]  # fmt: skip
    if not records:
        raise SystemExit("no profiled multi-GPU run in the files (e2e_compare.py --nproc N --profile-start S)")
    measured = [Measured.of(r) for r in records]
    links: List[InterNode] = []
    if args.sockets:
        links.append(InterNode.of_sockets_run(load_records([args.sockets])))
    fp8_ratio = links[0].fp8_all_to_all_ratio if links else None
    links += [InterNode.given(gbps, fp8_ratio) for gbps in args.network_gbps]
    targets = parse_targets(args.targets)
    if any(nodes > 1 for _, nodes in targets) and not links:
        raise SystemExit("--targets across nodes need --sockets or --network-gbps")
    check = check_rows(measured)
    compressed = [c for c in args.all_reduce.split(",") if c]
    unknown = [c for c in compressed if c not in ALL_REDUCE_BYTES]
    if unknown:
        raise SystemExit(f"--all-reduce: expected some of {', '.join(ALL_REDUCE_BYTES)}, got {', '.join(unknown)}")
    rows = prediction_rows(measured, targets, links, all_reduce=compressed)
    payloads = {m.recipe: Payload.of(m.recipe) for m in measured}
    command = "python benchmarks/step_time_model.py " + " ".join(sys.argv[1:] if argv is None else argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".md", "w") as f:
        f.write(to_markdown(check, rows, links, payloads, command))
    with open(args.out + ".json", "w") as f:
        json.dump({"command": command, "check": check, "predictions": rows, "links": [dataclasses.asdict(link) for link in links],
                   "payloads": {k: dataclasses.asdict(v) for k, v in payloads.items()}}, f, indent=1, allow_nan=False)  # fmt: skip
    print(f"wrote {args.out}.md and .json")


if __name__ == "__main__":
    main()
