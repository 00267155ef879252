"""A configurable MLP classifier: Linear -> activation, repeated, then a Linear to class logits."""

from __future__ import annotations

import numpy as np

from mpifsdp import Tensor, ops
from mpifsdp.layers import Linear, Module

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
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}: choose one of {sorted(ACTIVATIONS)}")
        rng = np.random.default_rng(seed)
        self.layers = [
            Linear(a, b, rng=rng, std=1.0 / np.sqrt(a), dtype=dtype, device=device)
            for a, b in zip(sizes[:-1], sizes[1:])
        ]
        self._act = ACTIVATIONS[activation]

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
