"""``CommsConfig`` precision ``"auto"``: fp8 or fp32 per direction, from a short timing on the run's own ranks.

:func:`decide` times one TorchRec-shaped all-to-all of the embeddings (each rank sends
``rows_per_rank x width`` values to every rank, ``width`` being the rank's share of the summed
embedding dims) in fp32, and as encode, all-to-all of the FP8 payload, decode with the project's
:class:`~loka_torchrec.comms.codec.Fp8CommCodec` in the direction's format. It takes the median
of ``reps`` runs after ``warmup`` runs, reduces the medians over ranks with MAX (every rank then
holds the same numbers and takes the same decision) and keeps, per direction, the precision
that was faster. One rank sends nothing over a link, so there fp32 is chosen without timing.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, Optional, Sequence

import torch
import torch.distributed as dist

from loka_torchrec.comms.choice import DIRECTIONS, CommsChoice
from loka_torchrec.comms.codec import Fp8CommCodec
from loka_torchrec.comms.config import CommsConfig
from loka_torchrec.comms.ranks import max_over_ranks, world_size
from loka_torchrec.comms.registry import resolve_block

__all__ = ["decide", "wall_timer", "ONE_RANK_REASON", "DEFAULT_ROWS", "DEFAULT_WIDTH", "MAX_VALUES"]

ONE_RANK_REASON = "one rank: the all-to-all crosses no link"
DEFAULT_ROWS = 512
"""Rows per rank timed when the run's batch size is not known."""
DEFAULT_WIDTH = 128
"""Width timed when the model's embedding dims are not known."""
MAX_VALUES = 1 << 22
"""At most this many values per rank are timed (16 MiB in fp32): the timing stays bounded."""

Timer = Callable[[str, Callable[[], None]], float]


def wall_timer(device: torch.device) -> Timer:
    """``timer(label, run)``: seconds of one ``run()``, the device synchronized before and after."""

    def timer(label: str, run: Callable[[], None]) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    return timer


