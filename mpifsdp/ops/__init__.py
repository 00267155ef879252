"""The differentiable operations: `mpifsdp.ops.<name>` is the functional API (functional.py) and the
loss with its collective (loss.py). Underneath: the primitives, each forward next to its VJP
(primitives.py), the fused transformer primitives (fused.py) and causal attention
(causal_attention.py): the reference implementations, NumPy's arithmetic. A GPU runs its own,
registered by mpifsdp/cuda/ (the device seam: autodiff/tensor.py's `implementation`).

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
