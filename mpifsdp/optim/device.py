"""What a device runs in an optimizer's step in place of the reference's NumPy passes: the device
seam of optim/, as autodiff/tensor.py's is for primitives. mpifsdp/cuda/ registers the GPU's kernels
here when it is imported; an entry that cannot run returns False or None and the reference runs.

  "adamw_update"     adamw_update's arguments, one flat group in one launch -> bool
  "adamw_step_all"   (an AdamW, its step's updates) every group in one launch -> bool
  "sums_of_squares"  (gradients) each one's g @ g, as one device array to read with the verdict
  "whole_step"       () the device's side of a whole-step graph (device_step.py: ready, queue)
"""

from __future__ import annotations

from collections.abc import Callable

from ..base.backend import device_kind

ON_DEVICE: dict[tuple[str, str], Callable] = {}


def implement(what: str, device: str):
    """Decorator registering a function as `device`'s `what` (one of the names above)."""

    def register(fn):
        if (what, device) in ON_DEVICE:
            raise ValueError(f"optimizer step {what!r} has an implementation on {device!r} already")
        ON_DEVICE[what, device] = fn
        return fn

    return register


def on_device(what: str, array) -> Callable | None:
    """The device's own `what` for the device holding `array`, or None: the reference runs."""
    return ON_DEVICE.get((what, device_kind(array)))