def _payload(config: CommsConfig, world: int, embedding_dims: Sequence[int], batch_size: Optional[int]):
    """``(rows_per_rank, width, block, description)`` of the timed all-to-all."""
    dims = [int(d) for d in embedding_dims]
    block, _ = resolve_block(config, dims or None)
    if dims:
        width = -(-sum(dims) // world)  # the rank's share of the embedding dims, as table-wise sharding sends
        source = f"the model's embedding dims (sum {sum(dims)}) over {world} ranks"
    else:
        width = DEFAULT_WIDTH
        source = f"embedding dims unknown: width {DEFAULT_WIDTH}"
    width = max(block, -(-width // block) * block)
    if batch_size:
        rows = int(batch_size)
        source += f", batch {rows} rows per rank"
    else:
        rows = DEFAULT_ROWS
        source += f", batch size unknown: {DEFAULT_ROWS} rows per rank"
    if rows * width * world > MAX_VALUES:
        rows = max(1, MAX_VALUES // (width * world))
        source += f" (capped to {rows} rows)"
    return rows, width, block, source


def decide(
    config: CommsConfig,
    *,
    process_group=None,
    device: Optional[torch.device] = None,
    embedding_dims: Sequence[int] = (),
    batch_size: Optional[int] = None,
    reps: int = 5,
    warmup: int = 2,
    timer: Optional[Timer] = None,
) -> CommsChoice:
    """The precision of each ``"auto"`` direction of ``config``, decided as the module docstring says.

    A collective: every rank of ``process_group`` calls it with the same arguments (before the
    first training step). Fixed directions are reported as given and not timed.

    Args:
        config: the comm config; its ``"auto"`` directions are decided.
        process_group: the ranks of the embedding all-to-all (default: the whole world).
        device: where the payload lives; default: the current CUDA device under NCCL, else CPU.
        embedding_dims: the embedding dims of all tables (the timed width is their sum over the
            world size); empty: :data:`DEFAULT_WIDTH`.
        batch_size: rows per rank; ``None``: :data:`DEFAULT_ROWS`.
        reps: timed runs per candidate (median); ``warmup``: untimed runs first.
        timer: ``timer(label, run) -> seconds`` (label ``"<direction>/<precision>"``); default
            :func:`wall_timer`.

    Example::

        >>> decide(CommsConfig()).forward  # no process group: one rank
        'fp32'
    """
    if not isinstance(config, CommsConfig):
        raise TypeError(f"config: expected a CommsConfig, got {type(config).__name__}")
    if reps < 1 or warmup < 0:
        raise ValueError(f"reps, warmup: expected reps >= 1 and warmup >= 0, got {reps}, {warmup}")
    started = time.perf_counter()
    directions = tuple(d for d in DIRECTIONS if getattr(config, d) == "auto")
    world = world_size(process_group)
    if world == 1:
        resolved = config.resolved("fp32", "fp32")
        return CommsChoice(
            resolved.forward, resolved.backward, decided=directions, reasons={d: ONE_RANK_REASON for d in directions},
            world_size=1, seconds=time.perf_counter() - started,
        )  # fmt: skip
    if device is None:
        backend = str(dist.get_backend(process_group))
        device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
    device = torch.device(device)
    timer = timer if timer is not None else wall_timer(device)
    rows, width, block, source = _payload(config, world, embedding_dims, batch_size)
    x = torch.randn(world * rows, width, device=device)

    def fp32_run() -> None:
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=process_group)

    def fp8_run(codec: Fp8CommCodec) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():  # FP8 bytes on the wire, as TorchRec's async all-to-all sends them
                ctx = codec.create_context()
                payload = codec.encode(x, ctx)
                split = codec.calc_quantized_size(rows * width, ctx)
                out = torch.empty(world * split, dtype=payload.dtype, device=device)
                dist.all_to_all_single(out, payload, [split] * world, [split] * world, group=process_group)
                codec.decode(out, ctx)

        return run

    runs: Dict[str, Callable[[], None]] = {}
    for direction in directions:
        fmt = config.forward_format if direction == "forward" else config.backward_format
        codec = Fp8CommCodec(fmt, block=block, scale_format=config.scale_format, kernel=config.kernel, name=f"auto/{direction}")
        runs[f"{direction}/fp32"] = fp32_run
        runs[f"{direction}/fp8"] = fp8_run(codec)
    samples: Dict[str, list] = {label: [] for label in runs}
    for rep in range(warmup + reps):
        for label, run in runs.items():  # candidates interleaved: drift hits both alike
            seconds = timer(label, run)
            if rep >= warmup:
                samples[label].append(seconds)
    labels = list(runs)
    medians = max_over_ranks([statistics.median(samples[label]) for label in labels], process_group, device)
    ms = {label: 1e3 * float(v) for label, v in zip(labels, medians)}
    chosen, reasons, times = {}, {}, {}
    for direction in directions:
        t32, t8 = ms[f"{direction}/fp32"], ms[f"{direction}/fp8"]
        times[direction] = {"fp32": t32, "fp8": t8}
        chosen[direction] = "fp8" if t8 < t32 else "fp32"
        faster = "fp8 (encode + all-to-all + decode) faster than fp32" if t8 < t32 else "fp8 not faster than fp32"
        ratio = f", {t8 / t32:.2f}x of its time" if t32 > 0 else ""
        reasons[direction] = f"measured: {faster}{ratio} (slowest rank)"
    resolved = config.resolved(chosen.get("forward", "fp32"), chosen.get("backward", "fp32"))
    payload = {"rows_per_rank": rows, "width": width, "block": block, "values_per_rank": rows * width * world,
               "reps": reps, "warmup": warmup, "source": source}  # fmt: skip
    return CommsChoice(
        resolved.forward, resolved.backward, decided=directions, reasons=reasons, times_ms=times, payload=payload,
        world_size=world, seconds=time.perf_counter() - started,
    )  # fmt: skip
