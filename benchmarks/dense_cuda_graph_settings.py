"""How ``reduce-overhead``'s Inductor settings record CUDA graphs on DHEN xl's dense part (one GPU).

The dense part (``DhenOverArch``, xl preset, fp32 weights under bf16 autocast, batch 8192, an
Adagrad step and ``cudagraph_mark_step_begin`` after each backward, as the training job runs it) is
compiled four ways, each timed over 12 steps of a fixed batch and 6 of changing batch sizes (a
dynamic dim after one recompile):

* ``skip_dynamic``: ``triton.cudagraphs`` + ``triton.cudagraph_skip_dynamic_graphs`` with Inductor's
  graph partitions (on by default);
* ``nopartition``: what :func:`loka_torchrec.compile.compile_dense` passes now (the same, partitions off);
* ``mode``: ``mode="reduce-overhead"`` alone; ``whole``: the same on the whole forward;
* ``default``: ``mode="default"`` (no CUDA graphs).

Printed per variant: step times, Inductor's CUDA-graph counters, and the symbols that Inductor's
scheduler reports for its nodes (which decide ``skip_dynamic``'s partitions). Usage, from the
repository root with the project importable: ``python benchmarks/dense_cuda_graph_settings.py
[variant ...]``.
"""
import sys, time, statistics, collections
from unittest import mock
import torch
sys.path.insert(0, "benchmarks")
from dense_part_step import build, inputs
import loka_torchrec.compile as lc
import torch._inductor.scheduler as sched

SYMS = collections.OrderedDict()
_orig = sched.get_scheduler_node_symbol_uses
def _traced(node):
    out = _orig(node)
    for s in out:
        if str(s) not in SYMS:
            src = None
            try:
                from torch._inductor.virtualized import V
                env = V.graph.sizevars.shape_env
                src = [x.name() for x in env.var_to_sources.get(s, [])][:3]
                val = env.var_to_val.get(s)
            except Exception as e:  # noqa
                val = repr(e)
            SYMS[str(s)] = (node.get_name(), src, val)
    return out
sched.get_scheduler_node_symbol_uses = _traced

device = torch.device("cuda")
dense, pooled = inputs("xl", 8192, device)
dense = dense.float()

def run(name, compile_fn, steps=12, varying=(8000, 7936, 8100, 8050, 7990, 8010)):
    torch.manual_seed(0)
    model = build("xl", device, mods=False)  # fp32 weights, as the job
    compile_fn(model)
    opt = torch.optim.Adagrad(model.parameters(), lr=1e-4)
    times = []
    before = dict(torch._dynamo.utils.counters["inductor"])
    SYMS.clear()
    for i in range(steps):
        torch.cuda.synchronize(); t = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(dense, pooled).float().sum()
        loss.backward()
        opt.step(); opt.zero_grad(set_to_none=True)
        torch.compiler.cudagraph_mark_step_begin()
        torch.cuda.synchronize(); times.append((time.perf_counter() - t) * 1e3)
    vt = []
    for b in varying:  # a batch of another size each step: one recompile, then dynamic shapes
        from torchrec.sparse.jagged_tensor import KeyedTensor
        kt = KeyedTensor(keys=pooled.keys(), length_per_key=pooled.length_per_key(), values=pooled.values()[:b])
        torch.cuda.synchronize(); t = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(dense[:b], kt).float().sum()
        loss.backward()
        opt.step(); opt.zero_grad(set_to_none=True)
        torch.compiler.cudagraph_mark_step_begin()
        torch.cuda.synchronize(); vt.append((time.perf_counter() - t) * 1e3)
    print(f"[probe] {name}: varying batch step ms {[round(x, 1) for x in vt]}", flush=True)
    after = torch._dynamo.utils.counters["inductor"]
    diff = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0) and "cudagraph" in k}
    print(f"[probe] {name}: step ms {[round(x, 1) for x in times]}; median last 6 {statistics.median(times[-6:]):.2f}; mem {torch.cuda.max_memory_allocated()/2**30:.2f} GiB; counters {diff}", flush=True)
    print(f"[probe] {name}: symbols used by scheduler nodes: {dict(list(SYMS.items())[:12])} (total {len(SYMS)})", flush=True)
    torch.compiler.reset(); torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()

which = sys.argv[1:] or ["skip_dynamic", "mode", "whole", "default"]
for w in which:
    try:
        if w == "skip_dynamic":
            with mock.patch.object(lc, "_mode_or_options", lambda mode: {"options": {"triton.cudagraphs": True, "triton.cudagraph_skip_dynamic_graphs": True}}):
                run(w, lambda m: lc.compile_dense(m, "reduce-overhead"))
        elif w == "mode":
            with mock.patch.object(lc, "_mode_or_options", lambda mode: {"mode": mode}):
                run(w, lambda m: lc.compile_dense(m, "reduce-overhead"))
        elif w == "nopartition":
            run(w, lambda m: lc.compile_dense(m, "reduce-overhead"))
        elif w == "whole":
            def f(m):
                m.forward = torch.compile(m.forward, mode="reduce-overhead", fullgraph=True)
            run(w, f)
        elif w == "default":
            run(w, lambda m: lc.compile_dense(m, "default"))
    except Exception as e:
        print(f"[probe] {w}: failed {type(e).__name__}: {e}", flush=True)
