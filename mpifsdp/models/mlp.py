"""A configurable MLP classifier: Linear -> activation, repeated, then a Linear to class logits."""

from __future__ import annotations

import numpy as np

from mpifsdp import Tensor, ops
from mpifsdp.base.checks import is_count
from mpifsdp.nn.layers import Linear
from mpifsdp.nn.module import Module, ids_problem

ACTIVATIONS = {"relu": ops.relu, "gelu": ops.gelu, "tanh": lambda x: x.tanh()}


class MLPClassifier(Module):
    def __init__(
        self,
        sizes: list[int],
        activation: str = "relu",
        seed: int = 0,
        dtype=np.float32,
        device: str = "cpu",
    ):
        """sizes = [n_in, hidden..., n_classes]; weights ~ N(0, 1/fan_in) (He-style for depth)."""
        if len(sizes) < 2:
            raise ValueError(f"sizes needs an input and an output size, got {sizes}")
        if not all(is_count(n, 1) for n in sizes):
            raise ValueError(f"sizes are integers >= 1 (a layer of 0 units has no output), got {sizes}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}: choose one of {sorted(ACTIVATIONS)}")
        rng = np.random.default_rng(seed)
        self.layers = [
            Linear(a, b, rng=rng, std=1.0 / np.sqrt(a), dtype=dtype, device=device)
            for a, b in zip(sizes[:-1], sizes[1:])
        ]
        self._act = ACTIVATIONS[activation]

    def check_inputs(self, x, targets=None) -> str | None:
        """x (B, n_in) floats; targets (B,) class ids, or -1 (ignored)."""
        x = x.data if isinstance(x, Tensor) else x
        n_in, n_classes = self.layers[0].weight.shape[0], self.layers[-1].weight.shape[1]
        if not hasattr(x, "dtype") or x.dtype.kind != "f" or x.ndim != 2 or x.shape[1] != n_in:
            got = f"shape {tuple(x.shape)} {x.dtype}" if hasattr(x, "dtype") else type(x).__name__
            return f"x must be a float array of shape (batch, {n_in}), got {got}"
        if targets is None:
            return None
        problem = ids_problem("targets", targets, n_classes, ndim=1, ignore=-1)
        if problem is None and len(targets) != len(x):
            problem = f"{len(targets)} targets for {len(x)} samples"
        return problem

    def forward(self, x, targets=None):
        """x (B, n_in) -> logits (B, n_classes), or the mean cross-entropy given integer targets."""
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = self._act(x)
        if targets is None:
            return x
        targets = targets.data if isinstance(targets, Tensor) else targets
        return ops.cross_entropy(x, targets)
