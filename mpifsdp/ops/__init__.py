"""The differentiable operations: `mpifsdp.ops.<name>` is the functional API (functional.py) and the
loss with its collective (loss.py). Underneath: the primitives, each forward next to its VJP
(primitives.py), the fused transformer kernels (fused.py), causal attention (causal_attention.py) and
their GPU kernels (gpu_kernels.py, gpu_layer_norm.py, gpu_cross_entropy.py; cuDNN's attention:
gpu_attention.py).

May import: autodiff, base.
"""

from . import primitives  # noqa: F401  (registers every primitive: primitives imports attention and fused)
from .functional import (
    attention,
    attention_qkv,
    concatenate,
    dropout,
    embedding,
    gelu,
    layer_norm,
    layer_norm_linear,
    linear,
    linear_add,
    log_softmax,
    matmul,
    relu,
    softmax,
)
from .loss import cross_entropy, mean_over_ranks

__all__ = [
    "attention",
    "attention_qkv",
    "concatenate",
    "cross_entropy",
    "dropout",
    "embedding",
    "gelu",
    "layer_norm",
    "layer_norm_linear",
    "linear",
    "linear_add",
    "log_softmax",
    "matmul",
    "mean_over_ranks",
    "relu",
    "softmax",
]
