"""How long the synthetic data takes to make one train batch on the CPU, per recipe.

The training job makes its batches in loader workers (``train.data_workers``); this says how many
workers a recipe needs to keep a step of a given length fed: one worker makes one batch in the
time printed here.

Usage::

    python benchmarks/synthetic_batch_cost.py --recipes dhen_large,dlrm_large,hstu_large --batches 10
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from loka_job.training.data import make_data


def batch_ms(recipe: str, batches: int) -> float:
    """Median wall time (ms) of making one train batch of ``recipe``'s data on this process."""
    with initialize_config_module(config_module="loka_job.recipes", version_base=None):
        cfg = compose(config_name="config", overrides=[f"model={recipe}"])
    data = make_data(OmegaConf.to_container(cfg.data, resolve=True), rank=0, world_size=1, seed=0)
    split = data.train_split
    split.batch(0)  # warm: the teacher is made and calibrated once
    times = []
    for i in range(1, batches + 1):
        t0 = time.perf_counter()
        split.batch(i)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", default="dhen_large,dlrm_large,hstu_large")
    p.add_argument("--batches", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (a loader worker has 1)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"| recipe | ms per train batch, {args.threads} thread(s), median of {args.batches} |")
    print("|---|---|")
    for recipe in [r for r in args.recipes.split(",") if r]:
        print(f"| {recipe} | {batch_ms(recipe, args.batches):.1f} |")


if __name__ == "__main__":
    main()
