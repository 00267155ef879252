"""The functional API: one function per primitive, taking Tensors (or arrays) and recording the node.

What layers, models and users call as `mpifsdp.ops.<name>`; the loss (with its collective) is loss.py.
"""

from __future__ import annotations

from ..autodiff.tensor import Tensor, apply


def matmul(a, b) -> Tensor:
    return apply("matmul", a, b)


def linear(x, weight, bias=None, transpose_w=False, gelu_input=False) -> Tensor:
    """x @ weight + bias; gelu_input=True applies GELU to x first without storing gelu(x)."""
    args = (x, weight) if bias is None else (x, weight, bias)
    return apply("linear", *args, transpose_w=transpose_w, gelu_input=gelu_input)


def linear_add(
    x, weight, bias, residual, transpose_w=False, gelu_input=False, gelu_bias=None, seed=None
) -> Tensor:
    """residual + linear(x, weight, bias) as one op. gelu_bias (with gelu_input): the input is
    gelu(x + gelu_bias). seed: where a device's implementation offers one (nn/layers.py
    branch_seed), the output begun by the LayerNorm before it."""
    inputs = (x, weight, bias, residual) + (() if gelu_bias is None else (gelu_bias,))
    settings = dict(transpose_w=transpose_w, gelu_input=gelu_input) | _given(seed=seed)
    return apply("linear_add", *inputs, **settings)


def _given(**settings) -> dict:
    """The settings that are not None: a device's own ones, which the reference does not take."""
    return {k: v for k, v in settings.items() if v is not None}


def relu(x) -> Tensor:
    return apply("relu", x)


def gelu(x) -> Tensor:
    return apply("gelu", x)


def softmax(x, axis=-1) -> Tensor:
    return apply("softmax", x, axis=axis)


def log_softmax(x, axis=-1) -> Tensor:
    return apply("log_softmax", x, axis=axis)


def concatenate(tensors, axis=0) -> Tensor:
    return apply("concatenate", *tensors, axis=axis)


def layer_norm(x, weight, bias=None, eps=1e-5) -> Tensor:
    args = (x, weight) if bias is None else (x, weight, bias)
    return apply("layer_norm", *args, eps=eps)


def layer_norm_linear(
    x, ln_weight, ln_bias, weight, bias=None, eps=1e-5, transpose_w=False, seed=None
) -> Tensor:
    """linear(layer_norm(x)) as one op: the normalized x is recomputed in backward, not stored. seed:
    where a device's implementation offers one (nn/layers.py branch_seed), it writes there too."""
    args = [a for a in (x, ln_weight, ln_bias, weight, bias) if a is not None]
    settings = dict(ln_bias=ln_bias is not None, bias=bias is not None, eps=eps, transpose_w=transpose_w)
    settings |= _given(seed=seed)
    return apply("layer_norm_linear", *args, **settings)


def embedding(weight, idx) -> Tensor:
    idx = idx.data if isinstance(idx, Tensor) else idx
    return apply("embedding", weight, idx=idx)


def attention(q, k, v, scale=None) -> Tensor:
    return apply("attention", q, k, v, scale=scale)


def attention_qkv(qkv, n_head: int, scale=None) -> Tensor:
    """Causal attention of the (B, T, 3C) fused projection [q | k | v], heads side by side: (B, T, C)."""
    return apply("attention_qkv", qkv, n_head=n_head, scale=scale)


def dropout(x, p: float, seed: int) -> Tensor:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    return x if p == 0.0 else apply("dropout", x, p=p, seed=seed)
