"""The training entry point with one injected fault, for the fault matrix (tests/test_faults.py).

``LOKA_FAULT=<kind>:<batch>[:<rank>]`` (rank: every rank when left out) picks the fault, and a
comma-separated list of such faults injects each at its batch (so that one run can carry several
faults that do not end it); the rest of the command line is the job's Hydra overrides, as for ``python -m loka_job.train``.
``<batch>`` counts train batches from 0 as the data hands them out (the pipeline fetches two
ahead of the step that trains them), so faults land at a fixed, repeatable point of the run.

Kinds:
    kill        SIGKILL this process when batch ``<batch>`` is fetched;
    kill_save   SIGKILL in the middle of writing checkpoint number ``<batch>`` (1 = the first);
    batch_inf   one ``inf`` in the dense features of batch ``<batch>``;
    batch_nan   every dense feature of batch ``<batch>`` NaN;
    weight_nan  one element of the first dense layer's weight set to NaN when batch ``<batch>`` is fetched;
    grad_nan    the first dense layer's weight gradient NaN once, from batch ``<batch>`` on;
    id_past_end the first id of batch ``<batch>``'s first feature set to its table's row count;
    id_negative the same id set to -1;
    raise       a RuntimeError (an unexpected error) when batch ``<batch>`` is fetched.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys

import torch

FAULT = os.environ.get("LOKA_FAULT", "")


def _parse(fault: str):
    parts = fault.split(":")
    kind, at = parts[0], int(parts[1])
    ranks = None if len(parts) < 3 else {int(parts[2])}
    return kind, at, ranks


def _mine(ranks) -> bool:
    return ranks is None or int(os.environ.get("RANK", "0")) in ranks


def _first_linear(model: torch.nn.Module) -> torch.nn.Module:
    """The first dense layer (``nn.Linear`` or ``LokaLinear``) of the sharded model."""
    return next(m for m in model.modules() if isinstance(m, torch.nn.Linear) or type(m).__name__ == "LokaLinear")


def install() -> None:
    if not FAULT:
        return
    faults = [_parse(fault) for fault in FAULT.split(",")]
    if len(faults) > 1 and any(kind in ("kill", "kill_save") for kind, _, _ in faults):
        raise ValueError(f"LOKA_FAULT: a kill ends the run, so it is the only fault of its run: {FAULT!r}")
    faults = [(kind, at) for kind, at, ranks in faults if _mine(ranks)]
    if not faults:
        return
    kind, at = faults[0]
    from loka_job.training import checkpoint, data as data_module, trainer as trainer_module
    from loka_job import train as train_module

    holder = {}
    original_init = trainer_module.Trainer.__init__

    def init(self, *args, **kwargs):
        holder["trainer"] = self
        original_init(self, *args, **kwargs)

    trainer_module.Trainer.__init__ = init

    if kind == "kill_save":
        original_write = checkpoint._HashingWriter.write
        saves = {"n": 0}
        original_save = checkpoint.save_checkpoint

        def save(*args, **kwargs):
            saves["n"] += 1
            return original_save(*args, **kwargs)

        def write(self, data):
            if saves["n"] == at and self.bytes > 4096:
                os.kill(os.getpid(), signal.SIGKILL)
            return original_write(self, data)

        checkpoint._HashingWriter.write = write
        checkpoint.save_checkpoint = save
        trainer_module.save_checkpoint = save
        return

    original_make_data = data_module.make_data

    def make_data(*args, **kwargs):
        rank_data = original_make_data(*args, **kwargs)
        train = rank_data.train

        def faulty(start_batch):
            for index, batch in enumerate(train(start_batch), start=start_batch):
                for kind, at in faults:
                    if index == at:
                        batch = _inject(kind, batch, holder.get("trainer"))
                yield batch

        return dataclasses.replace(rank_data, train=faulty, train_split=None)

    data_module.make_data = make_data
    train_module.__dict__.setdefault("_fault_installed", True)


def _inject(kind, batch, trainer):
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "raise":
        raise RuntimeError("injected fault")
    if kind in ("id_past_end", "id_negative"):
        return _bad_id(batch, trainer, past_end=kind == "id_past_end")
    if kind in ("batch_inf", "batch_nan"):
        dense = batch.dense_features.clone()
        if kind == "batch_inf":
            dense[0, 0] = float("inf")
        else:
            dense.fill_(float("nan"))
        return dataclasses.replace(batch, dense_features=dense)
    layer = _first_linear(trainer.model)  # DMP may have copied the unsharded module's parameters
    if kind == "weight_nan":
        with torch.no_grad():
            layer.weight.view(-1)[0] = float("nan")
    elif kind == "grad_nan":
        fired = {"done": False}

        def hook(grad):
            if fired["done"]:
                return grad
            fired["done"] = True
            return torch.full_like(grad, float("nan"))

        layer.weight.register_hook(hook)
    else:
        raise ValueError(f"LOKA_FAULT: unknown kind {kind!r}")
    return batch


def _bad_id(batch, trainer, *, past_end: bool):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    features = batch.sparse_features
    offsets = features.offset_per_key()
    index = next(i for i in range(len(features.keys())) if offsets[i + 1] > offsets[i])
    key = features.keys()[index]
    values = features.values().clone()
    values[offsets[index]] = _rows(trainer.model, key) if past_end else -1
    bad = KeyedJaggedTensor(keys=features.keys(), values=values, lengths=features.lengths(), weights=features.weights_or_none())
    return dataclasses.replace(batch, sparse_features=bad)


def _rows(model, feature: str) -> int:
    """The rows of the table that ``feature`` looks up, from the sharded model's TorchRec configs."""
    configs = [c for m in model.modules() for c in getattr(m, "_embedding_bag_configs", None) or ()]
    return next(c.num_embeddings for c in configs if feature in c.feature_names)


if __name__ == "__main__":
    install()
    from loka_job.train import main

    sys.argv[0] = "loka_job.train"
    main()
