"""Triton kernels (installed as ``loka_torchrec.kernels``); each sits beside its launcher and a pure-torch reference."""
