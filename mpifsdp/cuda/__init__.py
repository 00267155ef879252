"""The GPU's home: every kernel, cuBLAS and cuDNN call of mpifsdp, and the GPU implementations of
the primitives, registered for device 'cuda' at import (autodiff/tensor.py's `implement`: the device
seam). A CPU run imports this package but never runs it, and CuPy is imported only by base/backend.py
when a GPU is asked for.

  fused.py, attention.py   the primitives' GPU implementations (their fusions: fused.py's docstring)
  kernels.py               GELU and the causal softmax as kernels; layer_norm.py, cross_entropy.py
                           LayerNorm and the loss as raw kernels (their .cu files beside them)
  gemm.py, cublas_api.py   2-D GEMMs through cuBLAS's C API (a CUDA graph captures them)
  sdpa.py                  causal attention through cuDNN's fused SDPA
  adamw.py, norm.py        the optimizer's update and the gradient norm's sums of squares as kernels,
                           registered for optim/device.py
  step.py                  the step's verdict as kernels and the whole step queued for a graph

May import: optim (its device seam: optim/device.py), ops, autodiff, base.
"""

from . import adamw, attention, fused, norm, step  # noqa: F401  (each registers its GPU implementations)
