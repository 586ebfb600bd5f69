"""``train.export_serving``: at the end of training, the dense modules as ``torch.export`` programs for serving.

The job's final evaluation runs its first batch with the dense modules eager (``loka_torchrec.compile.eager``)
and keeps each dense module's inputs (:func:`captured_inputs`). Rank 0 then, for each dense module
(:func:`loka_torchrec.compile.dense_modules`; the tables are served by TorchRec), works on a copy:
:func:`loka_torchrec.inference_modules` keeps FP8 where training runs it now (with LoKA off the
copy stays as trained), ``torch.export`` captures it with the batch dim free (any batch size; the
other dims as in the evaluation batch; where a model specializes on its batch, at the evaluation
batch, with the reason in ``serving.json``), and the program, run on the kept inputs (and, batch
free, on their first half) must give the copy's output exactly. It writes, atomically, to
``RUN_DIR/serving/``:

* ``<module>.pt2``: the program (``torch.export.load(path).module()``; it needs torch only: a
  ``KeyedTensor`` argument, such as the pooled embeddings, is passed as its values tensor, the keys and
  lengths fixed in the program (:class:`TensorInputs`));
* ``<module>.inputs.pt`` and ``<module>.expected.pt``: the kept inputs and the program's output on them;
* ``serving.json``: per module the files, what ``inference_modules`` made of it, and the check;
  and the evaluation of the whole model with the served copies swapped in, against the trained
  model and against high-precision copies of the same weights (:func:`plain_modules`): eval NE and
  AUC of each, on the same held-out batches, so that what FP8 serving costs in quality is a number.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn
from torch.utils._pytree import tree_map

from loka_job.training.errors import exception_line
from loka_torchrec.atomic_files import atomic_file, write_text_atomic
from loka_torchrec.json_values import to_jsonable
from loka_torchrec.inference import InferenceReport, export_program, inference_modules
from loka_torchrec.plain import plain_modules

__all__ = ["SERVING_DIR", "TensorInputs", "captured_inputs", "export_serving", "high_precision_copies", "serving_copies", "swapped", "write_serving"]

SERVING_DIR = "serving"


def _detached(value: Any) -> Any:
    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, value)


def _resolved(value: Any) -> Any:
    """A sharded module's output as the next module sees it: TorchRec's lazy awaitables waited for
    (the result is cached on the awaitable, so the module's own use does not wait again)."""
    from torchrec.distributed.types import LazyAwaitable

    return LazyAwaitable._wait_async(value) if isinstance(value, LazyAwaitable) else value


@contextlib.contextmanager
def captured_inputs(modules: Dict[str, nn.Module]) -> Iterator[Dict[str, Tuple[Any, ...]]]:
    """Inside the block, the first call of each module keeps its positional inputs (detached copies)."""
    captured: Dict[str, Tuple[Any, ...]] = {}

    def keeper(name: str):
        def hook(module, args):
            if name not in captured:
                captured[name] = _detached(tuple(_resolved(a) for a in args))

        return hook

    handles = [module.register_forward_pre_hook(keeper(name)) for name, module in modules.items()]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


class TensorInputs(nn.Module):
    """``module`` with each ``KeyedTensor`` argument passed as its values tensor, rebuilt inside with the
    keys and lengths fixed here: the program then takes plain tensors (``torch.export`` cannot take
    TorchRec's containers as inputs, and a serving process needs no TorchRec to call it)."""

    def __init__(self, module: nn.Module, layout: Tuple[Optional[Tuple[List[str], List[int], int]], ...]) -> None:
        super().__init__()
        self.module, self.layout = module, layout

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        from torchrec.sparse.jagged_tensor import KeyedTensor

        args = [
            t if spec is None else KeyedTensor(keys=spec[0], length_per_key=spec[1], values=t, key_dim=spec[2])
            for t, spec in zip(tensors, self.layout)
        ]
        return self.module(*args)


def _tensor_inputs(module: nn.Module, args: Tuple[Any, ...]) -> Tuple[nn.Module, Tuple[torch.Tensor, ...]]:
    """``module`` and ``args`` with every ``KeyedTensor`` argument as its values tensor (:class:`TensorInputs`)."""
    from torchrec.sparse.jagged_tensor import KeyedTensor

    if not any(isinstance(a, KeyedTensor) for a in args):
        return module, args
    layout = tuple((list(a.keys()), list(a.length_per_key()), a.key_dim()) if isinstance(a, KeyedTensor) else None for a in args)
    return TensorInputs(module, layout), tuple(a.values() if isinstance(a, KeyedTensor) else a for a in args)


def _served_copy(module: nn.Module) -> nn.Module:
    served = copy.deepcopy(module)
    for m in served.modules():  # torch.compile in place (nn.Module.compile): the copy runs its own forward
        if getattr(m, "_compiled_call_impl", None) is not None:
            m._compiled_call_impl = None
    return served


def serving_copies(
    modules: Dict[str, nn.Module], input_scaling: str, probe: Optional[Any] = None, *, serving_rows: Optional[int] = None
) -> Dict[str, Tuple[nn.Module, InferenceReport]]:
    """Per module, its serving copy (:func:`loka_torchrec.inference_modules` on a copy) and the report;
    ``probe`` (the run's ``ProbeCallback``, if any) gives static scales the layers' recorded input amaxes;
    ``serving_rows``: FP8 only where the layer's forward is faster at that many rows, timed on rank 0
    and replayed on the others (every rank serves the same model in the evaluation passes)."""
    timer = _rank0_timer() if serving_rows is not None else None
    out = {}
    for name, module in modules.items():
        amaxes = probe.input_amaxes(module) if probe is not None else None  # named as in the copy
        served = _served_copy(module).eval()
        report = inference_modules(served, input_scaling=input_scaling, input_amaxes=amaxes, serving_rows=serving_rows, timer=timer)
        out[name] = (served, report)
    return out


def _rank0_timer():
    """A serving timer that times on rank 0 and gives every other rank rank 0's times, call by call:
    ``inference_modules`` times the same layers in the same order on every rank (one plan), so one
    broadcast per call keeps the ranks' choices identical."""
    import torch.distributed as dist

    from loka_torchrec.inference_timing import time_serving_forward

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return time_serving_forward

    def timer(fp8, layer, rows):
        payload = [time_serving_forward(fp8, layer, rows) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(payload, src=0)
        return payload[0]

    return timer


def high_precision_copies(modules: Dict[str, nn.Module]) -> Dict[str, nn.Module]:
    """Per module, a copy with every LoKA layer plain again (:func:`loka_torchrec.plain_modules`): the
    same weights in the caller's precision, the reference FP8 serving is judged against."""
    return {name: plain_modules(_served_copy(module)).eval() for name, module in modules.items()}


@contextlib.contextmanager
def swapped(root: nn.Module, replacements: Dict[str, nn.Module]) -> Iterator[None]:
    """Inside the block, ``root``'s submodules named in ``replacements`` are those modules."""
    originals = {name: root.get_submodule(name) for name in replacements}

    def put(modules: Dict[str, nn.Module]) -> None:
        for name, module in modules.items():
            parent, _, child = name.rpartition(".")
            setattr(root.get_submodule(parent) if parent else root, child, module)

    put(replacements)
    try:
        yield
    finally:
        put(originals)


def _named(prefix: str, by_layer: Dict[str, Any]) -> Dict[str, Any]:
    """Layer names of a report, from the dense module's to the model's."""
    return {f"{prefix}.{layer}": value for layer, value in by_layer.items()}


def _save_tensor_file(path: str, value: Any) -> None:
    with atomic_file(path, "wb") as f:
        torch.save(value, f)


def export_serving(served: Dict[str, Tuple[nn.Module, InferenceReport]], captured: Dict[str, Tuple[Any, ...]], run_dir: str, *,
                   input_scaling: str = "dynamic") -> Dict[str, Any]:  # fmt: skip
    """Export each serving copy of ``served`` (:func:`serving_copies`) with its ``captured`` inputs
    (module docstring); rank 0 only. Returns what ``serving.json`` holds (:func:`write_serving`
    writes it). A module that did not run in the captured batch, or that ``torch.export`` cannot
    capture, is listed with the reason; the others are exported.
    """
    out_dir = os.path.join(run_dir, SERVING_DIR)
    os.makedirs(out_dir, exist_ok=True)
    entries: Dict[str, Any] = {}
    for name, (copy_, report) in served.items():
        if name not in captured:
            entries[name] = {"exported": False, "reason": "not called in the evaluation batch"}
            continue
        module, args = _tensor_inputs(copy_, captured[name])
        path = os.path.join(out_dir, f"{name}.pt2")
        tmp = os.path.join(out_dir, f".{name}.tmp{os.getpid()}.pt2")  # torch.export names archives *.pt2
        batch = int(next(t for t in torch.utils._pytree.tree_leaves(args) if isinstance(t, torch.Tensor)).shape[0])
        half = tree_map(lambda t: t[: max(batch // 2, 1)] if isinstance(t, torch.Tensor) and t.dim() else t, args)
        fixed_because = None  # why the program's batch is fixed (it is free unless torch.export refused that)
        try:
            with torch.no_grad():
                try:
                    program = export_program(module, args, tmp, dynamic_batch=True)
                except Exception as exc:  # noqa: BLE001 - a model that specializes on its batch: export it fixed
                    fixed_because = exception_line(exc, 300)
                    program = export_program(module, args, tmp, dynamic_batch=False)
                expected = module(*args)
                got = program.module()(*args)
                # A free batch dim is checked again at half the rows.
                verified_half = fixed_because is not None or bool(torch.equal(program.module()(*half), module(*half)))
            os.replace(tmp, path)
        except Exception as exc:  # an export failure is this module's, reported; training's results stand
            entries[name] = {"exported": False, "reason": exception_line(exc, 300)}
            continue
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        verified = bool(torch.equal(got, expected)) and verified_half
        _save_tensor_file(os.path.join(out_dir, f"{name}.inputs.pt"), args)
        _save_tensor_file(os.path.join(out_dir, f"{name}.expected.pt"), got)
        entries[name] = {
            "exported": True, "file": path, "verified": verified, "input_scaling": input_scaling,
            "summary": report.summary(), "fp8": _named(name, report.fp8), "high_precision": _named(name, report.high_precision),
            "static_inputs": _named(name, report.static_inputs), "dynamic_inputs": _named(name, report.dynamic_inputs),
            "timings": _named(name, report.timings),
            "batch": "dynamic" if fixed_because is None else batch,
            "checked_batches": [batch, max(batch // 2, 1)] if fixed_because is None else [batch],
        }  # fmt: skip
        if fixed_because is not None:
            entries[name]["batch_fixed_because"] = fixed_because
    write_serving(run_dir, entries)
    return entries


def write_serving(run_dir: str, entries: Dict[str, Any]) -> None:
    """``RUN_DIR/serving/serving.json``, atomically."""
    path = os.path.join(run_dir, SERVING_DIR, "serving.json")
    write_text_atomic(path, json.dumps(to_jsonable(entries), indent=1, sort_keys=True, allow_nan=False) + "\n")
