"""Triton kernels (installed as ``loka_torchrec.kernels``); each sits beside its launcher and a pure-torch reference.

* :mod:`~loka_torchrec.kernels.fp8_quantize`: fused amax + scale + FP8 cast (rowwise, tensorwise,
  1x128 blockwise), optionally with the transposed operand for the grad-weight GEMM;
* :mod:`~loka_torchrec.kernels.blocknorm_hardswish_quantize`: BlockNorm + Hard Swish + rowwise
  quantization, the producer epilogue of the Mods;
* :mod:`~loka_torchrec.kernels.fp8_gemm`: FP8 GEMM with the scales, bias and activation in the
  epilogue;
* :mod:`~loka_torchrec.kernels.fp8_comm_codec`: the FP8 all-to-all codec.

Importing a kernel module registers its ``torch.library`` ops (namespace ``loka``); it never
needs a GPU, and without Triton only the launchers fail (with the reason). This package itself
imports nothing, so ``import loka_torchrec`` stays free of Triton.
"""
