"""GEMM kernels as Probe and Dispatch both see them: backends, recipes, and how they are measured.

* :mod:`~loka_torchrec.gemm.backends`: the registry of GEMM backends (``bf16``, ``scaled_mm``,
  ``fbgemm``, ``te``, ``triton``, ``emulated``), each declaring its recipes, devices, alignment and
  which recipes trace under ``torch.compile``;
* :mod:`~loka_torchrec.gemm.recipes`: how each operand of a role's GEMM is quantized;
* :mod:`~loka_torchrec.gemm.measure`, :mod:`~loka_torchrec.gemm.speed`: one role's GEMM through a
  candidate, its error against float64, its time (at the real shape, cache-cold, or as CUDA-graph
  replays); :mod:`~loka_torchrec.gemm.intervals`: the t-intervals of errors and the IQRs of times.

The flow is one way: the Probe measures candidates with these and hands evidence to Dispatch, which
plans and runs them with these; neither imports the other.
"""
